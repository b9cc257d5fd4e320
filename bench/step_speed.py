"""The pretraining step on this CPU: fp32 against bf16 autocast and against `torch.compile`, side by side.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.step_speed'     # ~10 min on 2 cores

The step is the stage's own (`stages.pretrain.loop.train_step`: masking, the MLM with its EMD, backward, AdamW) on a
plain torch engine of `training.engine`, built with the options the stage passes (`autocast`, `compile`), over the
pipeline's debug-preset token sequences of the built-in news corpus (bench.objectives' `--workdir` artifacts; made
with `pipeline.run --until tokenize` when missing, which starts Ray). Two shapes: the debug model (hidden 64,
8 x 128 tokens a step) and cpu-small's (hidden 256, 16 x 128), embedding rows the tokenizer's.

Per shape and mode (fp32, bf16, compiled fp32): `--steps` steps from one seed on one stream of sequences; the step
time is the median after the first `--warmup` (the compiled mode's first step holds the compilation, reported as
`compile_s`: that step's time less the eager median; cold, inductor's on-disk caches off, as on a fresh node); the per-step losses of each mode against fp32's (compiled:
the same arithmetic and, with inductor's `fallback_random`, the same dropout masks, so equal within float
tolerance; bf16: rounding, so close). Quality: the debug model trained
`--quality-steps` steps in fp32 and in bf16 for each of `--seeds`, then the stage's validation pass (MLM loss).
Writes bench/results/step_speed.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import os

# a cold compilation, as a fresh node pays it: inductor's on-disk caches would serve a re-run's graphs
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import RESULTS, comma_ints, command_line, emit, load_average  # noqa: E402
from bench.objectives import _validation, ensure_artifacts, load_sequences, model_config  # noqa: E402

MODES = ("fp32", "bf16", "compiled")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("workdir/bench-objectives"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quality-steps", type=int, default=800)
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2))
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--json", type=Path, default=RESULTS / "step_speed.json")
    return p.parse_args(argv)


def shapes(vocab_dir: Path) -> dict[str, tuple[Any, int]]:
    """name -> (model config, micro batch): the debug preset's and cpu-small's, with this tokenizer's rows."""
    from pipeline.presets import MODEL_CPU_SMALL, cpu_small, debug

    base = model_config(vocab_dir)
    return {"debug": (base, debug().pretrain.micro_batch_size),
            "cpu-small": (MODEL_CPU_SMALL.replace(vocab_size=base.vocab_size), cpu_small().pretrain.micro_batch_size)}


def run(model, batch: int, mode: str, steps: int, seed: int, tok_dir: Path, vocab_dir: Path,
        eval_batches: int = 0) -> dict[str, Any]:
    """`steps` stage steps of one mode; per-step seconds and losses, and the validation loss when asked."""
    import torch

    from core.config import PretrainConfig
    from core.tokenizer import Tokenizer
    from stages.pretrain import objective_for
    from stages.pretrain.loop import optim_spec, train_step
    from training.engine import build

    cfg = PretrainConfig(num_workers=1, micro_batch_size=batch, train_batch_size=batch, lr=5e-4, warmup_steps=10,
                         max_steps=max(steps, 1), seed=seed)
    objective = objective_for(cfg)
    tok = Tokenizer.load(vocab_dir)
    masker = objective.masker(len(tok), tok.mask_id, list(tok.special_ids.values()),
                              torch.from_numpy(tok.word_start_mask()))
    factory, _ = objective.build_model(model)
    torch._dynamo.reset()  # every compiled run pays its own compilation
    # compiled code draws dropout masks from its own generator unless told to use eager's: with it, the per-step
    # losses of the two differ by arithmetic alone
    torch._inductor.config.fallback_random = True
    engine = build(factory, optim_spec(cfg), seed=seed, autocast=torch.bfloat16 if mode == "bf16" else None,
                   compile=mode == "compiled")
    train = load_sequences(tok_dir, "train")
    order = np.random.default_rng(seed).permutation(len(train))
    seconds, losses = [], []
    for step in range(steps):
        rows = order[(step * batch) % len(train):][:batch]
        started = time.perf_counter()
        means = train_step(engine, objective, masker, [objective.batch({"input_ids": train[rows]})], step)
        seconds.append(time.perf_counter() - started)
        losses.append(means["loss"])
    out = {"seconds": seconds, "losses": losses}
    if eval_batches:
        out["val_loss"] = _validation(engine, objective, masker, load_sequences(tok_dir, "validation"),
                                      eval_batches, batch)["val_loss"]
    return out


def speed(args, tok_dir: Path, vocab_dir: Path) -> dict[str, Any]:
    report = {}
    for name, (model, batch) in shapes(vocab_dir).items():
        runs = {m: run(model, batch, m, args.steps, 0, tok_dir, vocab_dir) for m in MODES}
        med = {m: statistics.median(r["seconds"][args.warmup:]) for m, r in runs.items()}
        fp32 = np.array(runs["fp32"]["losses"])
        report[name] = {
            "hidden_size": model.hidden_size, "micro_batch": batch,
            "median_step_s": {m: round(v, 4) for m, v in med.items()},
            "bf16_over_fp32": round(med["bf16"] / med["fp32"], 3),
            "compiled_over_eager": round(med["compiled"] / med["fp32"], 3),
            "compile_s": round(runs["compiled"]["seconds"][0] - med["fp32"], 1),
            "max_loss_diff_compiled": float(np.abs(np.array(runs["compiled"]["losses"]) - fp32).max()),
            "max_loss_diff_bf16": round(float(np.abs(np.array(runs["bf16"]["losses"]) - fp32).max()), 4),
        }
        print(name, report[name], flush=True)
    return report


def quality(args, tok_dir: Path, vocab_dir: Path) -> dict[str, Any]:
    model, batch = shapes(vocab_dir)["debug"]
    losses = {m: [run(model, batch, m, args.quality_steps, s, tok_dir, vocab_dir, args.eval_batches)["val_loss"]
                  for s in args.seeds] for m in ("fp32", "bf16")}
    out = {m: {"val_loss": v, "mean": round(statistics.mean(v), 4), "std": round(statistics.stdev(v), 4)}
           for m, v in losses.items()}
    out["steps"], out["seeds"] = args.quality_steps, list(args.seeds)
    out["bf16_minus_fp32"] = round(out["bf16"]["mean"] - out["fp32"]["mean"], 4)
    return out


def table(report: dict[str, Any]) -> str:
    rows = ["| shape | fp32 s/step | bf16 s/step | compiled s/step | bf16/fp32 | compiled/eager | compile s |",
            "|---|---|---|---|---|---|---|"]
    for name, r in report["speed"].items():
        m = r["median_step_s"]
        rows.append(f"| {name} | {m['fp32']} | {m['bf16']} | {m['compiled']} | {r['bf16_over_fp32']} | "
                    f"{r['compiled_over_eager']} | {r['compile_s']} |")
    q = report["quality"]
    rows.append(f"\nvalidation MLM loss after {q['steps']} debug steps, seeds {q['seeds']}: fp32 "
                f"{q['fp32']['mean']} ± {q['fp32']['std']}, bf16 {q['bf16']['mean']} ± {q['bf16']['std']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    import subprocess

    args = parse_args(argv)
    started = time.time()
    tok_dir, vocab_dir = ensure_artifacts(args.workdir)
    report = {"bench": "step_speed", "command": command_line(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "load_average": load_average(), "steps": args.steps, "warmup": args.warmup,
              "speed": speed(args, tok_dir, vocab_dir), "quality": quality(args, tok_dir, vocab_dir)}
    report["total_s"] = round(time.time() - started, 1)
    report["load_average_after"] = load_average()
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
