"""Benchmark: our `deberta` model vs HF `transformers` DeBERTa-v2, side by side, same config/batch/length.

(a) backbone   forward + backward of `DebertaModel` vs `transformers.DebertaV2Model` (equal work:
               identical weights, loss = mean of squared last hidden states).
(b) mlm        the MLM training step each library offers: ours = `DebertaForMaskedLM` (layers 1..L-1,
               Enhanced Mask Decoder on the targets only, LM head on the targets only) vs
               `transformers.DebertaV2ForMaskedLM(legacy=False)` (all L layers, no EMD, LM head at every
               position). Same token ids and 15% targets. Not the same work: HF has no EMD.
(c) mlm_same   equal work on both sides: all L backbone layers, then each library's own LM head at the 15%
               targets only, cross-entropy (ours: `DebertaModel` + `DebertaLMPredictionHead`; HF: the
               `deberta` and `lm_predictions.lm_head` modules of the same `DebertaV2ForMaskedLM`), so the
               ratio is the kernels', not the recipes'.

Both run in training mode (dropout on), forward + backward, no optimizer step (identical for both).
Timing: both libraries in one process, steps interleaved, fastest step reported (robust to load
from other processes on a shared machine). Memory: one subprocess per library so numbers do not mix.
Peak memory: on CPU, the growth of the process's peak RSS (VmHWM, `bench.memory`) over the
steps, measured from after the model and inputs were built (so it counts activations, gradients and
allocator caches, not weights); on CUDA, `torch.cuda.max_memory_allocated` over the same span.

    python -m bench.model                                    # CPU fp32, base width, 2 layers: bench/results/model.json
    python -m bench.model --device cuda --dtype bf16 --like 1.5b --layers 8 --tokens 16384
Prints one JSON object (also written to --json, by default bench/results/model.json) and a table; never asserted
in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import memory
from bench.common import RESULTS, command_line, emit, load_average, run_worker
from deberta import flops
from deberta.config import DebertaConfig
from deberta.masking import SpanMasker
from pipeline.presets import MODEL_1_5B, MODEL_BASE, MODEL_LARGE

LIKE = {"base": MODEL_BASE, "large": MODEL_LARGE, "1.5b": MODEL_1_5B}
"""The pipeline presets' model shapes (`--like`)."""
TASKS = ("backbone", "mlm", "mlm_same")
"""(a), (b), (c) of the module docstring."""


def like(name: str, **changes) -> DebertaConfig:
    """The preset shape `name` with some fields changed."""
    return LIKE[name].replace(**changes)


def build_config(args: argparse.Namespace) -> DebertaConfig:
    return like(args.like, vocab_size=args.vocab, num_hidden_layers=args.layers)


def make_inputs(cfg: DebertaConfig, batch: int, seq: int, device: str):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size - 1, (batch, seq), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2  # [CLS] ... [SEP]
    masker = SpanMasker(cfg.vocab_size, mask_id=cfg.vocab_size - 1, special_ids=[0, 1, 2], word_start=None, seed=0)
    masked, labels = masker(ids)
    mask = torch.ones_like(ids)
    return masked.to(device), mask.to(device), labels.to(device)


def _models(cfg: DebertaConfig, impl: str, task: str):
    """(module, step function) for one library and task; HF weights copied from ours."""
    from deberta import hf
    from deberta.model import DebertaForMaskedLM, DebertaModel

    torch.manual_seed(0)
    ours = DebertaModel(cfg) if task == "backbone" else DebertaForMaskedLM(cfg)
    model = ours if impl == "ours" else hf.to_transformers(ours)
    if task == "mlm_same":
        return model, _same_work_mlm_step(model, impl)
    if impl == "ours" and task == "backbone":
        def step(ids, mask, labels):
            return model(ids, mask)["last_hidden_state"].float().square().mean()
    elif impl == "ours":
        def step(ids, mask, labels):
            return model(ids, mask, labels)["loss"]
    elif task == "backbone":
        def step(ids, mask, labels):
            return model(input_ids=ids, attention_mask=mask).last_hidden_state.float().square().mean()
    else:
        def step(ids, mask, labels):
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return model, step


def _same_work_mlm_step(model, impl: str):
    """All L layers, then the library's LM head at the targets only; the backbone and head of `model`."""
    import torch.nn.functional as F

    backbone, head = model.deberta, model.lm_predictions.lm_head
    word = backbone.embeddings.word_embeddings  # HF's head takes the module, ours its weight
    word = word.weight if impl == "ours" else word

    def step(ids, mask, labels):
        if impl == "ours":
            hidden = backbone(ids, mask)["last_hidden_state"]
        else:
            hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        targets = labels != -100
        logits = head(hidden[targets], word)  # (M, H) -> (M, V)
        return F.cross_entropy(logits.float(), labels[targets])
    return step


def _setup(args: argparse.Namespace, impl: str, task: str, seq: int):
    cfg = build_config(args)
    model, step = _models(cfg, impl, task)
    model.to(args.device).train()
    batch = max(1, args.tokens // seq)
    return cfg, model, step, batch, make_inputs(cfg, batch, seq, args.device)


def _train_step(args: argparse.Namespace, model, step, inputs) -> float:
    """One forward + backward; returns wall seconds (device-synchronised)."""
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    autocast = torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    sync()
    t0 = time.perf_counter()
    with autocast:
        loss = step(*inputs)
    loss.backward()
    model.zero_grad(set_to_none=False)
    sync()
    return time.perf_counter() - t0


def time_worker(spec: dict) -> list[dict]:
    """Both libraries in one process, steps interleaved (ours, HF, ours, ...) so that load from other
    processes hits both alike; the fastest step is reported (the least disturbed), the median too."""
    args, task, seq = argparse.Namespace(**spec["args"]), spec["task"], spec["seq"]
    if args.threads:
        torch.set_num_threads(args.threads)
    setups = {impl: _setup(args, impl, task, seq) for impl in ("ours", "hf")}
    times: dict[str, list[float]] = {impl: [] for impl in setups}
    for i in range(args.warmup + args.steps):
        for impl, (_, model, step, _, inputs) in setups.items():
            t = _train_step(args, model, step, inputs)
            if i >= args.warmup:
                times[impl].append(t)
    out = []
    for impl, (cfg, _, _, batch, _) in setups.items():
        best = min(times[impl])
        r = {"impl": impl, "task": task, "seq": seq, "batch": batch, "step_s_min": best,
             "step_s_median": statistics.median(times[impl]), "tokens_per_s": batch * seq / best}
        device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        peak = flops.peak_flops(device_name, args.dtype)
        if peak:
            fl_task = {"mlm_same": "backbone"}.get(task, task) if impl == "ours" or task != "mlm" else "mlm_full_head"
            r["mfu"] = flops.mfu(r["tokens_per_s"], flops.train_flops_per_token(cfg, seq, fl_task), peak)
        out.append(r)
    return out


def memory_worker(spec: dict) -> dict:
    """Peak memory of one library's training step, alone in this process (see module docstring)."""
    args, impl = argparse.Namespace(**spec["args"]), spec["impl"]
    if args.threads:
        torch.set_num_threads(args.threads)
    _, model, step, _, inputs = _setup(args, impl, spec["task"], spec["seq"])
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated
    else:
        base, peak = memory.reset_peak(), memory.peak_bytes
    for _ in range(2):
        _train_step(args, model, step, inputs)
    return {"peak_mem_mib": (peak() - base) / 2**20}


def run_all(args: argparse.Namespace) -> dict:
    results = []
    worker_args = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
    for task in args.tasks:
        for seq in args.seq:
            spec = {"args": worker_args, "mode": "time", "task": task, "seq": seq}
            rows = run_worker("bench.model", "--worker", json.dumps(spec))
            for r in rows:
                memory_spec = {**spec, "mode": "memory", "impl": r["impl"]}
                r.update(run_worker("bench.model", "--worker", json.dumps(memory_spec)))
            results += rows
            print(f"  done {task:8s} seq={seq}", file=sys.stderr)
    cfg = build_config(args)
    return {"command": command_line(), "load_average": load_average(), "config": cfg.to_dict(),
            "device": args.device, "dtype": args.dtype,
            "threads": args.threads or torch.get_num_threads(), "tokens_per_step": args.tokens, "steps": args.steps,
            "timing": "fastest of the interleaved steps (median also given)",
            "memory": "CUDA max_memory_allocated growth" if args.device.startswith("cuda")
            else "peak RSS growth (VmHWM) over 2 steps, one process per library",
            "results": results, "speedup": _speedups(results)}


def _speedups(results: list[dict]) -> dict[str, float]:
    """ours tokens/s over HF's, per "task/seq" (the ratio the table prints)."""
    by = {(r["impl"], r["task"], r["seq"]): r["tokens_per_s"] for r in results}
    return {f"{task}/{seq}": by[("ours", task, seq)] / by[("hf", task, seq)]
            for impl, task, seq in by if impl == "ours" and ("hf", task, seq) in by}


def table(report: dict) -> str:
    rows = ["| task | seq | batch | ours tok/s | HF tok/s | speed-up | ours peak MiB | HF peak MiB | ours MFU "
            "| HF MFU |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["impl"], r["task"], r["seq"]): r for r in report["results"]}
    for (impl, task, seq), ours in by.items():
        if impl != "ours":
            continue
        theirs = by[("hf", task, seq)]
        mfu = [f"{r['mfu']:.1%}" if "mfu" in r else "-" for r in (ours, theirs)]
        rows.append(f"| {task} | {seq} | {ours['batch']} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} | "
                    f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x | {ours['peak_mem_mib']:.0f} | "
                    f"{theirs['peak_mem_mib']:.0f} | {mfu[0]} | {mfu[1]} |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.splitlines()[0])
    p.add_argument("--like", choices=sorted(LIKE), default="base", help="width and relative-position style")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32_000, help="embedding rows (the full HF head scales with it)")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step; batch = tokens // seq")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--json", type=Path, default=RESULTS / "model.json", help="where the JSON report goes")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(time_worker(spec) if spec["mode"] == "time" else memory_worker(spec)))
        return
    report = run_all(args)
    emit(report, args.json, table(report))


if __name__ == "__main__":
    main()
