"""Packed rows with and without attention across documents (`pretrain.document_mask`), side by side.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.document_mask'     # ~5 min on 2 cores

The stage's step (`stages.pretrain.loop.train_step`: masking, the MLM with its EMD, backward, AdamW) on a plain
torch engine, at cpu-small's shape (4 x 256, micro-batch 16 x 128 tokens, embedding rows the tokenizer's) over the
debug preset's token sequences of the built-in news corpus (bench.objectives' `--workdir` artifacts, made with
`pipeline.run --until tokenize` when missing, which starts Ray), with their `doc_index` column. Both runs: one seed,
the same rows in the same order, the same masks; `document_mask` on passes each row's document ids, so attention is
block-diagonal by document. Reported: the median step time after `--warmup` steps of each and their ratio, and the
stage's validation MLM loss after `--steps` steps on the first `--eval-batches` validation batches, each model
evaluated as it trained (with its mask, or without).
Writes bench/results/document_mask.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, command_line, emit, load_average
from bench.objectives import ensure_artifacts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.document_mask", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps of each run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches of 16 sequences")
    p.add_argument("--workdir", type=Path, default=Path("workdir/bench-objectives"))
    p.add_argument("--json", type=Path, default=RESULTS / "document_mask.json")
    return p.parse_args(argv)


def load(tok_dir: Path, split: str) -> dict[str, np.ndarray]:
    from stages.tokenize import DOC_INDEX_COLUMN, read_split

    table = read_split(tok_dir / split, ["input_ids", DOC_INDEX_COLUMN])
    out = {}
    for name in ("input_ids", DOC_INDEX_COLUMN):
        column = table.column(name).combine_chunks()
        out[name] = np.asarray(column.flatten()).reshape(len(column), -1)  # (N * T,) -> (N, T)
    return out


def run(on: bool, args, tok_dir: Path, vocab_dir: Path) -> dict[str, Any]:
    import torch

    from core.config import PretrainConfig
    from core.tokenizer import Tokenizer
    from deberta.config import padded_vocab_size
    from pipeline.presets import MODEL_CPU_SMALL, cpu_small
    from stages.pretrain import objective_for
    from stages.pretrain.loop import optim_spec, train_step, validation_sums
    from stages.tokenize import DOC_INDEX_COLUMN
    from training.engine import build

    batch = cpu_small().pretrain.micro_batch_size
    cfg = PretrainConfig(num_workers=1, micro_batch_size=batch, train_batch_size=batch, lr=1e-3, warmup_steps=20,
                         max_steps=args.steps, seed=0, document_mask=on)
    objective = objective_for(cfg)
    tok = Tokenizer.load(vocab_dir)
    model = MODEL_CPU_SMALL.replace(vocab_size=padded_vocab_size(len(tok)))
    masker = objective.masker(len(tok), tok.mask_id, list(tok.special_ids.values()),
                              torch.from_numpy(tok.word_start_mask()))
    factory, _ = objective.build_model(model)
    engine = build(factory, optim_spec(cfg), seed=0)
    columns = objective.shard_columns  # input_ids, and doc_index with document_mask
    train, val = load(tok_dir, "train"), load(tok_dir, "validation")
    order = np.random.default_rng(0).permutation(len(train["input_ids"]))
    seconds = []
    for step in range(args.steps):
        rows = order[(step * batch) % len(order):][:batch]
        started = time.perf_counter()
        train_step(engine, objective, masker, [objective.batch({c: train[c][rows] for c in columns})], step)
        seconds.append(time.perf_counter() - started)
    n = min(args.eval_batches, len(val["input_ids"]) // batch)
    val_batches = [objective.batch({c: val[c][i * batch:(i + 1) * batch] for c in columns}) for i in range(n)]
    metrics = objective.eval_metrics(validation_sums(engine, objective, masker, val_batches))
    docs = train[DOC_INDEX_COLUMN][order[:batch * args.steps]]
    return {"median_step_s": round(statistics.median(seconds[args.warmup:]), 4),
            "val_loss": round(metrics["val_loss"], 4),
            "mean_documents_per_row": round(float((docs.max(axis=1) + 1).mean()), 2)}


def table(report: dict[str, Any]) -> str:
    rows = ["| document_mask | s/step | validation MLM loss |", "|---|---|---|"]
    for name in ("off", "on"):
        r = report["runs"][name]
        rows.append(f"| {name} | {r['median_step_s']} | {r['val_loss']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    tok_dir, vocab_dir = ensure_artifacts(args.workdir)
    report = {"bench": "document_mask", "command": command_line(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "load_average": load_average(), "shape": "cpu-small", "micro_batch": 16, "seq_len": 128,
              "steps": args.steps, "eval_batches": args.eval_batches, "runs": {}}
    for name, on in (("off", False), ("on", True)):
        report["runs"][name] = run(on, args, tok_dir, vocab_dir)
        print(name, report["runs"][name], flush=True)
    off, on = report["runs"]["off"], report["runs"]["on"]
    report["step_time_on_over_off"] = round(on["median_step_s"] / off["median_step_s"], 3)
    report["val_loss_on_minus_off"] = round(on["val_loss"] - off["val_loss"], 4)
    report["total_s"] = round(time.time() - started, 1)
    report["load_average_after"] = load_average()
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
