"""`pretrain.compile` through the stage, as a user runs it: eager against compiled, side by side.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.compile_stage'     # ~30 min on 2 cores

`python -m pipeline.run --preset cpu-small --until pretrain` (DeepSpeed ZeRO-2, 2 workers, the preset's precision)
for `--steps` steps, once per arm in each round, arms interleaved: `eager` (compile off), `compiled` (this tree's
`pretrain.compile=true`) and, per `--tree LABEL=DIR`, that source tree's `pretrain.compile=true` (e.g. a `git archive`
of an older commit, to measure what it did beside this one). The data stages run once; every run starts from a copy
of their workdir, so each trains from scratch. Progress every `--log-interval` steps, validation every
`--eval-interval` (the validation pass runs the model in eval mode without gradients: what recompiled before).

Read from the run's own output: the tokens/s of every progress window (`step N/M ... tokens/s X`), and, with
`TORCH_LOGS=recompiles` in the workers' environment, every recompilation torch.compile logs, with its reason and
the window in which it arrived (a floor: Ray folds a line repeated across workers into one). Warm-up is everything before the first progress line (the validation pass at step
0 and the first steps, where the eval and train graphs compile): `warmup_s` is the time from the worker's first
line to its first progress line, and `compile_warmup_s` that less the eager arm's (compiled cold: inductor's
on-disk caches off, as on a fresh node). Writes
bench/results/compile_stage.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, command_line, emit, load_average

PROGRESS = re.compile(r"step (\d+)/\d+ loss ([\d.]+).* tokens/s ([\d,]+)")
VALIDATION = re.compile(r"step (\d+) validation loss ([\d.]+)")
STARTED = re.compile(r"objective, \d+ workers on")
RECOMPILE = re.compile(r"Recompiling function (\S+) in (\S+)")
REASON = re.compile(r"\[__recompiles\]\s+- [\d/]+: (.*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compile_stage", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="runs of every arm, interleaved; medians over rounds")
    p.add_argument("--tree", action="append", default=[], help="LABEL=DIR: also that source tree, compiled")
    p.add_argument("--json", type=Path, default=RESULTS / "compile_stage.json")
    return p.parse_args(argv)


def run_stage(tree: Path, workdir: Path, sets: dict[str, Any]) -> dict[str, Any]:
    """One `pipeline.run --until pretrain`, its output read line by line as it arrives (arrival times kept)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    # a cold compilation, as a fresh node pays it: inductor's on-disk caches would serve an earlier run's graphs
    env.update(PYTHONUNBUFFERED="1", TORCH_LOGS="recompiles", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
               TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    cmd = [sys.executable, "-m", "pipeline.run", "--preset", "cpu-small", "--until", "pretrain", "--workdir",
           str(workdir), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.time(), ANSI.sub("", line.rstrip("\n"))) for line in proc.stdout]
    proc.wait()
    if proc.returncode != 0:
        tail = "\n".join(text for _, text in lines[-40:])
        raise SystemExit(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{tail}")
    return {"wall_s": round(time.time() - started, 1), **read_output(lines)}


def read_output(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """Windows, validations and recompilations of one run's output (rank 0's progress; every rank's recompiles)."""
    start = next(t for t, text in lines if STARTED.search(text))
    windows, validations, recompiles = [], [], []
    for t, text in lines:
        if m := PROGRESS.search(text):
            windows.append({"step": int(m.group(1)), "loss": float(m.group(2)),
                            "tokens_per_s": int(m.group(3).replace(",", "")), "at": t})
        elif m := VALIDATION.search(text):
            validations.append({"step": int(m.group(1)), "val_loss": float(m.group(2))})
        elif m := RECOMPILE.search(text):
            recompiles.append({"function": f"{m.group(1)} ({Path(m.group(2)).name})", "at": t, "reasons": [],
                               "after_step": max([w["step"] for w in windows], default=0)})
        elif (m := REASON.search(text)) and recompiles:
            recompiles[-1]["reasons"].append(m.group(1).strip())
    first = windows[0]["at"]
    after = [r for r in recompiles if r["at"] > first]
    rates = [w["tokens_per_s"] for w in windows]
    return {
        "windows": [{k: w[k] for k in ("step", "loss", "tokens_per_s")} for w in windows],
        "median_tokens_per_s": statistics.median(rates),
        "median_tokens_per_s_after_first": statistics.median(rates[1:]),
        "slowest_window_after_first": min(rates[1:]),
        "final_loss": windows[-1]["loss"], "validations": validations,
        "warmup_s": round(first - start, 1),
        "recompiles": len(recompiles), "recompiles_after_warmup": len(after),
        "recompile_log": [{k: r[k] for k in ("function", "after_step", "reasons")} for r in recompiles],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm over its rounds: medians of the per-run figures, the most recompiles any run saw."""
    out = {k: statistics.median(r[k] for r in runs) for k in
           ("median_tokens_per_s", "median_tokens_per_s_after_first", "slowest_window_after_first", "warmup_s",
            "wall_s")}
    out["recompiles_after_warmup"] = max(r["recompiles_after_warmup"] for r in runs)
    out["recompiles"] = max(r["recompiles"] for r in runs)
    return out


def table(report: dict[str, Any]) -> str:
    rows = ["| arm | median tokens/s | / eager | slowest window after the first | recompiles (after warm-up) | "
            "warm-up s | stage wall s |", "|---|---|---|---|---|---|---|"]
    for arm, s in report["arms"].items():
        rows.append(f"| {arm} | {s['median_tokens_per_s']:,.0f} | {s['over_eager']} | "
                    f"{s['slowest_window_after_first']:,} | {s['recompiles']} ({s['recompiles_after_warmup']}) | "
                    f"{s['warmup_s']} | {s['wall_s']} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    trees = {"eager": REPO, "compiled": REPO}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        if not (Path(path) / "pipeline" / "run.py").is_file():
            raise SystemExit(f"--tree {spec!r}: use LABEL=DIR, DIR a source tree of this project")
        trees[label] = Path(path).resolve()
    started, load_before = time.time(), load_average()
    sets = {"ray.dashboard": "false", "pretrain.max_steps": args.steps, "pretrain.log_interval": args.log_interval,
            "pretrain.eval_interval": args.eval_interval, "pretrain.eval_batches": args.eval_batches,
            "pretrain.ckpt_interval": args.steps}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in trees}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        data = Path(tmp) / "data"
        res = subprocess.run([sys.executable, "-m", "pipeline.run", "--preset", "cpu-small", "--until", "tokenize",
                              "--workdir", str(data), "--set", "ray.dashboard=false"], cwd=REPO, capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise SystemExit(f"the data stages failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        for r in range(args.rounds):
            for arm, tree in trees.items():
                workdir = Path(tmp) / f"{arm}-{r}"
                shutil.copytree(data, workdir)
                run = run_stage(tree, workdir, {**sets, "pretrain.compile": str(arm != "eager").lower()})
                shutil.rmtree(workdir, ignore_errors=True)
                runs[arm].append(run)
                print(arm, r, {k: v for k, v in run.items() if k not in ("windows", "recompile_log")}, flush=True)
    arms = {arm: summary(rs) for arm, rs in runs.items()}
    for arm, s in arms.items():
        s["over_eager"] = round(s["median_tokens_per_s"] / arms["eager"]["median_tokens_per_s"], 2)
        s["compile_warmup_s"] = round(s["warmup_s"] - arms["eager"]["warmup_s"], 1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    report = {"bench": "compile_stage", "command": command_line(), "commit": commit, "load_average": load_before,
              "preset": "cpu-small", "zero_stage": 2, "num_workers": 2, "steps": args.steps,
              "log_interval": args.log_interval, "eval_interval": args.eval_interval, "rounds": args.rounds,
              "trees": {k: str(v) for k, v in trees.items()}, "arms": arms, "runs": runs,
              "total_s": round(time.time() - started, 1), "load_average_after": load_average()}
    emit(report, args.json, table(report))


if __name__ == "__main__":
    main()
