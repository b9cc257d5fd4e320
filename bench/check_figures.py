"""Every figure in the README, bench/README.md and docs/ is a value of the result file it cites.

    python -m bench.check_figures          # (make check-figures) one line per figure not found; exit 1 if any

The convention (bench/README.md, "How a figure names its result file"): an HTML comment, invisible when rendered,
opens a scope that lasts until the next such comment, the next heading or `<!-- end figures -->`:

    <!-- figures: bench/results/albert.json bench/results/albert_reduced.json; not measured: 3,000 0.002 -->
    <!-- not measured: 16 128 -->           a scope of numbers that are no measurement (config values, sizes)

In a scope, every number outside backticks and code blocks must be one of the `not measured` tokens (as printed)
or equal, as printed, a value of one of the cited files: a number of a JSON file (leaf, numeric key, or inside a
string such as its `command`) or a number in the text of any other file, rounded to the printed decimals;
thousands separators are ignored; `12.5%` also matches 0.125. A number glued to letters (`1.5B`, `ZeRO-3`, `h200`,
`0.60x`) is a name, not a figure. In bench/README.md, the measurements page, a number outside every scope is an
error too; in the README and docs/ only scopes are checked.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO

PAGES = ("README.md", "bench/README.md", "docs/*.md")
"""The pages checked, relative to the repository root."""
STRICT = ("bench/README.md",)
"""Pages where every number must be in a scope."""

MARKER = re.compile(r"<!--\s*(figures:|not measured:)(.*?)-->")
NUMBER = re.compile(r"(?<![\w.,/^+=§-])(?:(?<=\s)-|^-|(?<=[|(])-)?"  # a minus only after a space, | or (
                    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?(?![\w/^]|[.,]\d)")
"""A figure: optional minus (after a space, a bar or a parenthesis), digits with optional thousands separators and
decimals, optional %; not part of a word, a path, a version or an exponent."""
VALUE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
"""A number inside a result file's text or strings (`lr=0.001`, `1e-3`, `1,409`): laxer than a figure, since it
only widens what a figure may match."""
CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


@dataclass
class Scope:
    files: tuple[str, ...]
    excluded: frozenset[str]
    line: int


@dataclass
class Problem:
    page: str
    line: int
    figure: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.figure}: {self.why}"


def _numbers_in_text(text: str) -> list[float]:
    return [float(m.group().replace(",", "")) for m in VALUE.finditer(text)]


def result_values(path: Path) -> list[float]:
    """The numbers a result file holds: a JSON file's numeric leaves, numeric keys and numbers inside strings;
    any other file's numbers in its text."""
    text = path.read_text()
    if path.suffix != ".json":
        return _numbers_in_text(text)
    out: list[float] = []

    def walk(x) -> None:
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, (int, float)):
            out.append(float(x))
        elif isinstance(x, str):
            out.extend(_numbers_in_text(x))
        elif isinstance(x, dict):
            for k, v in x.items():
                out.extend(_numbers_in_text(str(k)))
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads(text))
    return out


def matches(figure: str, values: list[float]) -> bool:
    """`figure` as printed equals one of `values` rounded to its decimals (a percentage: also the value x 100)."""
    plain = figure.replace(",", "")
    percent = plain.endswith("%")
    plain = plain.rstrip("%")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    shown = float(plain)
    half = 0.5 * 10 ** -decimals
    for v in values:
        for candidate in ((v, v * 100) if percent else (v,)):
            if math.isfinite(candidate) and abs(candidate - shown) <= half * (1 + 1e-9) + 1e-12:
                return True
    return False


def _figures(line: str) -> list[str]:
    text = LINK_TARGET.sub("]", CODE.sub(" ", MARKER.sub(" ", line)))
    return [m.group() for m in NUMBER.finditer(text)]


def _parse_marker(kind: str, body: str, line: int) -> Scope:
    parts = dict(map(str.strip, p.split(":", 1)) for p in f"{kind}{body}".split(";") if ":" in p)
    files = tuple(parts.get("figures", "").split())
    excluded = frozenset(parts.get("not measured", "").split())
    return Scope(files, excluded, line)


def check_page(page: Path, root: Path = REPO, strict: bool | None = None) -> list[Problem]:
    """The figures of one page that are not in the result files their scope cites."""
    name = page.relative_to(root).as_posix()
    strict = name in STRICT if strict is None else strict
    problems: list[Problem] = []
    scope: Scope | None = None
    values: dict[str, list[float]] = {}
    in_code = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("#"):
            scope = None
            continue
        if line.strip() == "<!-- end figures -->":
            scope = None
            continue
        for m in MARKER.finditer(line):
            scope = _parse_marker(m.group(1), m.group(2), n)
            for f in scope.files:
                if not (root / f).is_file():
                    problems.append(Problem(name, n, f, "cited result file does not exist"))
                elif f not in values:
                    values[f] = result_values(root / f)
        for fig in _figures(line):
            if scope is None:
                if strict:
                    problems.append(Problem(name, n, fig, "no result file cited (and not marked as not measured)"))
                continue
            if fig in scope.excluded:
                continue
            pool = [v for f in scope.files for v in values.get(f, [])]
            if not scope.files:
                problems.append(Problem(name, n, fig, f"in a not-measured scope (line {scope.line}) but not listed"))
            elif not matches(fig, pool):
                problems.append(Problem(name, n, fig, f"not a value of {', '.join(scope.files)}"))
    return problems


def pages(root: Path = REPO) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def check(root: Path = REPO) -> list[Problem]:
    """Every problem of every page."""
    return [p for page in pages(root) for p in check_page(page, root)]


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} figure(s) not found in their result files" if problems else
          f"every figure found in its result file ({len(pages())} pages)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
