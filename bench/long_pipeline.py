"""2,048-token pretraining through the stages: the cpu-small-2048 preset from the built-in corpus to a pretrained
artifact, as a user runs it.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.long_pipeline'     # ~10 min on 2 cores

`python -m pipeline.run --preset cpu-small-2048 --until pretrain` with `--steps` optimizer steps (2 workers, one
2,048-token sequence each a step: DeBERTaV3's 256 log buckets over max_relative_positions 512, the EMD's table at
2,048), validation before and after on `--eval-batches` batches. Reported from the run's own artifacts: the token
shards' sequence length (tokens.json), the pretrain artifact's metrics.json (losses, tokens/s), and each stage's
`stage_seconds` from its MLflow run.
Writes bench/results/long_pipeline.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, command_line, emit, load_average


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.long_pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="pretraining steps")
    p.add_argument("--eval-batches", type=int, default=2, help="validation batches before and after")
    p.add_argument("--json", type=Path, default=RESULTS / "long_pipeline.json")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from bench.object_storage import stage_runs
    from core.artifacts import code_version

    args = parse_args(argv)
    started, load_before = time.time(), load_average()
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        workdir = Path(tmp) / "wd"
        sets = {"ray.num_cpus": 4, "ray.dashboard": "false", "pretrain.max_steps": args.steps,
                "pretrain.eval_interval": args.steps, "pretrain.ckpt_interval": args.steps,
                "pretrain.eval_batches": args.eval_batches, "pretrain.log_interval": 1}
        cmd = [sys.executable, "-m", "pipeline.run", "--preset", "cpu-small-2048", "--until", "pretrain",
               "--workdir", str(workdir), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"pipeline.run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        runs = stage_runs(workdir)
        art = workdir / "artifacts"
        tokens = json.loads((art / "tokenize" / runs["tokenize"]["artifact"] / "tokens.json").read_text())
        metrics = json.loads((art / "pretrain" / runs["pretrain"]["artifact"] / "metrics.json").read_text())
    report = {
        "bench": "long_pipeline", "command": command_line(), "commit": code_version()[:7],
        "load_average": load_before, "preset": "cpu-small-2048",
        "token_seq_len": tokens.get("max_seq_len", metrics["seq_len"]), "seq_len": metrics["seq_len"],
        "steps": metrics["steps"], "num_workers": metrics["num_workers"],
        "train_batch_size": metrics["train_batch_size"],
        "initial_val_loss": round(metrics["initial_val_loss"], 4), "val_loss": round(metrics["val_loss"], 4),
        "final_loss": round(metrics["final_loss"], 4), "tokens_per_s": round(metrics["tokens_per_s"], 1),
        "stage_s": {stage: r["seconds"] for stage, r in runs.items()},
        "total_s": round(time.time() - started, 1), "load_average_after": load_average(),
    }
    table = "\n".join([
        "| sequence | steps | sequences a step | validation loss before -> after | tokens/s | pretrain stage s |",
        "|---|---|---|---|---|---|",
        f"| {report['seq_len']} | {report['steps']} | {report['train_batch_size']} | {report['initial_val_loss']} -> "
        f"{report['val_loss']} | {report['tokens_per_s']} | {report['stage_s']['pretrain']} |"])
    emit(report, args.json, table)


if __name__ == "__main__":
    main()
