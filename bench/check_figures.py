"""Every figure in the README, bench/README.md and docs/ names the result file and the key it comes from.

    python -m bench.check_figures                  # (make check-figures) one line per problem; exit 1 if any
    python -m bench.check_figures --suggest PAGE   # the keys that hold each unkeyed figure of PAGE

The syntax (also at the top of bench/README.md). A scope, an HTML comment on a line of its own, names the result
files; it lasts until the next scope, the next heading or `<!-- end figures -->`:

    <!-- figures: bench/results/albert.json bench/results/albert_reduced.json; not measured: 128,100 -->
    <!-- not measured: 16 128 -->      numbers that are no measurement (config values, sizes), listed as printed
    <!-- not measured: * -->           a scope of configuration values only: no number in it is a measurement

A scope opened before a page's first `## ` heading holds for the whole page: a heading returns to it.

A line with figures ends with its keys, one per figure in the order they are printed:

    | mlm | 800 | 0.6979 ± 0.0072 | <!-- = runs.mlm. pretrain.steps finetune.dev_mean finetune.dev_std -->

A key is a dotted path into the scope's first file (`[...]` quotes a segment: `quality[a*x+b].bias_mean`); a
token ending in `.` is a prefix for the keys after it on the line (`.` alone clears it); `albert_reduced:` switches
to another cited file (named by its path under bench/results/, without `.json`); `a/b` is the ratio of two keys;
`-` skips a figure (no measurement); in a text result file, `L12.3` is the third number on its line 12 (`L12`:
any number on it). A figure equals its
key's value rounded to the decimals printed (|value - figure| <= half a unit of the last printed digit; thousands
separators ignored); `15.4%` is a JSON value of 0.154; a ratio printed `3.26x` is a key (or `a/b`) whose value
rounds to 3.26. A key that holds a string (a `command`) matches the numbers inside it.

Every number outside backticks, code blocks, link targets and headings is a figure: one outside every scope, one
without a key, a key that is missing or a value that differs fails the check. A number glued to letters (`1.5B`,
`ZeRO-3`, `h200`) is a name; a ratio is digits followed by `x` (`0.60x`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import REPO, RESULTS

PAGES = ("README.md", "bench/README.md", "docs/*.md")
"""The pages checked, relative to the repository root."""

SCOPE = re.compile(r"<!--\s*(figures:|not measured:)(.*?)-->")
KEYS = re.compile(r"<!--\s*=(.*?)-->")
NUMBER = re.compile(r"(?:(?<=\d-)|(?<![\w.,/^+=§*-])(?:(?<=[\s|(\[])[-+])?)"  # a sign only after space, | ( [
                    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:%|x(?![\w/^])|(?![\w/^]|[.,]\d))")
"""A figure: optional sign, digits with optional thousands separators and decimals, then `%`, a ratio's `x`, or
nothing; not part of a word, a path, a version or an exponent. After `digit-` it is a range's end (`8-14`)."""
VALUE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
"""A number inside a result file's text or strings (`lr=0.001`, `1e-3`, `1,409`)."""
CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
TOKEN = re.compile(r"(?:\[[^\]]*\]|[^\s\[])+")
SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")


@dataclass
class Scope:
    files: tuple[str, ...]
    excluded: frozenset[str]
    line: int
    everything_excluded: bool = False


@dataclass
class Problem:
    page: str
    line: int
    figure: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.figure}: {self.why}"


@dataclass
class Results:
    """The result files of one check, each read once; `alias` is a file's path under bench/results/ without
    `.json` (`h200/train_step_1.5b`)."""
    root: Path
    cache: dict[str, object] = field(default_factory=dict)

    def load(self, rel: str):
        if rel not in self.cache:
            path = self.root / rel
            self.cache[rel] = json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
        return self.cache[rel]

    def alias(self, rel: str) -> str:
        name = rel.removeprefix(RESULTS.relative_to(REPO).as_posix() + "/")
        return name.removesuffix(".json")


# ----------------------------------------------------------------------------------------------- values

def numbers_in(text: str) -> list[float]:
    return [float(m.group().replace(",", "")) for m in VALUE.finditer(text)]


def resolve(data, path: str) -> list[float]:
    """The values a key names: a JSON number, the numbers inside a JSON string, or (text file) the numbers on a
    line (`L12`) or the n-th of them (`L12.3`). Raises KeyError naming the first segment that does not exist."""
    if isinstance(data, str):
        m = re.fullmatch(r"L(\d+)(?:\.(\d+))?", path)
        lines = data.splitlines()
        if not m or not 1 <= int(m[1]) <= len(lines):
            raise KeyError(f"{path} (a text file's key is L<line> or L<line>.<n>, its n-th number)")
        numbers = numbers_in(lines[int(m[1]) - 1])
        if m[2] is None:
            return numbers
        if not 1 <= int(m[2]) <= len(numbers):
            raise KeyError(f"{path} (line {m[1]} holds {len(numbers)} numbers)")
        return [numbers[int(m[2]) - 1]]
    node = data
    for m in SEGMENT.finditer(path):
        seg = m.group(1) if m.group(1) is not None else m.group(2)
        if isinstance(node, dict) and seg in node:
            node = node[seg]
        elif isinstance(node, list) and seg.lstrip("-").isdigit() and -len(node) <= int(seg) < len(node):
            node = node[int(seg)]
        else:
            raise KeyError(f"{path} (no {seg!r})")
    if isinstance(node, bool) or node is None or isinstance(node, (dict, list)):
        raise KeyError(f"{path} (not a number)")
    return numbers_in(node) if isinstance(node, str) else [float(node)]


def matches(figure: str, values: list[float], json_value: bool = True) -> bool:
    """`figure` as printed equals one of `values` rounded to its decimals; a percentage of a JSON value is the
    value x 100; a ratio (`3.26x`) is compared as the number."""
    plain = figure.replace(",", "").lstrip("+")
    percent = plain.endswith("%")
    plain = plain.rstrip("%x")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    shown = float(plain)
    half = 0.5 * 10 ** -decimals
    for v in values:
        candidate = v * 100 if percent and json_value else v
        if math.isfinite(candidate) and abs(candidate - shown) <= half * (1 + 1e-9) + 1e-12:
            return True
    return False


# ----------------------------------------------------------------------------------------------- pages

def figure_spans(line: str, in_span: bool = False) -> list[tuple[str, int, int]]:
    """(figure, start, end) of each figure of a line of a page, markers, code spans and link targets left out;
    `in_span`: the line starts inside a code span opened on an earlier line."""
    def blank(m: re.Match) -> str:
        return " " * len(m.group())

    text = KEYS.sub(blank, SCOPE.sub(blank, ("`" if in_span else "") + line))
    if text.count("`") % 2:
        text += "`"
    text = LINK_TARGET.sub(lambda m: "]" + " " * (len(m.group()) - 1), CODE.sub(blank, text))
    shift = 1 if in_span else 0
    return [(m.group(), m.start() - shift, m.end() - shift) for m in NUMBER.finditer(text)]


def figures(line: str, in_span: bool = False) -> list[str]:
    """The figures of a line of a page (`figure_spans`)."""
    return [f for f, _, _ in figure_spans(line, in_span)]


def page_lines(page: Path):
    """(line number, line, in_span) for every line of a page outside code blocks; the line is None for a line that
    ends a scope (a heading, `<!-- end figures -->`), with True in place of `in_span` for a `## ` heading;
    `in_span`: the line starts inside a code span."""
    in_code = in_span = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code, in_span = not in_code, False
            continue
        if in_code:
            continue
        if line.startswith("#") or line.strip() == "<!-- end figures -->":
            in_span = False
            yield n, None, line.startswith("## ")
            continue
        yield n, line, in_span
        in_span = False if not line.strip() else in_span ^ (line.count("`") % 2 == 1)


def keys_of(line: str, in_span: bool = False) -> list[str] | None:
    """The key tokens of a line's `<!-- = ... -->` marker, None when it has none; a marker inside a code span
    (which Markdown would print) is none."""
    text = ("`" if in_span else "") + line
    found = KEYS.findall(CODE.sub(" ", text + "`" if text.count("`") % 2 else text))
    return None if not found else [t for body in found for t in TOKEN.findall(body)]


def _parse_scope(kind: str, body: str, line: int) -> Scope:
    parts = dict(map(str.strip, p.split(":", 1)) for p in f"{kind}{body}".split(";") if ":" in p)
    files = tuple(parts.get("figures", "").split())
    excluded = parts.get("not measured", "").split()
    return Scope(files, frozenset(excluded), line, everything_excluded="*" in excluded)


def expand(tokens: list[str], scope: Scope, results: Results) -> list[tuple[str, str, str] | None]:
    """A line's key tokens -> one (file, key, key) per figure (the two keys differ for a ratio), None for `-`."""
    aliases = {results.alias(f): f for f in scope.files}
    current, prefix, out = scope.files[0] if scope.files else "", "", []
    for tok in tokens:
        if tok.endswith(":") and tok[:-1] in aliases:
            current, prefix = aliases[tok[:-1]], ""
        elif tok == ".":
            prefix = ""
        elif tok.endswith("."):
            prefix = tok
        elif tok == "-":
            out.append(None)
        else:
            parts = re.split(r"/(?![^\[]*\])", tok)
            if len(parts) > 2:
                raise ValueError(f"{tok}: a ratio is a/b of two keys")
            num, den = (prefix + parts[0], prefix + parts[-1]) if len(parts) == 2 else (prefix + tok, "")
            out.append((current, num, den))
    return out


def key_values(key: tuple[str, str, str], results: Results) -> list[float]:
    rel, num, den = key
    data = results.load(rel)
    values = resolve(data, num)
    if den:
        [a], [b] = values, resolve(data, den)
        return [a / b] if b else []
    return values


def scoped_lines(page: Path):
    """(line number, line, in_span, scope, opened) for every line of a page that is not a heading or code block:
    the scope the line is in (None outside every scope) and whether the line opens it."""
    scope = default = None
    sections = False
    for n, line, in_span in page_lines(page):
        if line is None:
            scope, sections = default, sections or in_span
            continue
        opened = False
        for m in SCOPE.finditer(CODE.sub(" ", line)):
            scope, opened = _parse_scope(m.group(1), m.group(2), n), True
            if not sections:
                default = scope
        yield n, line, in_span, scope, opened


def check_page(page: Path, root: Path = REPO) -> list[Problem]:
    """The figures of one page without a key, or whose key's value differs."""
    name = page.relative_to(root).as_posix()
    problems: list[Problem] = []
    results = Results(root)
    for n, line, in_span, scope, opened in scoped_lines(page):
        if opened:
            problems += [Problem(name, n, f, "cited result file does not exist")
                         for f in scope.files if not (root / f).is_file()]
        problems += _check_line(name, n, line, in_span, scope, results)
    return problems


def _check_line(name: str, n: int, line: str, in_span: bool, scope: Scope | None,
                results: Results) -> list[Problem]:
    figs, tokens = figures(line, in_span), keys_of(line, in_span)
    if scope is None:
        return [Problem(name, n, f, "outside every scope (no result file cited, not marked not measured)")
                for f in figs] + ([Problem(name, n, "<!-- = -->", "keys outside a scope")] if tokens else [])
    if scope.everything_excluded:
        return []
    figs = [f for f in figs if f not in scope.excluded]
    if not figs and tokens is None:
        return []
    if not scope.files:
        return [Problem(name, n, f, f"in a not-measured scope (line {scope.line}) but not listed") for f in figs]
    if tokens is None:
        return [Problem(name, n, f, "no key (the line has no <!-- = ... --> marker)") for f in figs]
    if not all((results.root / f).is_file() for f in scope.files):
        return []
    try:
        keys = expand(tokens, scope, results)
    except ValueError as e:
        return [Problem(name, n, "<!-- = -->", str(e))]
    if len(keys) != len(figs):
        return [Problem(name, n, " ".join(figs), f"{len(figs)} figure(s) but {len(keys)} key(s)")]
    problems = []
    for fig, key in zip(figs, keys):
        if key is None:
            continue
        try:
            values = key_values(key, results)
        except (KeyError, ValueError) as e:
            problems.append(Problem(name, n, fig, f"{results.alias(key[0])}: no key {e}"))
            continue
        if not matches(fig, values, json_value=key[0].endswith(".json")):
            shown = ", ".join(f"{v:.6g}" for v in values[:3])
            problems.append(Problem(name, n, fig, f"{results.alias(key[0])}:{key[1]}"
                                    f"{'/' + key[2] if key[2] else ''} is {shown}"))
    return problems


def pages(root: Path = REPO) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def check(root: Path = REPO) -> list[Problem]:
    """Every problem of every page."""
    return [p for page in pages(root) for p in check_page(page, root)]


def count_keyed(root: Path = REPO) -> int:
    """How many figures of the pages are checked against a named key."""
    total = 0
    for page in pages(root):
        results = Results(root)
        for _, line, in_span, scope, _ in scoped_lines(page):
            tokens = keys_of(line, in_span)
            if scope and scope.files and tokens:
                total += sum(1 for t in expand(tokens, scope, results) if t is not None)
    return total


# ----------------------------------------------------------------------------------------------- suggestions

def leaves(data, prefix: str = ""):
    """(key, number) for every numeric leaf of a JSON document."""
    if isinstance(data, dict):
        for k, v in data.items():
            seg = k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else f"[{k}]"
            yield from leaves(v, f"{prefix}.{seg}" if prefix else seg)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from leaves(v, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield prefix, float(data)


def suggest(page: Path, root: Path = REPO) -> None:
    """Print, for each figure of `page` without a key, the keys of its scope's files that hold it."""
    results = Results(root)
    for n, line, in_span, scope, _ in scoped_lines(page):
        if scope is None or not scope.files or keys_of(line, in_span) is not None:
            continue
        for fig in (f for f in figures(line, in_span) if f not in scope.excluded):
            found = [f"{results.alias(f)}:{k}" for f in scope.files if f.endswith(".json")
                     for k, v in leaves(results.load(f)) if matches(fig, [v])]
            print(f"{n}: {fig}: {' '.join(found[:6]) or '-'}{' ...' if len(found) > 6 else ''}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.check_figures", description=__doc__.splitlines()[0])
    ap.add_argument("--suggest", type=Path, metavar="PAGE", help="print the keys that hold each unkeyed figure")
    args = ap.parse_args()
    if args.suggest:
        suggest(args.suggest.resolve())
        return 0
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)" if problems else
          f"every figure matches its key ({count_keyed()} keyed figures on {len(pages())} pages)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
