"""How long `make test` takes from a clean clone, as CI runs it: the install, then the whole suite.

Clones the repository's HEAD into a temporary directory, times `make install` and `make test` there separately,
and reads pytest's own summary line (passed, skipped, failed). Standard library only, so it runs before any venv
exists:

    python3 -m bench.make_test          # about half an hour on a 2-core machine

Shared machines differ in speed from day to day, so the result also holds what tells a slower suite from a slower
machine: the time of a fixed workload in the clone's venv (`machine`), and how long each of the slowest tests took
against the last committed result (`vs_previous`: a test whose code did not change and takes twice as long says the
machine did).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
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


# A fixed workload timed in the clone's venv: matrix products (BLAS, as the model's steps) and an interpreter loop
# (as Ray's and the tests' own Python); the best of three of each.
MACHINE_PROBE = """
import json, time, torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
def best(f):
    times = []
    for _ in range(3):
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
    return round(min(times), 3)
print(json.dumps({"matmul_1024_x100_s": best(lambda: [a @ a for _ in range(100)]),
                  "python_loop_5m_s": best(lambda: sum(i * i for i in range(5_000_000)))}))
"""


def machine(clone: Path) -> dict[str, float]:
    out = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", MACHINE_PROBE], capture_output=True,
                         text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def vs_previous(now: list[dict[str, object]], test_s: float, machine_now: dict[str, float]) -> dict[str, object]:
    """This run against the last committed result: the suite's ratio, the ratio of each slowest test in both lists
    and of the machine probe where both have it."""
    shown = subprocess.run(["git", "show", "HEAD:bench/results/make_test.json"], cwd=REPO, capture_output=True,
                           text=True)
    if shown.returncode != 0:
        return {}
    before = json.loads(shown.stdout)
    then = {(t["when"], t["test"]): t["s"] for t in before.get("slowest", [])}
    ratios = sorted(round(t["s"] / then[(t["when"], t["test"])], 2) for t in now if (t["when"], t["test"]) in then)
    out: dict[str, object] = {"commit": before["commit"], "test_s": before["test_s"],
                              "test_s_ratio": round(test_s / before["test_s"], 2)}
    if ratios:
        out["slowest_in_both"] = {"n": len(ratios), "ratio_min": ratios[0], "ratio_median": statistics.median(ratios),
                                  "ratio_max": ratios[-1]}
    common = sorted(set(machine_now) & set(before.get("machine", {})))
    if common:
        out["machine_ratio"] = {k: round(machine_now[k] / before["machine"][k], 2) for k in common}
    return out


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
        probe = machine(clone) if install_rc == 0 else {}
        test_s, test_rc = timed(["make", "test"], clone, args.log) if install_rc == 0 else (0.0, install_rc)
    log = args.log.read_text()
    counts, durations = pytest_counts(log), slowest(log)
    report = {"bench": "make_test", "command": "python3 -m bench.make_test", "commit": commit,
              "install_s": round(install_s, 1), "test_s": round(test_s, 1), "total_s": round(install_s + test_s, 1),
              "rc": test_rc, "pytest": counts, "slowest": durations, "machine": probe,
              "vs_previous": vs_previous(durations, test_s, probe), "log": str(args.log)}
    table = (f"| commit | install | tests | total | pytest |\n|---|---|---|---|---|\n"
             f"| {commit} | {install_s / 60:.1f} min | {test_s / 60:.1f} min | {(install_s + test_s) / 60:.1f} min "
             f"| {', '.join(f'{n} {k}' for k, n in counts.items())} |")
    emit(report, args.json, table)
    raise SystemExit(test_rc)


if __name__ == "__main__":
    main()
