"""Full grid vs ASHA on the same task, grid, epoch cap and concurrency: cost and quality of the selection.

    python -m bench.sweep [--pretrained ARTIFACT_DIR] [--task rotten-tomatoes] [--epochs 4] ...

Runs the finetune stage's sweep (`stages.finetune.sweep.run_sweep`, the same Tune trainable) twice, once with every
trial to the last epoch and once with ASHA (grace 1 epoch, reduction factor 2) cutting trials at rungs 1, 2,
4, ... epochs. Reports trial-epochs spent, wall time, the best configuration of each and whether ASHA found
the same one or one equally good (dev metric within --tolerance of the full grid's best). Without
--pretrained it builds the tests' tiny real checkpoint (`bench.tiny_pretrained`: 2k SentencePiece pieces, debug()
MLM, 200 steps on review + news text). Prints one JSON object (also written to --json, by default
bench/results/sweep.json), then a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import RESULTS, command_line, load_average, comma_floats, comma_ints, emit


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", type=Path, help="a pretrain artifact dir (model/ + tokenizer/); default: build tiny")
    p.add_argument("--task", default="rotten-tomatoes")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-sweep"))
    p.add_argument("--dropout", type=comma_floats, default=(0.0, 0.1))
    p.add_argument("--warmup-steps", type=comma_ints, default=(20,))
    p.add_argument("--lr", type=comma_floats, default=(1e-4, 3e-4, 1e-3, 3e-3))
    p.add_argument("--batch-size", type=comma_ints, default=(32,))
    p.add_argument("--seeds", type=comma_ints, default=(0,))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-train-examples", type=int, default=2000)
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--concurrent", type=int, default=2)
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray (one per concurrent trial)")
    p.add_argument("--tolerance", type=float, default=0.005, help="dev-metric gap that still counts as equally good")
    p.add_argument("--json", type=Path, default=RESULTS / "sweep.json", help="where the JSON report goes")
    return p.parse_args(argv)


def one_sweep(args, scheduler: str, setup, data, weights) -> dict:
    import dataclasses

    from stages.finetune import data as ft_data
    from stages.finetune import sweep as ft_sweep
    from stages.finetune.trial import TrialSetup

    cfg = dataclasses.replace(setup.ft, scheduler=scheduler)
    setup = dataclasses.replace(setup, ft=cfg)
    metric = f"dev_{setup.metric}"
    started = time.time()
    grid = ft_sweep.run_sweep(cfg, setup, data, weights, str(args.workdir / "ray_results"),
                              f"bench-{scheduler}-{int(started)}")
    wall = time.time() - started
    table = ft_sweep.results_table(grid, metric)
    champ = ft_sweep.pick_champion(table, metric)
    return {"scheduler": scheduler, "trials": len(table), "trial_epochs": int(table["epochs"].sum()),
            "wall_s": round(wall, 1), "best_metric": round(float(champ[metric]), 4),
            "best_config": {k: float(champ[k]) for k in (*ft_sweep.GRID_KEYS, "seed")},
            "per_trial": {_key({k: row[k] for k in (*ft_sweep.GRID_KEYS, "seed")}):
                          {"epochs": int(row["epochs"]), metric: round(float(row[metric]), 4)}
                          for _, row in table.iterrows()}}


def _key(config: dict) -> str:
    return ",".join(f"{k}={float(v):g}" for k, v in sorted(config.items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from bench.tiny_pretrained import tiny_pretrained_dir
    from deberta import checkpoint
    from core.config import FinetuneConfig
    from stages.finetune import data as ft_data
    from stages.finetune import sweep as ft_sweep
    from stages.finetune.trial import TrialSetup
    from stages.finetune.tasks import majority_baseline, resolve_task

    args.workdir.mkdir(parents=True, exist_ok=True)
    pre = args.pretrained or tiny_pretrained_dir(args.workdir)
    task = resolve_task(args.task)
    cfg = FinetuneConfig(task=args.task, dropout=args.dropout, warmup_steps=args.warmup_steps, lr=args.lr,
                         batch_size=args.batch_size, seeds=args.seeds, epochs=args.epochs,
                         max_seq_len=args.max_seq_len, max_train_examples=args.max_train_examples,
                         max_concurrent_trials=args.concurrent, cpus_per_trial=1)
    model_cfg = checkpoint.load_config(pre / "model")
    data = ft_data.prepare_data(task, pre / "tokenizer", cfg)
    setup = TrialSetup(model_cfg, task.num_labels, task.kind, task.metric, cfg)
    weights = ft_data.backbone_weights(pre / "model")
    if not ray.is_initialized():
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 object_store_memory=1 << 30)
    full = one_sweep(args, "grid", setup, data, weights)
    asha = one_sweep(args, "asha", setup, data, weights)
    metric = f"dev_{task.metric}"
    report = {
        "command": command_line(), "load_average": load_average(), "task": task.name, "metric": metric,
        "majority_baseline": round(majority_baseline(task), 4),
        "train_examples": len(data[0]), "dev_examples": len(data[1]), "grid_trials": ft_sweep.grid_size(cfg),
        "max_epochs": cfg.epochs, "concurrent_trials": cfg.max_concurrent_trials, "full": full, "asha": asha,
        "same_best_config": full["best_config"] == asha["best_config"],
        "asha_best_in_full_grid": full["per_trial"][_key(asha["best_config"])][metric],
        "equally_good": abs(full["best_metric"] - asha["best_metric"]) <= args.tolerance,
        "trial_epochs_saved": round(1 - asha["trial_epochs"] / full["trial_epochs"], 3),
        "wall_time_ratio": round(asha["wall_s"] / full["wall_s"], 3),
    }
    lines = [f"{'scheduler':<10}{'trials':>7}{'trial-epochs':>14}{'wall s':>9}{metric:>16}  best config"]
    for r in (full, asha):
        cfg_text = ", ".join(f"{k}={v:g}" for k, v in r["best_config"].items())
        lines.append(f"{r['scheduler']:<10}{r['trials']:>7}{r['trial_epochs']:>14}{r['wall_s']:>9.0f}"
                     f"{r['best_metric']:>16.4f}  {cfg_text}")
    lines.append(f"ASHA: {report['trial_epochs_saved']:.0%} fewer trial-epochs, {report['wall_time_ratio']:.2f}x the "
                 f"wall time; same best config: {report['same_best_config']}; equally good (±{args.tolerance}): "
                 f"{report['equally_good']}; majority baseline {report['majority_baseline']}")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
