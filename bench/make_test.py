"""How long `make test` takes from a clean clone, as CI runs it: the install, then the whole suite.

Clones the repository's HEAD into a temporary directory, times `make install` and `make test` there separately,
and reads pytest's own summary line (passed, skipped, failed). Standard library only, so it runs before any venv
exists:

    python3 -m bench.make_test          # about half an hour on a 2-core machine
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import REPO, RESULTS, emit


def timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, int]:
    started = time.monotonic()
    with open(log, "a") as out:
        rc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    return time.monotonic() - started, rc


def pytest_counts(log: str) -> dict[str, int]:
    """pytest's last summary line (`365 passed, 2 skipped, 28 warnings in 1024.73s`, `=`-framed or not)."""
    summary = re.findall(r"^=* ?(\d+ (?:passed|failed).*) in [\d.]+s", log, re.M)
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1])} if summary else {}


def slowest(log: str) -> list[dict[str, object]]:
    """pytest's `--durations` lines (`123.45s call     tests/x.py::test_y`): the slowest setups and tests."""
    return [{"s": float(sec), "when": when, "test": test}
            for sec, when, test in re.findall(r"^([\d.]+)s (setup|call|teardown) +(\S+)$", log, re.M)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=RESULTS / "make_test.json")
    ap.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "make_test.log")
    args = ap.parse_args()
    args.log.write_text("")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="make-test-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        install_s, install_rc = timed(["make", "install"], clone, args.log)
        test_s, test_rc = timed(["make", "test"], clone, args.log) if install_rc == 0 else (0.0, install_rc)
    log = args.log.read_text()
    counts = pytest_counts(log)
    report = {"bench": "make_test", "command": "python3 -m bench.make_test", "commit": commit,
              "install_s": round(install_s, 1), "test_s": round(test_s, 1), "total_s": round(install_s + test_s, 1),
              "rc": test_rc, "pytest": counts, "slowest": slowest(log), "log": str(args.log)}
    table = (f"| commit | install | tests | total | pytest |\n|---|---|---|---|---|\n"
             f"| {commit} | {install_s / 60:.1f} min | {test_s / 60:.1f} min | {(install_s + test_s) / 60:.1f} min "
             f"| {', '.join(f'{n} {k}' for k, n in counts.items())} |")
    emit(report, args.json, table)
    raise SystemExit(test_rc)


if __name__ == "__main__":
    main()
