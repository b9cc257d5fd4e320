"""One fine-tuning grid point on each trial layout, side by side: a torch process vs DeepSpeed workers.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.trials'

The tiny real checkpoint of `bench.sweep` (built on first use), one grid point, the same epochs and data, one
trial at a time on a local Ray of `--num-cpus` CPUs, through the finetune stage's own `run_sweep`:
  torch        one process with all the CPUs as threads (what debug and base presets run)
  deepspeed-1  one DeepSpeed worker, ZeRO-0, all the CPUs as threads: the cost of Ray Train + DeepSpeed alone
  deepspeed-2  two DeepSpeed workers, ZeRO-2, the CPUs split between them: data parallel over gloo
Reports the sweep's wall time (Tune, Train and worker start-up included), the mean epoch time the trial
measured itself, and the dev metric. On a machine of 2 cores this shows overhead, not scaling: the point of
DeepSpeed trials is models that one device cannot fine-tune. Prints one JSON object (also written to --json, by default
bench/results/trials.json), then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from bench.common import RESULTS, command_line, emit, load_average


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.trials", description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", type=Path, help="a pretrain artifact dir (model/ + tokenizer/); default: build tiny")
    p.add_argument("--task", default="rotten-tomatoes")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-sweep"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-train-examples", type=int, default=2000)
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--json", type=Path, default=RESULTS / "trials.json", help="where the JSON report goes")
    return p.parse_args(argv)


def layouts(cpus: int) -> dict[str, dict]:
    return {
        "torch": dict(trainer="torch", workers_per_trial=1, cpus_per_trial=cpus),
        "deepspeed-1": dict(trainer="deepspeed", workers_per_trial=1, cpus_per_trial=cpus, zero_stage=0),
        "deepspeed-2": dict(trainer="deepspeed", workers_per_trial=2, cpus_per_trial=max(1, cpus // 2), zero_stage=2),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from bench.tiny_pretrained import tiny_pretrained_dir  # the tiny real checkpoint, built once under --workdir
    from deberta import checkpoint
    from core.config import FinetuneConfig
    from stages.finetune import data as ft_data
    from stages.finetune import sweep as ft_sweep
    from stages.finetune.trial import TrialSetup
    from stages.finetune.tasks import resolve_task

    args.workdir.mkdir(parents=True, exist_ok=True)
    pre = args.pretrained or tiny_pretrained_dir(args.workdir)
    task = resolve_task(args.task)
    base = FinetuneConfig(task=args.task, dropout=(0.0,), warmup_steps=(10,), lr=(args.lr,),
                          batch_size=(args.batch_size,), epochs=args.epochs, max_seq_len=args.max_seq_len,
                          max_train_examples=args.max_train_examples, max_concurrent_trials=1)
    model_cfg = checkpoint.load_config(pre / "model")
    data = ft_data.prepare_data(task, pre / "tokenizer", base)
    weights = ft_data.backbone_weights(pre / "model")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
             object_store_memory=1 << 30)
    metric = f"dev_{task.metric}"
    rows = {}
    for name, layout in layouts(args.num_cpus).items():
        cfg = dataclasses.replace(base, **layout)
        setup = TrialSetup(model_cfg, task.num_labels, task.kind, task.metric, cfg)
        started = time.time()
        grid = ft_sweep.run_sweep(cfg, setup, data, weights, str(args.workdir / "ray_results"),
                                  f"bench-trials-{name}-{int(started)}")
        wall = time.time() - started
        hist = grid[0].metrics_dataframe
        rows[name] = {"wall_s": round(wall, 1), "epoch_s": round(float(hist["epoch_seconds"].mean()), 2),
                      metric: round(float(hist[metric].max()), 4),
                      "final_train_loss": round(float(hist["train_loss"].iloc[-1]), 4), **layout}
    ray.shutdown()
    ref = rows["torch"]
    report = {"command": command_line(), "load_average": load_average(), "task": task.name,
              "train_examples": len(data[0]), "dev_examples": len(data[1]),
              "epochs": args.epochs, "batch_size": args.batch_size, "cpus": args.num_cpus, "layouts": rows,
              "epoch_time_vs_torch": {k: round(r["epoch_s"] / ref["epoch_s"], 2) for k, r in rows.items()}}
    lines = [f"{'layout':<13}{'wall s':>8}{'epoch s':>9}{'vs torch':>10}{metric:>16}{'train loss':>12}"]
    for name, r in rows.items():
        lines.append(f"{name:<13}{r['wall_s']:>8.1f}{r['epoch_s']:>9.2f}{r['epoch_s'] / ref['epoch_s']:>9.2f}x"
                     f"{r[metric]:>16.4f}{r['final_train_loss']:>12.4f}")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
