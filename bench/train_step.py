"""Benchmark: one pretraining optimizer step on one device, the stage's DeepSpeed engine vs plain torch.

ours   the pipeline's engine (`training.engine.build`) with `training.deepspeed_config.build_deepspeed_config` for
       the preset's ZeRO stage (world size 1; on GPU bf16 weights with an fp32 master copy in DeepSpeed's
       optimizer wrapper, on CPU fp32), client torch AdamW and linear schedule, DeepSpeed's gradient clipping.
torch  the same engine's plain-torch path (`build` without a DeepSpeed config): fp32 weights, on GPU under
       `torch.autocast(bfloat16)`, fused torch AdamW, `clip_grad_norm_`.

Both sides: the same seed and initial weights, the same AdamW, the same schedule (`--lr`, `--lr-warmup` steps of
linear warmup from 0, then linear decay; each row lists the lr of every step) and the same span-masked batch
and micro-batch. The precision policies are equal on CPU (fp32 both, so their losses agree step for step) and
differ on GPU (bf16 weights against fp32 weights under bf16 autocast); each row names its policy
(`precision`), and the table prints it beside the ratio.
Same model (`DebertaForMaskedLM`, EMD, LM head on the targets).
Each mode runs in its own process (peak memory does not mix). Reported: the median and fastest step of
`--steps` timed steps after `--warmup`, tokens/s, MFU against the device's bf16 peak (deberta.flops),
and peak allocated memory over the whole step (weights, optimizer state, gradients and activations).

    python -m bench.train_step --like 1.5b --micro 8 --zero 2 3        # the 1.5B model, on one GPU
    python -m bench.train_step --device cpu --like base --layers 2 --vocab 8000 --seq 128 --micro 4 --zero 2
        --steps 4 --warmup 2 --lr-warmup 2                              # CPU-sized: bench/results/train_step.json
Prints one JSON object (also written to --json, by default bench/results/train_step.json) and a table. Meant for
CUDA; on CPU (fp32, gloo) it shows the code path and the two sides' agreement, not speed (`bench.model` has that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import RESULTS, WorkerFailed, command_line, emit, load_average, run_worker
from bench.model import LIKE, like, make_inputs
from deberta import flops
from deberta.config import DebertaConfig

MODES = ("deepspeed", "torch")


def build_config(args: argparse.Namespace) -> DebertaConfig:
    kw = {"vocab_size": args.vocab, "attn_impl": args.attn} | ({"num_hidden_layers": args.layers} if args.layers else {})
    return like(args.like, **kw)


def _pretrain_config(args: argparse.Namespace):
    """The stage's config for this step: its AdamW settings, `--lr` with `--lr-warmup`, one worker."""
    from core.config import PretrainConfig

    return PretrainConfig(num_workers=1, use_gpu=args.device == "cuda", zero_stage=args.zero[0],
                          micro_batch_size=args.micro, train_batch_size=args.micro, lr=args.lr,
                          warmup_steps=args.lr_warmup, max_steps=10_000)


def _optim_spec(pcfg):
    from training.engine import OptimSpec

    return OptimSpec(lr=pcfg.lr, warmup_steps=pcfg.warmup_steps, total_steps=pcfg.max_steps,
                     weight_decay=pcfg.weight_decay, betas=(pcfg.adam_beta1, pcfg.adam_beta2), eps=pcfg.adam_eps,
                     grad_clip=pcfg.grad_clip)


def _deepspeed_step(args: argparse.Namespace, cfg: DebertaConfig):
    from training.deepspeed_config import build_deepspeed_config
    from training.engine import build
    from deberta.model import DebertaForMaskedLM, init_weights

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    pcfg = _pretrain_config(args)
    engine = build(lambda: DebertaForMaskedLM(cfg), _optim_spec(pcfg),
                   ds_config=build_deepspeed_config(pcfg, 1, use_gpu=cuda), backend="nccl" if cuda else "gloo",
                   seed=pcfg.seed, init_module=lambda m: init_weights(m, cfg), compile=args.compile)
    engine.train()
    precision = "bf16 weights, fp32 master copy" if cuda else "fp32"

    def step(ids, mask, labels):
        lr = engine.lr  # the lr this step's update uses
        loss = engine(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
        engine.backward(loss)
        engine.step()
        return loss, lr
    return step, precision


def _torch_step(args: argparse.Namespace, cfg: DebertaConfig):
    from training.engine import build
    from deberta.model import DebertaForMaskedLM

    pcfg = _pretrain_config(args)
    cuda = args.device == "cuda"
    engine = build(lambda: DebertaForMaskedLM(cfg), _optim_spec(pcfg), device=args.device, seed=pcfg.seed,
                   compile=args.compile)
    engine.train()
    precision = "fp32 weights, bf16 autocast" if cuda else "fp32"

    def step(ids, mask, labels):
        lr = engine.lr
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
            loss = engine(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
        engine.backward(loss)
        engine.step()  # clipping, AdamW, the schedule
        return loss, lr
    return step, precision


def _profile(args: argparse.Namespace, step, inputs) -> None:
    """Two more steps under torch.profiler; the ops that took the most device time, to `--profile`/<mode>.txt."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(*inputs)
        if args.device == "cuda":
            torch.cuda.synchronize()
    name = f"profile_{args.mode}{args.zero[0] if args.mode == 'deepspeed' else ''}.txt"
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    (args.profile / name).write_text(table)


def worker(args: argparse.Namespace) -> dict:
    """One mode in this process: build, warm up, time; returns one result row."""
    cfg = build_config(args)
    step, precision = (_deepspeed_step if args.mode == "deepspeed" else _torch_step)(args, cfg)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    inputs = make_inputs(cfg, args.micro, args.seq, args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, lrs, times = [], [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss, lr = step(*inputs)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        lrs.append(lr)
    if args.profile:
        _profile(args, step, inputs)
    tokens = args.micro * args.seq
    fl = flops.train_flops_per_token(cfg, args.seq, "mlm")
    peak = flops.peak_flops(torch.cuda.get_device_name(), "bf16") if cuda else None
    med = statistics.median(times)
    return {"mode": args.mode, "zero": args.zero[0] if args.mode == "deepspeed" else None, "like": args.like,
            "attn": args.attn, "compiled": args.compile,
            "step_s_median": med, "step_s_min": min(times),
            "tokens_per_s": tokens / med, "mfu": flops.mfu(tokens / med, fl, peak) if peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "precision": precision,
            "first_loss": losses[0], "last_loss": losses[-1], "losses": losses, "lrs": lrs}


def _spawn(args: argparse.Namespace, mode: str, zero: int) -> dict:
    """One mode's step in a process of its own (peak memory does not mix); a failure is a row of the report."""
    argv = ["--worker", "--mode", mode, "--zero", str(zero)]
    for k in ("like", "layers", "vocab", "seq", "micro", "steps", "warmup", "port", "device", "lr", "lr_warmup"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    argv += ["--attn", args.attn] + (["--compile"] if args.compile else [])
    if args.profile:
        argv += ["--profile", str(args.profile)]
    try:
        return run_worker("bench.train_step", *argv)
    except WorkerFailed as e:
        return {"mode": mode, "error": str(e)[-2000:]}


def table(report: dict) -> str:
    rows = ["| mode | ZeRO | precision | step s (median) | tokens/s | MFU | peak GiB | loss first -> last |",
            "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if "error" in r:
            rows.append(f"| {r['mode']} | failed: {r['error'].strip().splitlines()[-1][:80]} ||||||")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        rows.append(f"| {r['mode']} | {r['zero'] if r['zero'] is not None else '-'} | {r['precision']} | "
                    f"{r['step_s_median']:.3f} | "
                    f"{r['tokens_per_s']:,.0f} | {mfu} | {mem} | "
                    f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    ok = [r for r in report["results"] if "error" not in r]
    peer = next((r for r in ok if r["mode"] == "torch"), None)
    rows.append("")
    for r in ok:
        if peer and r is not peer:
            ratio = r["tokens_per_s"] / peer["tokens_per_s"]
            rows.append(f"DeepSpeed ZeRO-{r['zero']} / torch: throughput {ratio:.2f}x")
            if peer["peak_mem_gib"]:
                rows[-1] += f", peak memory {r['peak_mem_gib'] / peer['peak_mem_gib']:.2f}x"
            same = r["precision"] == peer["precision"]
            rows[-1] += (f"; same schedule, same precision ({r['precision']})" if same else
                         f"; same schedule, different precision ({r['precision']} against {peer['precision']})")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.splitlines()[0])
    p.add_argument("--like", choices=sorted(LIKE), default="1.5b")
    p.add_argument("--layers", type=int, default=0, help="0 = the model's own depth")
    p.add_argument("--vocab", type=int, default=128_100, help="embedding rows (128K pieces for the paper's models)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=8, help="sequences per step")
    p.add_argument("--zero", type=int, nargs="+", default=[3], help="DeepSpeed ZeRO stages to run, one process each")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--lr", type=float, default=2e-4, help="peak lr of both sides (DeBERTa Table 8's base lr)")
    p.add_argument("--lr-warmup", type=int, default=1, help="linear warmup steps from lr 0, both sides")
    p.add_argument("--attn", choices=["sdpa", "math", "fused"], default="sdpa",
                   help="model.attn_impl: fused = disentangled-flash's Triton kernels (CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (DeepSpeed: engine.compile())")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run of the code path only (fp32, gloo; no MFU or memory figures)")
    p.add_argument("--json", type=Path, default=RESULTS / "train_step.json", help="where the JSON report goes")
    p.add_argument("--profile", type=Path, default=None, help="folder for a torch.profiler table per mode")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.train_step: no CUDA device; pass --device cpu for a smoke run of the code path")
    cfg = build_config(args)
    with torch.device("meta"):
        from deberta.model import DebertaForMaskedLM
        params = sum(p.numel() for p in DebertaForMaskedLM(cfg).parameters())
    report = {"command": command_line(), "lr": args.lr, "lr_warmup": args.lr_warmup, "config": cfg.to_dict(),
              "params": params, "seq": args.seq,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "micro_batch": args.micro, "tokens_per_step": args.seq * args.micro, "steps": args.steps,
              "flops_per_token": flops.train_flops_per_token(cfg, args.seq, "mlm"),
              "results": [_spawn(args, m, z) for m in args.modes for z in (args.zero if m == "deepspeed" else [0])]}
    report["load_average"] = load_average()
    emit(report, args.json, table(report))


if __name__ == "__main__":
    main()
