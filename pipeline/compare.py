"""`python -m pipeline.compare RUN_OR_VERSION RUN_OR_VERSION ...`: the rows of two or more runs, side by side.

Each argument is a pipeline run's id (its summary's "parent run") or a registry version one of its tasks registered
(models:/deberta-<preset>-<task>/VERSION, or @champion): the run's table (`suite.json`, pipeline/suite.py) is read
from MLflow (MLFLOW_TRACKING_URI, else the sqlite store of `--workdir`). One line per task and one for Avg: each
run's champion (mean ± spread over seeds), the difference from the first run, and whether that difference exceeds
the seeds' spread - |difference| > the two runs' spreads added (with one seed each there is no spread to compare
against: said as such, as DeBERTa reports the mean of five seeds for a reason). A task one run did not fine-tune
is "-". Bad input (fewer than two runs, one named twice, a run or version the store lacks, a run without a table)
is one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.suite import TABLE_FILE


class CompareError(Exception):
    """Bad input: printed as one `error:` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CompareError(f"{message}; see python -m pipeline.compare --help")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m pipeline.compare",
                description="Put the fine-tuned tasks' rows of two or more pipeline runs side by side.")
    p.add_argument("runs", nargs="*", metavar="RUN_OR_VERSION",
                   help="a pipeline run id (the summary's 'parent run') or models:/NAME/VERSION of a task it "
                        "registered; the first is the reference the others are compared with")
    p.add_argument("--workdir", type=Path, default=Path("workdir"),
                   help="whose MLflow store to read when MLFLOW_TRACKING_URI is not set (default: ./workdir)")
    return p


def check_runs(runs: list[str]) -> None:
    if len(runs) < 2:
        raise CompareError(f"give two or more runs to compare (got {len(runs)}): python -m pipeline.compare "
                           f"RUN_OR_VERSION RUN_OR_VERSION ...")
    twice = sorted({r for r in runs if runs.count(r) > 1})
    if twice:
        raise CompareError(f"{twice[0]} is given twice; name each run once")


def tracking_uri(workdir: Path) -> str:
    """MLFLOW_TRACKING_URI, else the workdir's sqlite store, which must exist (reading never creates one)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    db = workdir.expanduser().resolve() / "mlflow" / "mlflow.db"
    if not db.is_file():
        raise CompareError(f"no MLflow store at {db}: pass --workdir of the runs, or set MLFLOW_TRACKING_URI")
    return f"sqlite:///{db}"


def exceeds(diff: float, a: dict[str, Any], b: dict[str, Any]) -> str:
    """Whether a difference stands out from the seeds' spread: |diff| > spread(a) + spread(b)."""
    if a["seeds"] == 1 and b["seeds"] == 1:
        return "one seed each"
    return "yes" if abs(diff) > a["spread"] + b["spread"] else "no"


def side_by_side(tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per task (in the order the runs first list them) and Avg: each run's row (None where it lacks
    the task or did not finish it), and each later run's difference from the first with `exceeds`."""
    order = list(dict.fromkeys(r["task"] for t in tables for r in t["rows"]))
    out = []
    for task in order:
        cells = [next((r for r in t["rows"] if r["task"] == task and isinstance(r["champion"], float)), None)
                 for t in tables]
        diffs = [None if c is None or cells[0] is None else
                 (c["champion"] - cells[0]["champion"], exceeds(c["champion"] - cells[0]["champion"], cells[0], c))
                 for c in cells[1:]]
        metric = next(r["metric"] for t in tables for r in t["rows"] if r["task"] == task)
        out.append({"task": task, "metric": metric,
                    "cells": cells, "diffs": diffs})
    avgs = [t["avg"] for t in tables]
    out.append({"task": "Avg", "metric": "", "cells": [None if a is None else {"champion": a} for a in avgs],
                "diffs": [None if a is None or avgs[0] is None else (a - avgs[0], "") for a in avgs[1:]]})
    return out


def format_side_by_side(names: list[str], lines: list[dict[str, Any]]) -> str:
    head = f"{'task':<24} {'metric':<9}" + "".join(f" {n[:22]:>22}" for n in names) + \
        "".join(f" {'vs ' + n[:14]:>18} {'> spread':>13}" for n in names[1:])
    rows = [head]
    for line in lines:
        cells = ["-" if c is None else f"{c['champion']:.4f}" + (f" ± {c['spread']:.4f}" if "spread" in c else "")
                 for c in line["cells"]]
        diffs = ["-" if d is None else f"{d[0]:+.4f}" for d in line["diffs"]]
        flags = ["" if d is None else d[1] for d in line["diffs"]]
        rows.append(f"{line['task']:<24} {line['metric']:<9}" + "".join(f" {c:>22}" for c in cells)
                    + "".join(f" {d:>18} {f:>13}" for d, f in zip(diffs, flags)))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_runs(args.runs)
        uri = tracking_uri(args.workdir)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # stderr holds the one error line
        from core.registry import logged_json

        tables, names = [], []
        for ref in args.runs:
            try:
                run_id, table = logged_json(uri, ref, TABLE_FILE)
            except ValueError as e:
                raise CompareError(str(e)) from None
            tables.append(table)
            names.append(run_id[:12])
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"fine-tuned tasks of {len(tables)} runs ({uri}); the first is the reference; a difference exceeds the "
          f"spread when it is larger than the two runs' seed spreads added")
    for name, ref in zip(names, args.runs):
        print(f"  {name}: {ref}")
    print(format_side_by_side(names, side_by_side(tables)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
