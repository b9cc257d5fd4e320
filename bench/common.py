"""What the benches share: where the repository and the results live, argparse types for comma lists, the report
writer (the JSON, then a table), and the two ways a bench runs work in other processes.

Imports nothing of the project, and torch only inside the pool's worker initializer, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
"""The repository root: the working directory of every `python -m bench.NAME` and of the processes they start."""
RESULTS = REPO / "bench" / "results"
"""Where the reports quoted in bench/README.md live (`--json bench/results/NAME.json`)."""


# ----------------------------------------------------------------------------------------------- command line

def comma_choices(known: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma list, each item one of `known` (one clear error naming the first that is not)."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0] if bad else '(none given)'!r}; "
                                             f"use a comma list of: {', '.join(known)}")
        return names

    return parse


def comma_floats(text: str) -> tuple[float, ...]:
    """An argparse type: "1e-3,2e-3" -> (0.001, 0.002)."""
    return tuple(float(x) for x in text.split(",") if x.strip())


def comma_ints(text: str) -> tuple[int, ...]:
    """An argparse type: "16,32" -> (16, 32)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


# ----------------------------------------------------------------------------------------------- output

def command_line() -> str:
    """How this bench was started, for a report's `command` field: `python -m bench.NAME ARGS`."""
    import shlex

    return shlex.join(["python", "-m", f"bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages, for a report's `load_average` field (a shared machine's
    timings mean little without it)."""
    import os

    return [round(x, 2) for x in os.getloadavg()]


def emit(report: dict[str, Any], json_path: Path | None, table: str) -> None:
    """A bench's output: the JSON report (also written to `json_path` when given), then its table."""
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    print()
    print(table)


# ----------------------------------------------------------------------------------------------- processes

def set_torch_threads(threads: int) -> None:
    """Pool initializer: `threads` intra-op torch threads and one inter-op thread per worker process."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def process_pool(procs: int, threads: int) -> cf.ProcessPoolExecutor:
    """`procs` worker processes of `threads` torch threads each, started fresh (spawn: no forked torch thread
    pools), for benches that run independent jobs side by side."""
    return cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"), initializer=set_torch_threads,
                                  initargs=(threads,))


class WorkerFailed(RuntimeError):
    """A worker process exited non-zero; the message is the tail of its stderr."""


def run_worker(module: str, *argv: str) -> Any:
    """Run `python -m module *argv` from the repository root, alone (its peak memory is its own), and return the
    JSON on the last line of its stdout; WorkerFailed with the tail of its stderr if it exits non-zero."""
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise WorkerFailed(f"python -m {module} {' '.join(argv)[:200]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
