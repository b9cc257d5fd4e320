"""The CPU plan's step times: real pretraining steps of the presets' CPU models on this machine's CPUs.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.cpu_plan'     # ~15 min on 2 cores

For each CPU preset (debug, debug-v3, cpu-small) the real entry point pretrains for `--steps` steps
(`python -m pipeline.run --preset P --until pretrain`, its own workers, gloo, data order; validation and checkpoints
only at the end, so the windows time steps alone) and the step time is the median of its progress lines' tokens/s
after the first window (which holds the workers' start). These rows are what `--dry-run` of a CPU run reads
(`stages.pretrain.estimates.CPU_TABLE`).

Then the check the plan is for: `--dry-run` of the default preset as a user types it, and the real run of that
preset's pretraining (its own 800 steps, validation and checkpoints included), whose progress lines' median step time
the estimate is compared with (`ratio`: estimate / real; the plan aims within 2x).
Writes bench/results/cpu_plan.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, command_line, emit, load_average

PRESETS = ("debug", "debug-v3", "cpu-small")
STEP_LINE = re.compile(r"step (\d+)/(\d+) loss .* tokens/s ([\d,]+) ")
PLAN_LINE = re.compile(r"time: ([\d.e+-]+) s/step")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("workdir/bench-cpu-plan"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--json", type=Path, default=RESULTS / "cpu_plan.json")
    return p.parse_args(argv)


def pipeline(args: list[str]) -> str:
    """`python -m pipeline.run ARGS`, its whole output; fails the bench on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the workdir's own store
    res = subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"pipeline.run {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def step_times(output: str, tokens_per_step: int) -> list[float]:
    """Seconds per step of each progress window after the first (tokens/step over the line's tokens/s)."""
    rates = [float(m.group(3).replace(",", "")) for m in STEP_LINE.finditer(output)]
    return [tokens_per_step / r for r in rates[1:]]


def measure(preset: str, workdir: Path, steps: int, log_interval: int) -> dict[str, Any]:
    from pipeline.presets import PRESETS as ALL
    from stages.pretrain import objective_for

    cfg = ALL[preset]()
    p, model, seq = cfg.pretrain, cfg.model, cfg.tokenize.max_seq_len
    sets = {"pretrain.max_steps": steps, "pretrain.warmup_steps": min(p.warmup_steps, steps // 2),
            "pretrain.log_interval": log_interval, "pretrain.eval_interval": steps, "pretrain.ckpt_interval": steps}
    started = time.time()
    out = pipeline(["--preset", preset, "--until", "pretrain", "--workdir", str(workdir),
                    *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
    times = step_times(out, p.train_batch_size * seq)
    step_s = statistics.median(times)
    flops_tok = objective_for(p).train_flops_per_token(model, seq)
    row = {"objective": p.objective, "hidden_size": model.hidden_size, "num_hidden_layers": model.num_hidden_layers,
           "intermediate_size": model.intermediate_size, "seq_len": seq, "num_workers": p.num_workers,
           "cpus_per_worker": p.cpus_per_worker, "micro_batch_size": p.micro_batch_size,
           "train_batch_size": p.train_batch_size, "precision": p.precision, "steps": steps,
           "window_step_s": [round(t, 4) for t in times], "step_s": round(step_s, 4),
           "flops_per_token": flops_tok,
           "flops_per_s_per_worker": round(p.train_batch_size * seq * flops_tok / p.num_workers / step_s),
           "wall_s": round(time.time() - started, 1)}
    print(preset, {k: v for k, v in row.items() if k != "window_step_s"}, flush=True)
    return row


def check_default(workdir: Path) -> dict[str, Any]:
    """The default preset's dry run against its real pretraining run on the same workdir."""
    from pipeline.presets import debug

    cfg = debug()
    plan = pipeline(["--dry-run", "--until", "pretrain", "--workdir", str(workdir)])
    estimate = float(PLAN_LINE.search(plan).group(1))
    out = pipeline(["--until", "pretrain", "--workdir", str(workdir), "--force", "pretrain"])  # timed afresh
    real = statistics.median(step_times(out, cfg.pretrain.train_batch_size * cfg.tokenize.max_seq_len))
    return {"preset": "debug", "steps": cfg.pretrain.max_steps, "estimate_s": estimate, "real_median_s": round(real, 4),
            "ratio": round(estimate / real, 3), "plan_line": PLAN_LINE.search(plan).group(0)}


def table(report: dict[str, Any]) -> str:
    rows = ["| preset | objective | hidden x layers | seq | workers x CPUs | batch | s/step | GFLOP/s per worker |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in report["presets"].items():
        rows.append(f"| {name} | {r['objective']} | {r['hidden_size']} x {r['num_hidden_layers']} | {r['seq_len']} | "
                    f"{r['num_workers']} x {r['cpus_per_worker']} | {r['train_batch_size']} | {r['step_s']} | "
                    f"{r['flops_per_s_per_worker'] / 1e9:.2f} |")
    c = report.get("check")
    if c:
        rows.append(f"\ndefault preset: dry-run estimate {c['estimate_s']} s/step, real run {c['real_median_s']} s/step "
                    f"(median of its progress lines over {c['steps']} steps): ratio {c['ratio']}")
    return "\n".join(rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    report: dict[str, Any] = {"bench": "cpu_plan", "command": command_line(), "cpus": os.cpu_count(),
                              "load_average": load_average()}
    presets = {}
    for preset in PRESETS:
        presets[preset] = measure(preset, args.workdir, args.steps, args.log_interval)  # one workdir: shared data stages
    report["presets"] = presets
    args.json.parent.mkdir(parents=True, exist_ok=True)
    emit(report, args.json, table(report))  # the table the dry run reads, before the check reads it
    report["check"] = check_default(args.workdir)
    report["total_s"] = round(time.time() - started, 1)
    report["load_average_after"] = load_average()
    emit(report, args.json, table(report))


if __name__ == "__main__":
    main()
