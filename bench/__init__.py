"""Benchmarks, one module each, run from the repository root as `python -m bench.NAME` (see bench/README.md).

Each prints one JSON report, then a table (`bench.common.emit`), and writes the JSON to `--json` when given; the
figures quoted in bench/README.md come from the files in bench/results/.
"""
