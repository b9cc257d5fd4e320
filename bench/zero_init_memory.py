"""Peak resident memory of a rank while it builds a ZeRO-3 model (`training.engine.construct`), then its engine.

Runs `--world` gloo ranks on this machine (CPU, fp32, the pipeline's own DeepSpeed config from
`training.deepspeed_config.DeepSpeedConfig`). Each rank reports, per phase, the rise of its peak RSS over the RSS the
phase started from (the kernel's high-water mark, VmHWM, is reset before each phase through /proc/self/clear_refs),
its RSS after the phase, and its RSS after glibc's `malloc_trim(0)` (what the allocator kept but no longer uses);
each phase starts trimmed, so its rise is its own:

    construct   the model inside `deepspeed.zero.Init`, initialised module by module (the peak `construct` bounds)
    engine      client AdamW + `deepspeed.initialize` (fp32 partitions, gradient buffers: DeepSpeed's, not ours)
    forward, backward, step   one training step (Adam's moments appear in `step`)

    .venv/bin/python -m bench.zero_init_memory --hidden 1536 --layers 10 --vocab 8000 --like 1.5b --phases 1
    .venv/bin/python -m bench.zero_init_memory --hidden 1024 --layers 14 --vocab 128100 --phases 1
    .venv/bin/python -m bench.zero_init_memory --hidden 1536 --layers 10 --vocab 8000 --like 1.5b --lean --seq 16

Prints each rank's report as JSON, then a table; the reports, with the command, go to --json (by default
bench/results/zero_init_memory.json). The figures in `construct`'s docstring come from these. For a before/after
comparison, run this file from an exported older tree (`git archive <rev> cluster deberta pipeline bench | tar -x -C
DIR`, copy it in, run in DIR).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench import memory
from bench.common import REPO, RESULTS, command_line, emit, load_average
MIB = 1 << 20
LEAN = {"reduce_bucket_size": 10**7, "stage3_prefetch_bucket_size": 10**7, "sub_group_size": 10**7,
        "stage3_max_live_parameters": 10**7, "stage3_max_reuse_distance": 10**7}
"""--lean: gradients reduced 10M elements at a time (the default 5e8 holds a whole 300M model's), parameters
prefetched 10M at a time, AdamW stepped on 10M-element slices of the shard (its temporaries are that big)."""


def rss_mib() -> float:
    return memory.rss_bytes() / MIB


def hwm_mib() -> float:
    return memory.peak_bytes() / MIB


def reset_hwm() -> None:
    memory.reset_peak()


def trim() -> float:
    """RSS after glibc hands its free pages back (tells allocator retention from memory in use)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mib()


def cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process so far (wall time means little on a shared machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


class Phase:
    """Context: peak rise over the starting RSS, RSS after, RSS after malloc_trim, wall time."""

    def __init__(self, name: str, report: dict):
        self.name, self.report = name, report

    def __enter__(self):
        trim()
        reset_hwm()
        self.start, self.t0, self.cpu0 = rss_mib(), time.time(), cpu_seconds()
        return self

    def __exit__(self, *exc):
        peak, after = hwm_mib(), rss_mib()
        self.report[self.name] = {"start": round(self.start), "peak_rise": round(peak - self.start),
                                  "after": round(after), "after_trim": round(trim()),
                                  "seconds": round(time.time() - self.t0, 1),
                                  "cpu_user_sys": [round(b - a, 1) for a, b in zip(self.cpu0, cpu_seconds())]}


def _initialize(model, spec, ds_config):
    import deepspeed

    from training.engine import make_optimizer

    optimizer, scheduler = make_optimizer(model, spec)
    return deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)[0]


def worker(args: argparse.Namespace) -> None:
    import torch

    from training.deepspeed_config import DeepSpeedConfig
    from training.engine import OptimSpec, construct, init_distributed

    try:
        from training.engine import deepspeed_engine
    except ImportError:  # a checkout from before it existed (a before/after comparison): build's own steps
        deepspeed_engine = _initialize
    from deberta.config import DebertaConfig
    from deberta.model import DebertaForMaskedLM, init_weights

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # --like 1.5b: the 1.5B's layer (log buckets, position projections shared with content, conv); else large's
    like = dict(position_buckets=256, share_att_key=True, conv_kernel_size=3) if args.like == "1.5b" else {}
    cfg = DebertaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **like)
    # --lean: DeepSpeed's buffers sized for a CPU test, not for throughput
    ds_config = DeepSpeedConfig(world, 1, 1, 1.0, 3, use_gpu=False, zero_options=LEAN if args.lean else {})
    init_distributed("gloo")
    report: dict = {"rank": rank}
    torch.manual_seed(0)
    with Phase("construct", report):
        model = construct(lambda: DebertaForMaskedLM(cfg), ds_config, init_module=lambda m: init_weights(m, cfg))
    params = sum(p.ds_numel for p in model.parameters())
    report.update(params=params, fp32_mib=round(params * 4 / MIB))
    if args.phases > 1:
        with Phase("engine", report):
            engine = deepspeed_engine(model, OptimSpec(lr=1e-4, warmup_steps=0, total_steps=10), ds_config)
    if args.phases > 2:
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(5, cfg.vocab_size, (1, args.seq), generator=g)
        labels = torch.where(torch.rand(1, args.seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        labels[0, 1] = ids[0, 1]
        with Phase("forward", report):
            loss = engine(ids, torch.ones_like(ids), labels)["loss"]
        with Phase("backward", report):
            engine.backward(loss)
        with Phase("step", report):
            engine.step()
        report["loss"] = float(loss)
    print("REPORT " + json.dumps(report), flush=True)
    torch.distributed.barrier()
    os._exit(0)  # gloo's threads can abort a normal teardown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PHASES = ("construct", "engine", "forward", "backward", "step")


def table(report: dict) -> str:
    rows = ["| rank | phase | start MiB | peak rise MiB | after MiB | after trim MiB | s |",
            "|---|---|---|---|---|---|---|"]
    for r in report["ranks"]:
        for ph in PHASES:
            if ph in r:
                x = r[ph]
                rows.append(f"| {r['rank']} | {ph} | {x['start']} | {x['peak_rise']} | {x['after']} | "
                            f"{x['after_trim']} | {x['seconds']} |")
    return "\n".join(rows)


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(args.world),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "bench.zero_init_memory", "--worker", *argv], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.world)]
    ranks = []
    for p in procs:
        out = p.communicate()[0]
        lines = [line[7:] for line in out.splitlines() if line.startswith("REPORT ")]
        if p.returncode or not lines:
            sys.exit(out[-4000:])
        ranks.append(json.loads(lines[0]))
    report = {"command": command_line(), "load_average": load_average(), "mib": "MiB = 2^20 bytes of resident memory",
              **{k: v for k, v in vars(args).items() if k not in ("worker", "json")}, "ranks": ranks}
    emit(report, args.json, table(report))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zero_init_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--like", choices=["large", "1.5b"], default="large")
    ap.add_argument("--lean", action="store_true", help="small DeepSpeed buffers (LEAN)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--phases", type=int, default=3, help="1: construct; 2: + engine; 3: + one step")
    ap.add_argument("--json", type=Path, default=RESULTS / "zero_init_memory.json", help="where the JSON report goes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    if "--json" in argv:  # the launcher's option only
        i = argv.index("--json")
        del argv[i:i + 2]
    args = ap.parse_args()
    worker(args) if args.worker else launch(args, argv)


if __name__ == "__main__":
    main()
