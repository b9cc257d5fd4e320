"""Memory and step time against sequence length (512, 1,024, 2,048) at cpu-small's width on this CPU.

    .venv/bin/python -m bench.long_sequences     # ~2 min on 2 cores

cpu-small's model (4 x 256, 4 heads) in DeBERTaV3's long layout (`pipeline.presets.long_sequences`: 256 log buckets
over max_relative_positions 512, the EMD table at the length), the MLM with its EMD, 15% of tokens as targets,
forward + backward + AdamW on random ids, the same tokens a step at every length (`--tokens`, one sequence at
2,048). Each length runs in a fresh process, so its peak resident memory (`ru_maxrss`) is its own; reported
besides it is the growth over the process's memory after the model and optimizer were built. Step time: the
median of `--steps` steps after one warm-up step.
Writes bench/results/long_sequences.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, command_line, comma_ints, emit, load_average


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.long_sequences", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=comma_ints, default=(512, 1024, 2048))
    p.add_argument("--tokens", type=int, default=2048, help="tokens a step (batch = tokens / length)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # the worker: one length, prints JSON
    p.add_argument("--json", type=Path, default=RESULTS / "long_sequences.json")
    return p.parse_args(argv)


def one(length: int, tokens: int, steps: int) -> dict[str, Any]:
    import torch

    from deberta.model import DebertaForMaskedLM
    from pipeline.presets import cpu_small, long_sequences

    torch.manual_seed(0)
    cfg = long_sequences(cpu_small(), length).model
    model = DebertaForMaskedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = max(1, tokens // length)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(steps + 1):
        ids = torch.randint(5, cfg.vocab_size, (batch, length))
        labels = torch.where(torch.rand(batch, length) < 0.15, ids, torch.full_like(ids, -100))
        started = time.perf_counter()
        loss = model(ids, labels=labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"length": length, "batch": batch, "median_step_s": round(statistics.median(seconds[1:]), 3),
            "peak_rss_mb": round(peak), "step_growth_mb": round(peak - built),
            "tokens_per_s": round(batch * length / statistics.median(seconds[1:]))}


def table(report: dict[str, Any]) -> str:
    rows = ["| length | batch | s/step | tokens/s | peak RSS MB | growth over the built model MB |",
            "|---|---|---|---|---|---|"]
    for r in report["runs"]:
        rows.append(f"| {r['length']} | {r['batch']} | {r['median_step_s']} | {r['tokens_per_s']} | "
                    f"{r['peak_rss_mb']} | {r['step_growth_mb']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.steps)))
        return 0
    started = time.time()
    report = {"bench": "long_sequences", "command": command_line(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "load_average": load_average(), "shape": "cpu-small", "tokens_per_step": args.tokens,
              "steps": args.steps, "runs": []}
    for length in args.lengths:
        out = subprocess.run([sys.executable, "-m", "bench.long_sequences", "--one", str(length), "--tokens",
                              str(args.tokens), "--steps", str(args.steps)], capture_output=True, text=True,
                             check=True).stdout
        report["runs"].append(json.loads(out.strip().splitlines()[-1]))
        print(report["runs"][-1], flush=True)
    first = report["runs"][0]
    report["relative"] = {str(r["length"]): {"step_s": round(r["median_step_s"] / first["median_step_s"], 2),
                                              "growth_mb": round(r["step_growth_mb"] / max(first["step_growth_mb"], 1), 2)}
                          for r in report["runs"]}
    report["total_s"] = round(time.time() - started, 1)
    report["load_average_after"] = load_average()
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
