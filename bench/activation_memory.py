"""The memory plan's activation figure (`deberta.activations`) against the measured peak, with and without activation
checkpointing, and the time checkpointing costs; then the same losses through DeepSpeed ZeRO 0-3 with checkpointing
and with ZeRO-Offload.

    python -m bench.activation_memory                       # cpu-small and deberta-base shapes, on this CPU
    python -m bench.activation_memory --shapes 1.5b --device cuda --json bench/results/h200/activation_memory.json

Per shape and checkpointing setting, one fresh process (so nothing of another run is resident) builds the stage's
MLM model (`stages.pretrain.mlm`, the EMD on, dropout on) and AdamW, masks rows with the stage's own span masker and
takes `--steps` training steps after a warm-up step (which allocates Adam's moments; gradients are zeroed in place,
never freed, so they stay part of the baseline). Each measured step starts from a trimmed heap (glibc's
`malloc_trim`); the process runs with a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_`), so every tensor over 64 KiB
is its own mapping and is returned to the kernel when freed: RSS then follows the live tensors. Measured:
    CPU   the rise of the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs: `bench.memory`) over
          the RSS at the step's start, through forward and backward: the activations and the backward's working set
    CUDA  `torch.cuda.max_memory_allocated` over `memory_allocated` at the step's start (the caching allocator's own
          count of live tensors)
and beside it the rise at the end of the forward pass (what is kept for the backward). On CPU RSS also holds what
the BLAS library allocates outside torch (its GEMM packing buffers: at deberta-base's 128,100 x 768 tied decoder,
hundreds of MiB), which no GPU plan counts; so one more step runs under torch's profiler (`profile_memory`), and
the running sum of its allocation events gives the peak of torch's tensors alone (`tensor_peak_mib`), the figure
the plan is checked against; the RSS peak stays beside it. Every step holds its outputs (the logits included)
through its backward pass, as the stage's loop does. The plan is
`deberta.activations.mlm_activations` at the same shape, fp32 on CPU (on CUDA the model in bf16, as DeepSpeed's bf16
mode runs it). Step times are the
time of a forward and backward pass, checkpointed and not, alternately on one model and batch in one process
(`time_ratio`), so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import REPO, RESULTS, command_line, emit, load_average

MIB = 1 << 20
SHAPES = {  # preset name -> (sequence length, micro-batch on this CPU)
    "cpu-small": ("cpu-small", 128, 16),
    "deberta-base": ("deberta-base", 512, 2),
    "1.5b": ("deberta-1.5b", 512, 8),
}
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": "0"}
"""A fixed mmap threshold (glibc raises it after the first large free, then keeps freed tensors in its heap)."""


def measure(preset: str, seq_len: int, micro: int, every: int, steps: int, device: str, threads: int) -> dict:
    """One process: warm-up step, then `steps` measured steps of the MLM at (micro, seq_len) with checkpointing
    every `every` layers (0: none)."""
    import torch

    from bench import memory
    from deberta.activations import Shape, mlm_activations
    from deberta.model import set_activation_checkpointing
    from pipeline.presets import PRESETS
    from stages.pretrain.loop import forward, optim_spec
    from stages.pretrain.objectives import objective_for
    from training.engine import heap_trimmer, make_optimizer

    torch.set_num_threads(threads)
    cfg = PRESETS[preset]()
    model_cfg, p = cfg.model, cfg.pretrain
    objective = objective_for(p)
    factory, _ = objective.build_model(model_cfg)
    torch.manual_seed(0)
    model = factory().to(device).train()
    if device == "cuda":  # bf16 weights and activations throughout, as DeepSpeed's bf16 mode runs the model
        model.to(torch.bfloat16)
    set_activation_checkpointing(model, every)
    opt, _ = make_optimizer(model, optim_spec(p))
    masker = objective.masker(model_cfg.vocab_size, model_cfg.vocab_size - 1, (0, 1, 2, 3),
                              torch.ones(model_cfg.vocab_size, dtype=torch.bool))
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(5, model_cfg.vocab_size - 1, (micro, seq_len), generator=g)}
               for _ in range(steps + 1)]
    trim, cuda = heap_trimmer(), device == "cuda"

    class Runner:  # what `forward` needs of an engine
        def __init__(self):
            self.device = torch.device(device)

        def __call__(self, **kw):
            return model(**kw)

    runner, rows = Runner(), []
    for i, batch in enumerate(batches):
        torch.manual_seed(1000 + i)  # the stage reseeds dropout every step; the same draws with and without
        trim()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = memory.reset_peak()
        start = time.perf_counter()
        out = forward(runner, masker, batch, mask_step=i)
        kept = (torch.cuda.memory_allocated() if cuda else memory.rss_bytes()) - base
        out["loss"].backward()
        if cuda:
            torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() if cuda else memory.peak_bytes()) - base
        seconds = time.perf_counter() - start
        targets = int(out["num_targets"])
        loss = float(out["loss"].detach())
        del out
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of every step's baseline
        if i:  # step 0 allocated Adam's moments and the gradients
            rows.append({"loss": loss, "peak_mib": peak / MIB, "kept_after_forward_mib": kept / MIB,
                         "seconds": seconds, "targets": targets})
    if not cuda:  # one more step under torch's profiler: the peak of the tensors alone (c10's CPU allocator)
        from torch.profiler import ProfilerActivity, profile

        torch.manual_seed(1000)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = forward(runner, masker, batches[0], mask_step=0)  # held through the backward, as the stage does
            out["loss"].backward()
            del out
        events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
        running = tensor_peak = 0
        for e in events:
            running += e.self_cpu_memory_usage
            tensor_peak = max(tensor_peak, running)
        opt.zero_grad(set_to_none=False)
    shape = Shape(seq_len, micro, value_bytes=2 if cuda else 4, device=device)
    plan = mlm_activations(model_cfg, shape, every, target_fraction=p.mlm_probability, emd=p.emd)
    peak = statistics.median(r["peak_mib"] for r in rows)
    tensors = tensor_peak / MIB if not cuda else peak
    return {"preset": preset, "seq_len": seq_len, "micro": micro, "checkpoint_every": every, "device": device,
            "threads": threads, "steps": rows, "losses": [r["loss"] for r in rows],
            "measured_peak_mib": peak, "measured_kept_mib": statistics.median(r["kept_after_forward_mib"] for r in rows),
            "step_s": statistics.median(r["seconds"] for r in rows),
            "plan_mib": plan.total / MIB, "plan_kept_mib": plan.kept / MIB,
            "plan_parts_mib": {k: v / MIB for k, v in vars(plan).items()},
            "tensor_peak_mib": tensors, "plan_over_tensor_peak": plan.total / MIB / tensors,
            "plan_over_measured": plan.total / MIB / peak}


def time_ratio(preset: str, seq_len: int, micro: int, every: int, rounds: int, device: str, threads: int) -> dict:
    """The time checkpointing costs, side by side in one process: one model, one batch, forward + backward with
    and without checkpointing alternately (`set_activation_checkpointing` between passes), so a busy machine slows
    both alike; the median over `rounds` of each round's ratio."""
    import torch

    from deberta.model import set_activation_checkpointing
    from pipeline.presets import PRESETS
    from stages.pretrain.loop import forward
    from stages.pretrain.objectives import objective_for

    torch.set_num_threads(threads)
    cfg = PRESETS[preset]()
    objective = objective_for(cfg.pretrain)
    factory, _ = objective.build_model(cfg.model)
    torch.manual_seed(0)
    model = factory().to(device).train()
    if device == "cuda":
        model.to(torch.bfloat16)
    v = cfg.model.vocab_size
    masker = objective.masker(v, v - 1, (0, 1, 2, 3), torch.ones(v, dtype=torch.bool))
    batch = {"input_ids": torch.randint(5, v - 1, (micro, seq_len), generator=torch.Generator().manual_seed(0))}
    cuda, where = device == "cuda", torch.device(device)

    class Runner:
        device = where

        def __call__(self, **kw):
            return model(**kw)

    def timed(k: int) -> float:
        set_activation_checkpointing(model, k)
        torch.manual_seed(0)
        start = time.perf_counter()
        forward(Runner(), masker, batch, mask_step=0)["loss"].backward()
        if cuda:
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=False)
        return time.perf_counter() - start

    timed(0), timed(every)  # warm-up: allocations, lazy initialisation
    pairs = [(timed(0), timed(every)) for _ in range(rounds)]
    return {"rounds": [{"none_s": a, "checkpointed_s": b} for a, b in pairs],
            "none_s": statistics.median(a for a, _ in pairs), "checkpointed_s": statistics.median(b for _, b in pairs),
            "time_ratio": statistics.median(b / a for a, b in pairs)}


def deepspeed_losses(steps: int = 4) -> dict:
    """The debug model's MLM through real DeepSpeed engines in this process (gloo, world 1): ZeRO 0-3, each plain,
    with every layer checkpointed, with every 2nd, and (ZeRO 1-3) with ZeRO-Offload of the optimizer, (ZeRO-3) of
    the parameters too; losses of `steps` steps of 2 micro-batches, dropout on, and the median step time after the
    first (a debug model: DeepSpeed's own overheads, not the arithmetic)."""
    import dataclasses

    import torch

    from core.config import PretrainConfig, checkpoint_every
    from deberta.config import debug
    from stages.pretrain.loop import optim_spec, train_step
    from stages.pretrain.objectives import objective_for
    from training.deepspeed_config import build_deepspeed_config
    from training.engine import build

    model = debug()
    base = PretrainConfig(num_workers=1, micro_batch_size=2, train_batch_size=4, lr=1e-3, warmup_steps=0,
                          max_steps=steps + 1)
    runs, times = {}, {}
    for stage in (0, 1, 2, 3):
        settings = [("none", "none"), ("all", "none"), ("every-2", "none")]
        settings += [("none", "optimizer")] if stage else []
        settings += [("all", "optimizer+parameters")] if stage == 3 else []
        for ckpt, offload in settings:
            cfg = dataclasses.replace(base, zero_stage=stage, activation_checkpointing=ckpt, offload=offload)
            objective = objective_for(cfg)
            factory, init_module = objective.build_model(model)
            engine = build(factory, optim_spec(cfg), ds_config=build_deepspeed_config(cfg, 1, use_gpu=False), seed=0,
                           init_module=init_module, checkpoint_every=checkpoint_every(ckpt))
            masker = objective.masker(model.vocab_size, model.vocab_size - 1, (0, 1, 2, 3),
                                      torch.ones(model.vocab_size, dtype=torch.bool))
            g = torch.Generator().manual_seed(0)
            losses, seconds = [], []
            for step in range(steps):
                batches = [{"input_ids": torch.randint(5, model.vocab_size - 1, (2, 32), generator=g)}
                           for _ in range(2)]
                start = time.perf_counter()
                losses.append(train_step(engine, objective, masker, batches, step)["loss"])
                seconds.append(time.perf_counter() - start)
            runs[f"zero{stage} checkpointing={ckpt} offload={offload}"] = losses
            times[f"zero{stage} checkpointing={ckpt} offload={offload}"] = statistics.median(seconds[1:])
    return {"losses": runs, "step_s": times}


def _child(args) -> None:
    if args.child == "deepspeed":
        result = deepspeed_losses()
    elif args.child.startswith("time:"):
        preset, seq, micro = SHAPES[args.child[5:]]
        micro = args.micro or micro
        result = time_ratio(preset, seq, micro, args.every, args.rounds, args.device, args.threads)
    else:
        preset, seq, micro = SHAPES[args.child]
        micro = args.micro or micro
        result = measure(preset, seq, micro, args.every, args.steps, args.device, args.threads)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # gloo's threads can abort an orderly exit


def _run(argv: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.activation_memory", *argv], cwd=REPO, text=True,
                          capture_output=True, env={**os.environ, **ENV, **(env or {})})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="cpu-small,deberta-base")
    ap.add_argument("--every", type=int, default=1, help="the checkpointed run's K (every-K); 1: every layer")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=0, help="sequences per micro-batch (0: each shape's own)")
    ap.add_argument("--rounds", type=int, default=5, help="timed pairs of passes, with and without checkpointing")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed loss-equality section")
    ap.add_argument("--json", default=str(RESULTS / "activation_memory.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    report = {"command": command_line(), "load_average_start": load_average(), "shapes": {}}
    for name in args.shapes.split(","):
        common = ["--micro", str(args.micro), "--steps", str(args.steps), "--device", args.device, "--threads", str(args.threads)]
        plain = _run(["--child", name, "--every", "0", *common])
        ckpt = _run(["--child", name, "--every", str(args.every), *common])
        timing = _run(["--child", f"time:{name}", "--every", str(args.every), "--rounds", str(args.rounds), *common])
        report["shapes"][name] = {
            "none": plain, "checkpointed": ckpt, "timing": timing,
            "peak_ratio": ckpt["tensor_peak_mib"] / plain["tensor_peak_mib"],
            "rss_peak_ratio": ckpt["measured_peak_mib"] / plain["measured_peak_mib"],
            "time_ratio": timing["time_ratio"],
            "max_loss_difference": max(abs(a - b) for a, b in zip(plain["losses"], ckpt["losses"])),
        }
    if not args.no_deepspeed:
        ds = _run(["--child", "deepspeed"], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0",
                                               "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
        runs = ds["losses"]
        first = {stage: runs[f"zero{stage} checkpointing=none offload=none"] for stage in range(4)}
        report["deepspeed"] = {**ds, "max_difference_from_plain_of_its_stage": max(
            abs(a - b) for name, losses in runs.items() for a, b in zip(losses, first[int(name[4])]))}
    report["load_average_end"] = load_average()
    lines = [f"{'shape':<14}{'ckpt':>6}{'plan MiB':>10}{'tensors':>10}{'plan/tens':>10}{'RSS':>10}{'fwd+bwd s':>10}"]
    for name, row in report["shapes"].items():
        for key, secs in (("none", "none_s"), ("checkpointed", "checkpointed_s")):
            r = row[key]
            lines.append(f"{name:<14}{r['checkpoint_every']:>6}{r['plan_mib']:>10.1f}{r['tensor_peak_mib']:>10.1f}"
                         f"{r['plan_over_tensor_peak']:>10.2f}{r['measured_peak_mib']:>10.1f}{row['timing'][secs]:>10.3f}")
        lines.append(f"{'':<14}peak {row['peak_ratio']:.2f}x, time {row['time_ratio']:.2f}x, "
                     f"loss difference {row['max_loss_difference']:.1e}")
    if "deepspeed" in report:
        lines.append(f"DeepSpeed ZeRO 0-3, checkpointing and offload: largest loss difference "
                     f"{report['deepspeed']['max_difference_from_plain_of_its_stage']:.1e}")
    emit(report, args.json and __import__("pathlib").Path(args.json), "\n".join(lines))


if __name__ == "__main__":
    main()
