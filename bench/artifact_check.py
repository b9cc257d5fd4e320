"""What checking a reused artifact against its manifest costs: sizes (always) and SHA-256 digests (`--verify`).

Builds the debug preset's corpus -> vocab -> tokenize in a fresh workdir (the stages' own times come from the
pipeline's `[stage] done in Ns` lines), then times `core.artifacts.verify` on each finished artifact, with and
without digests (median of `--repeat`). Run it where Ray binds loopback:

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.artifact_check'
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, RESULTS, command_line, emit, load_average
from core.artifacts import ArtifactStore, verify

STAGES = ("corpus", "vocab", "tokenize")


def build(workdir: Path) -> dict[str, float]:
    """Run the debug preset up to tokenize; stage -> seconds its run took."""
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--workdir", str(workdir), "--until", "tokenize"],
                         cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"pipeline.run failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return {m[0]: float(m[1]) for m in re.findall(r"^\[(\w+)\] done in (\d+)s", res.stdout, re.M)}


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=RESULTS / "artifact_check.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="artifact-check-") as tmp:
        workdir = Path(tmp) / "wd"
        stage_s = build(workdir)
        store, rows = ArtifactStore(workdir), []
        for stage in STAGES:
            [path] = [p for p in (workdir / "artifacts" / stage).iterdir() if (p / "_SUCCESS").exists()]
            art = store.find(stage, path.name)
            files = art.manifest["files"]
            rows.append({
                "stage": stage, "files": len(files), "bytes": sum(f["bytes"] for f in files.values()),
                "stage_s": stage_s.get(stage),
                "sizes_ms": 1e3 * timed(lambda: verify(art), args.repeat),
                "digests_ms": 1e3 * timed(lambda: verify(art, digests=True), args.repeat),
            })
    for r in rows:
        r["digest_mb_per_s"] = r["bytes"] / 1e6 / (r["digests_ms"] / 1e3)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    report = {"bench": "artifact_check", "command": command_line(), "commit": head.stdout.strip() or None,
              "load_average": load_average(), "preset": "debug", "repeat": args.repeat, "artifacts": rows}
    table = "\n".join(
        [f"{'stage':10}{'files':>6}{'MB':>8}{'stage s':>9}{'sizes ms':>10}{'digests ms':>12}{'MB/s':>8}"]
        + [f"{r['stage']:10}{r['files']:>6}{r['bytes'] / 1e6:>8.2f}{r['stage_s'] or float('nan'):>9.0f}"
           f"{r['sizes_ms']:>10.2f}{r['digests_ms']:>12.1f}{r['digest_mb_per_s']:>8.0f}" for r in rows])
    emit(report, args.json, table)


if __name__ == "__main__":
    main()
