"""The figures of the README, bench/README.md and docs/ are values of the result files they cite
(`bench.check_figures`, also `make check-figures`), and the check fails on a figure edited by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import check_figures
from bench.common import REPO


def test_committed_pages_cite_their_figures():
    problems = check_figures.check()
    assert not problems, "\n".join(map(str, problems))


def test_the_committed_pages_have_checked_figures():
    """The check is not empty: bench/README.md's scopes cite result files, and those hold figures it found."""
    page = REPO / "bench" / "README.md"
    text = page.read_text()
    assert text.count("<!-- figures:") >= 5
    assert check_figures.check_page(page) == []


@pytest.mark.parametrize("printed, value, ok", [
    ("0.6837", 0.68371, True), ("0.6837", 0.68376, False), ("3.13", 3.1304, True), ("1,567,828,068", 1567828068, True),
    ("1,081", 1081.19, True), ("1,082", 1081.19, False), ("15.36%", 0.1536, True), ("15.36%", 15.36, True),
    ("-0.0001", -0.0001, True), ("-0.0001", 0.0001, False), ("48.06", 48.0605, True), ("48.1", 48.0605, True),
])
def test_a_figure_matches_a_value_rounded_as_printed(printed, value, ok):
    assert check_figures.matches(printed, [value]) is ok


def _site(tmp_path: Path, page_text: str, result: dict) -> Path:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "x.json").write_text(json.dumps(result))
    page = tmp_path / "bench" / "README.md"
    page.write_text(page_text)
    return page


PAGE = """# X

<!-- figures: bench/results/x.json; not measured: 16 -->
`python -m bench.x --steps 99` ran 16 sequences: 1,234 tokens/s, loss 0.52 (`--step-s 3.7`).

| a | b |
|---|---|
| ours | 12.5% |

## Other

<!-- not measured: 4 -->
4 workers.
"""


def test_a_page_that_quotes_its_file_passes(tmp_path):
    page = _site(tmp_path, PAGE, {"tokens_per_s": 1234.4, "loss": 0.5151, "share": 0.125})
    assert check_figures.check_page(page, tmp_path, strict=True) == []


def test_a_figure_edited_by_hand_fails(tmp_path):
    page = _site(tmp_path, PAGE.replace("1,234", "1,243"), {"tokens_per_s": 1234.4, "loss": 0.5151, "share": 0.125})
    problems = check_figures.check_page(page, tmp_path, strict=True)
    assert [(p.line, p.figure) for p in problems] == [(4, "1,243")]


def test_a_figure_outside_any_scope_fails_on_a_strict_page(tmp_path):
    page = _site(tmp_path, PAGE + "\n## New\n\n7.5 s per step.\n", {"tokens_per_s": 1234.4, "loss": 0.52, "share": 0.125})
    assert [p.figure for p in check_figures.check_page(page, tmp_path, strict=True)] == ["7.5"]
    assert check_figures.check_page(page, tmp_path, strict=False) == []


def test_a_missing_result_file_fails(tmp_path):
    page = _site(tmp_path, PAGE.replace("x.json", "gone.json"), {})
    assert any("does not exist" in p.why for p in check_figures.check_page(page, tmp_path, strict=True))


def test_the_check_fails_when_the_committed_readme_is_edited(tmp_path):
    """A copy of the repository's pages and results with one figure of bench/README.md changed by hand."""
    for rel in ("README.md", "bench/README.md", "docs", "bench/results"):
        src, dst = REPO / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    assert check_figures.check(tmp_path) == []
    page = tmp_path / "bench" / "README.md"
    text = page.read_text()
    assert "| 0.6979 ± 0.0072 |" in text  # objectives.json: mlm's dev accuracy
    page.write_text(text.replace("| 0.6979 ± 0.0072 |", "| 0.7079 ± 0.0072 |"))
    assert [p.figure for p in check_figures.check(tmp_path)] == ["0.7079"]
