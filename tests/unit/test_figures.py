"""Every figure of the README, bench/README.md and docs/ names the result file and key it comes from
(`bench.check_figures`, also `make check-figures`), and the check fails on a figure or ratio edited by one digit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import check_figures
from bench.common import REPO


def test_committed_pages_match_their_keys():
    problems = check_figures.check()
    assert not problems, "\n".join(map(str, problems))


def test_the_committed_pages_key_their_figures():
    """The check is not empty: bench/README.md and docs/ key their figures, ratios among them."""
    assert check_figures.count_keyed() >= 1000
    text = (REPO / "bench" / "README.md").read_text()
    assert "3.26x datasketch's fast path" in text  # a ratio, keyed by name:
    assert " sizes.2.runs.this.derived.corpus_vs_datasketch_per_core_with_startup -->" in text
    assert "<!-- = artifacts.0. files bytes" in (REPO / "docs" / "faults.md").read_text()


@pytest.mark.parametrize("printed, value, ok", [
    ("0.6837", 0.68371, True), ("0.6837", 0.68376, False), ("3.13", 3.1304, True), ("1,567,828,068", 1567828068, True),
    ("1,081", 1081.19, True), ("1,082", 1081.19, False), ("15.36%", 0.1536, True), ("15%", 0.154, True),
    ("16%", 0.154, False), ("-0.0001", -0.0001, True), ("-0.0001", 0.0001, False), ("+0.0040", 0.004, True),
    ("48.1", 48.0605, True), ("3.26x", 3.2649, True), ("3.27x", 3.2649, False), ("8", 8.3134, True),
])
def test_a_figure_matches_a_value_rounded_as_printed(printed, value, ok):
    assert check_figures.matches(printed, [value]) is ok


@pytest.mark.parametrize("line, figures", [
    ("load average 8-14 at the end", ["8", "14"]),
    ("3.26x datasketch, 0.60x of torch, 1.5B params, ZeRO-3, h200, 2^30", ["3.26x", "0.60x"]),
    ("| +0.0040 | -0.0148 | 1,000,000 | 15.36% |", ["+0.0040", "-0.0148", "1,000,000", "15.36%"]),
    ("`--steps 6000` and [link](results/x_2.png) ran 4 <!-- = a.b -->", ["4"]),
])
def test_what_counts_as_a_figure(line, figures):
    assert check_figures.figures(line) == figures


RESULT = {"command": "python -m bench.x --steps 99", "runs": {"mlm": {"loss": 8.3134, "wall_s": 667.9},
                                                               "rtd es": {"loss": 6.4776, "wall_s": 574.2}},
          "load_average": [11.11, 9.0, 8.0], "share": 0.1536, "corpus_s": 100.2, "peer_s": 30.7}
PAGE = """# X

<!-- not measured: 2 -->
Pages open with the numbers that are no measurement: 2 workers.

## Runs

<!-- figures: bench/results/x.json bench/results/h200/y.txt; not measured: 16 -->
`python -m bench.x --steps 99` ran 16 sequences a step for 99 steps. <!-- = command -->

| run | loss | wall_s |
|---|---|---|
| mlm | 8.3134 | 667.9 | <!-- = runs.mlm. loss wall_s -->
| rtd es | 6.4776 | 574.2 | <!-- = runs.[rtd es]. loss wall_s -->

Corpus 3.26x the peer, 15.36% in the gather (4 of 5), load 11.11. <!-- = corpus_s/peer_s share - - load_average.0 -->
A text result: 0.3004 s against 0.3808 s. <!-- = h200/y.txt: L2.1 L2.2 -->
"""


def _site(tmp_path: Path, page_text: str, result: dict = RESULT) -> Path:
    (tmp_path / "bench" / "results" / "h200").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "x.json").write_text(json.dumps(result))
    (tmp_path / "bench" / "results" / "h200" / "y.txt").write_text("step_s_median\n0.3004 0.3808\n")
    page = tmp_path / "bench" / "README.md"
    page.write_text(page_text)
    return page


def _problems(tmp_path: Path, text: str, result: dict = RESULT) -> list[tuple[int, str]]:
    page = _site(tmp_path, text, result)
    return [(p.line, p.figure) for p in check_figures.check_page(page, tmp_path)]


def test_a_page_that_keys_its_figures_passes(tmp_path):
    assert _problems(tmp_path, PAGE) == []


@pytest.mark.parametrize("old, new, figure", [
    ("| 8.3134 |", "| 8.3135 |", "8.3135"), ("| 574.2 |", "| 574.3 |", "574.3"), ("3.26x", "3.27x", "3.27x"),
    ("15.36%", "15.37%", "15.37%"), ("load 11.11", "load 11.12", "11.12"), ("0.3004 s", "0.3005 s", "0.3005"),
    ("for 99 steps", "for 98 steps", "98"),
])
def test_a_figure_or_ratio_changed_by_one_digit_fails(tmp_path, old, new, figure):
    assert PAGE.count(old) == 1
    assert [f for _, f in _problems(tmp_path, PAGE.replace(old, new))] == [figure]


def test_two_figures_swapped_fail(tmp_path):
    swapped = PAGE.replace("0.3004 s against 0.3808", "0.3808 s against 0.3004")
    assert [f for _, f in _problems(tmp_path, swapped)] == ["0.3808", "0.3004"]


def test_a_figure_keyed_to_another_quantity_fails(tmp_path):
    """`load average 8` would equal the loss 8.3134 rounded as printed; keyed by name it is checked against the
    load average it claims to be."""
    assert _problems(tmp_path, PAGE.replace("load 11.11", "load 8")) == [(16, "8")]
    assert check_figures.matches("8", [8.3134])  # the value-anywhere rule this replaces would have passed it


def test_a_figure_without_a_key_or_scope_fails(tmp_path):
    text = PAGE
    assert _problems(tmp_path, text + "\nA new figure: 7.5 s. Another line.\n") == [(19, "7.5")]
    assert _problems(tmp_path / "b", text.replace(" <!-- = runs.mlm. loss wall_s -->", "")) == [
        (13, "8.3134"), (13, "667.9")]
    assert _problems(tmp_path / "c", text.replace("Pages open with", "Pages open, 3 times, with")) == [(4, "3")]


def test_a_missing_key_or_file_or_a_miscount_fails(tmp_path):
    text = PAGE
    assert [f for _, f in _problems(tmp_path, text.replace("runs.mlm. loss", "runs.mlm. lost"))] == ["8.3134"]
    assert _problems(tmp_path / "b", text.replace("loss wall_s -->", "loss -->", 1)) == [(13, "8.3134 667.9")]
    page = _site(tmp_path / "c", text.replace("x.json bench", "gone.json bench"))
    assert any("does not exist" in p.why for p in check_figures.check_page(page, tmp_path / "c"))


def test_a_configuration_scope_and_code_spans_are_not_figures(tmp_path):
    text = "# C\n\n<!-- not measured: * -->\n| `lr` | 0.001 | 16 |\n\n## D\n\nRun `x --a 1\n--b 2` here.\n"
    assert _problems(tmp_path, text) == []


def test_a_marker_inside_a_code_span_is_no_key(tmp_path):
    """Markdown prints a comment inside a code span, so the check does not read it as keys."""
    text = "# C\n\n<!-- figures: bench/results/x.json -->\nRan 99 steps: `python -m x <!-- = command -->\n--steps 99`\n"
    assert _problems(tmp_path, text) == [(4, "99")]
    moved = text.replace(" `python -m x <!-- = command -->", " <!-- = command -->\n`python -m x")
    assert _problems(tmp_path / "b", moved) == []


def _copy_site(tmp_path: Path) -> None:
    for rel in ("README.md", "bench/README.md", "docs", "bench/results"):
        src, dst = REPO / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)


EDITS = [  # (page, as printed, edited by one digit)
    ("bench/README.md", "| 0.6979 ± 0.0072 |", "| 0.6979 ± 0.0073 |"),   # objectives.json: mlm's dev accuracy std
    ("bench/README.md", "- Corpus at 1,000,000 documents: 3.26x", "- Corpus at 1,000,000 documents: 3.25x"),  # ratio
    ("bench/README.md", "| backbone | ours | 99374.6 | 0.156 |", "| backbone | ours | 99374.6 | 0.157 |"),  # h200 MFU
    ("bench/README.md", "The stage's kernel is 2.09x", "The stage's kernel is 2.08x"),  # a/b of two keys
    ("docs/faults.md", "| 7,734,418 |", "| 7,734,419 |"),                     # artifact_check.json
]
_TESTS_S = json.loads((REPO / "bench" / "results" / "make_test.json").read_text())["test_s"]
EDITS.append(("docs/testing.md", f"tests {_TESTS_S} s", f"tests {_TESTS_S + 0.1:.1f} s"))  # make_test.json, as measured


def test_the_check_fails_when_a_copy_of_the_pages_is_edited(tmp_path):
    """A copy of the repository's pages and results, each edit one digit of one figure or ratio."""
    _copy_site(tmp_path)
    assert check_figures.check(tmp_path) == []
    for page, old, new in EDITS:
        path = tmp_path / page
        text = path.read_text()
        assert text.count(old) == 1, old
        path.write_text(text.replace(old, new))
        problems = check_figures.check(tmp_path)
        assert len(problems) == 1 and problems[0].page == page and problems[0].figure in new, (new, problems)
        path.write_text(text)


def _one_digit_off(figure: str) -> str:
    """`figure` with its last digit moved by one (down for a 9)."""
    i = max(i for i, ch in enumerate(figure) if ch.isdigit())
    digit = int(figure[i])
    return figure[:i] + str(digit - 1 if digit == 9 else digit + 1) + figure[i + 1:]


def test_every_keyed_figure_fails_when_changed_by_one_digit():
    """Every figure of every page, each edited alone: the check of its line fails."""
    checked = 0
    for page in check_figures.pages():
        results = check_figures.Results(REPO)
        for n, line, in_span, scope, _ in check_figures.scoped_lines(page):
            tokens = check_figures.keys_of(line, in_span)
            if not (scope and scope.files and tokens):
                continue
            keys = check_figures.expand(tokens, scope, results)
            spans = [s for s in check_figures.figure_spans(line, in_span) if s[0] not in scope.excluded]
            for (fig, start, end), key in zip(spans, keys):
                if key is None:
                    continue
                edited = line[:start] + _one_digit_off(fig) + line[end:]
                assert check_figures._check_line(page.name, n, edited, in_span, scope, results), (page, n, fig)
                checked += 1
    assert checked == check_figures.count_keyed()
