"""The built-in token task (wnut16-ner) fine-tuned by the stage's sweep: the champion's dev entity F1 per seed
against the rule a practitioner tries first (each word's most frequent train tag).

    python -m bench.token_task [--pretrained ARTIFACT_DIR] [--seeds 0,1,2] [--lr 1e-3,3e-3] [--epochs 6] ...

Runs `stages.finetune.sweep.run_sweep` (the stage's Tune trainable) over the lr grid x seeds, picks the champion
grid point as the stage does (best mean dev F1 over seeds), and reports its dev F1 for every seed beside the
baseline; "beats" is every seed above the baseline and the seed mean above it by more than 3 standard errors.
Without --pretrained it builds a tiny real checkpoint (`bench.tiny_pretrained`: 2k SentencePiece pieces, a debug()
MLM, --pretrain-steps plain-torch steps) on the news articles, the review snippets and the task's train tweets
(their text only: the tags stay unseen). Prints one JSON object (also written to --json, by default
bench/results/token_task.json), then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from bench.common import RESULTS, comma_floats, comma_ints, command_line, emit, load_average


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.token_task", description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", type=Path, help="a pretrain artifact dir (model/ + tokenizer/); default: build tiny")
    p.add_argument("--task", default="wnut16-ner")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-token-task"))
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--lr", type=comma_floats, default=(1e-3, 3e-3))
    p.add_argument("--dropout", type=comma_floats, default=(0.1,))
    p.add_argument("--warmup-steps", type=comma_ints, default=(50,))
    p.add_argument("--batch-size", type=comma_ints, default=(32,))
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--doc-stride", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=2)
    p.add_argument("--json", type=Path, default=RESULTS / "token_task.json", help="where the JSON report goes")
    return p.parse_args(argv)


def pretrained(args, task) -> Path:
    """--pretrained, or the tiny checkpoint built once under the workdir on news, reviews and the train tweets."""
    from bench.tiny_pretrained import build_tiny_pretrained
    from core.datasets import materialize_corpus
    from deberta import checkpoint
    from stages.finetune.tasks import resolve_task

    if args.pretrained:
        return args.pretrained
    root = args.workdir / f"tiny-{args.pretrain_steps}"
    if (root / "pretrain" / "model" / checkpoint.WEIGHTS_FILE).is_file():
        return root / "pretrain"
    news = materialize_corpus("news", args.workdir / "news")
    texts = [json.loads(line)["text"] for line in news.read_text().splitlines()[:1500]]
    texts += list(resolve_task("rotten-tomatoes").train.text_a)
    texts += [" ".join(words) for words in task.train.words]
    return build_tiny_pretrained(root, texts, steps=args.pretrain_steps)[0].path


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import ray

    from core.config import FinetuneConfig
    from deberta import checkpoint
    from stages.finetune import data as ft_data
    from stages.finetune import sweep as ft_sweep
    from stages.finetune.tasks import resolve_task
    from stages.finetune.trial import TrialSetup

    args.workdir.mkdir(parents=True, exist_ok=True)
    task = resolve_task(args.task)
    started = time.time()
    pre = pretrained(args, task)
    pretrain_s = time.time() - started
    cfg = FinetuneConfig(task=args.task, dropout=args.dropout, warmup_steps=args.warmup_steps, lr=args.lr,
                         batch_size=args.batch_size, seeds=args.seeds, epochs=args.epochs,
                         max_seq_len=args.max_seq_len, doc_stride=args.doc_stride,
                         max_concurrent_trials=args.concurrent, cpus_per_trial=1)
    data = ft_data.prepare_data(task, pre / "tokenizer", cfg)
    setup = TrialSetup(checkpoint.load_config(pre / "model"), task.num_labels, task.kind, task.metric, cfg)
    ray.init(num_cpus=args.concurrent, include_dashboard=False, configure_logging=False, log_to_driver=False,
             object_store_memory=1 << 30)
    started = time.time()
    grid = ft_sweep.run_sweep(cfg, setup, data, ft_data.backbone_weights(pre / "model"),
                              str(args.workdir / "ray_results"), f"token-task-{int(started)}")
    sweep_s = time.time() - started
    metric = f"dev_{task.metric}"
    table = ft_sweep.results_table(grid, metric)
    champion = ft_sweep.pick_champion(table, metric)
    point = table
    for key in ft_sweep.GRID_KEYS:
        point = point[point[key] == champion[key]]
    per_seed = {int(row["seed"]): round(float(row[metric]), 4) for _, row in point.iterrows()}
    scores = np.asarray(list(per_seed.values()))
    baseline, rule = task.kind.baseline(task)
    mean, std = float(scores.mean()), float(scores.std(ddof=1)) if len(scores) > 1 else 0.0
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    report = {
        "bench": "token_task", "command": command_line(), "commit": head.stdout.strip() or None,
        "load_average": load_average(), "task": task.name,
        "metric": metric, "train_sentences": len(task.train), "dev_sentences": len(task.dev),
        "train_rows": len(data[0]), "dev_rows": len(data[1]), "pretrained": str(pre),
        "pretrain_steps": None if args.pretrained else args.pretrain_steps, "pretrain_s": round(pretrain_s, 1),
        "sweep_s": round(sweep_s, 1), "trials": len(table), "epochs": cfg.epochs,
        "champion": {k: float(champion[k]) for k in ft_sweep.GRID_KEYS},
        "champion_f1_per_seed": per_seed, "champion_f1_mean": round(mean, 4), "champion_f1_std": round(std, 4),
        "baseline_rule": rule, "baseline_f1": round(baseline, 4),
        "margin_over_baseline": round(mean - baseline, 4),
        "standard_errors_over_baseline": round((mean - baseline) / (std / math.sqrt(len(scores))), 1) if std else None,
        "beats_baseline": bool(scores.min() > baseline and (std == 0 or mean - baseline > 3 * std / math.sqrt(len(scores)))),
        "per_trial": [{**{k: float(r[k]) for k in (*ft_sweep.GRID_KEYS, "seed")}, metric: round(float(r[metric]), 4),
                       "dev_precision": round(float(r["dev_precision"]), 4),
                       "dev_recall": round(float(r["dev_recall"]), 4)} for _, r in table.iterrows()],
    }
    lines = [f"{task.name}: {len(task.train)} train / {len(task.dev)} dev tweets, {len(table)} trials, "
             f"{cfg.epochs} epochs, sweep {sweep_s:.0f} s",
             f"{'':<34}{'dev entity F1':>14}",
             f"{'baseline: ' + rule:<34}{baseline:>14.4f}"]
    for seed, f1 in per_seed.items():
        label = f"champion lr={champion['lr']:g}, seed {seed}"
        lines.append(f"{label:<34}{f1:>14.4f}")
    lines.append(f"{'champion, mean ± std':<34}{mean:>14.4f} ± {std:.4f}  beats baseline: {report['beats_baseline']}")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
