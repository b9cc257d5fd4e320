"""`--dry-run` for the pretrain stage: the run on paper for the hardware configured - parameters, tokens per step
(the sequences tokenize writes), compute, and time: on GPUs (`pretrain.use_gpu=true`) ZeRO-2/3 model-state memory per
GPU (DeepSpeed's own estimators) and the utilisation last measured on a GPU; on CPUs the step time this machine
measured for the presets' CPU models (bench/cpu_plan.py -> CPU_TABLE).

The memory plan (`memory_plan`): per GPU, the model states of the configured ZeRO stage and offload plus the
activations of one micro-batch (`deberta.activations`, docs/pretraining.md "Memory plan"), the largest micro-batch
that fits a GPU's memory with and without activation checkpointing, and (`memory_lacks`) the refusal of a GPU run
that does not fit, before Ray starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import PretrainConfig
from stages.pretrain.data import Blend, report_lines
from stages.pretrain.objective import Objective
from stages.pretrain.objectives import check_config, objective_for
from training.deepspeed_config import build_deepspeed_config

if TYPE_CHECKING:
    from deberta.config import DebertaConfig

REPO = Path(__file__).resolve().parents[2]
CPU_TABLE = "bench/results/cpu_plan.json"
"""Measured pretraining step times of the presets' CPU models on CPU workers (bench/cpu_plan.py writes it)."""
PLAN_GPUS_PER_NODE = 8
PLAN_DEVICE = "H100"
"""Assumptions: 8 GPUs per node, the H100's bf16 dense peak (deberta.flops; the H200's is the same)."""
PLAN_MFU = 0.0860
"""Model-FLOPs utilisation of the step, measured rather than assumed: the latest GPU measurement of the pipeline's
own step (tests/unit/test_step_options.py checks this value against the file)."""
PLAN_MFU_SOURCE = ("bench/results/h200/train_step_1.5b.json", "deepspeed")
"""Where PLAN_MFU was measured: the file, and the mode of its `results` row (the 1.5B, DeepSpeed ZeRO-2, bf16,
8 x 512 tokens per GPU, one H200)."""


def largest_layer_params(objective: Objective, model: "DebertaConfig") -> int:
    """Largest single module's own parameters (the word embedding for every preset), on the meta device."""
    import torch

    factory, _ = objective.build_model(model)
    with torch.device("meta"):
        m = factory()
    return max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())


def zero_estimates(total: int, largest: int, nodes: int, gpus_per_node: int) -> tuple[float, float, str]:
    """DeepSpeed's model-state estimates per GPU (bytes) for ZeRO-2 and ZeRO-3 without offload, and its tables."""
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)

    tables = io.StringIO()
    with contextlib.redirect_stdout(tables):
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
    _, zero2 = estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=False,
                                                        cpu_offload_params=False, zero_init=True)
    return zero2, zero3, tables.getvalue()


GB = 10**9
GIB = 2**30
PLAN_MEMORIES_GB = (80, 24)
"""The GPU memories the plan always states the largest micro-batch at: an 80 GB card (H100, A100 80GB) and a 24 GB
one (A10, L4, RTX 3090/4090)."""
RESERVE_BYTES = 2 * GIB
"""Kept out of each GPU's memory for the CUDA context, NCCL's buffers and the caching allocator's fragmentation: an
allowance, not a measurement (bench/gpu_check.sh measures the peak of a real step)."""


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU (or CPU worker) of the run: model states, and activations per sequence (they grow linearly with the
    micro-batch) with the configured checkpointing and with none and every layer."""

    states: int
    """Bytes of model states per device: DeepSpeed's estimators (ZeRO-2/3), ZeRO-Offload's share moved to the CPU,
    and the activations' part that does not grow with the micro-batch (the tied embedding's gradient)."""
    per_sequence: dict[int, int]
    """checkpoint_every (0: none, 1: all, K) -> activation bytes of one sequence (`Activations.total`)."""
    every: int
    """The configured `activation_checkpointing`."""
    micro: int
    value_bytes: int

    def needs(self, micro: int | None = None, every: int | None = None) -> int:
        """Bytes one device needs at `micro` sequences per micro-batch (default: the configured one)."""
        return self.states + (micro or self.micro) * self.per_sequence[self.every if every is None else every]

    def largest_micro(self, memory: int, every: int | None = None) -> int:
        """Most sequences per micro-batch whose plan fits `memory` bytes less `RESERVE_BYTES` (0: not even one)."""
        free = memory - RESERVE_BYTES - self.states
        return max(0, free // self.per_sequence[self.every if every is None else every])


def model_states_bytes(cfg: PretrainConfig, total: int, largest: int) -> int:
    """Model states per GPU for the ZeRO stage and offload configured: DeepSpeed's own estimators for ZeRO-2 and 3
    (bf16 weights, fp32 master weights, gradients and Adam's moments); ZeRO-0/1, which DeepSpeed has none for, in
    the same accounting (ZeRO-0: 2 + 18 bytes per parameter; ZeRO-1: whole 16-bit weights and gradients, the 16
    bytes of fp32 states sharded)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = max(1, math.ceil(cfg.num_workers / PLAN_GPUS_PER_NODE))
    per_node = min(cfg.num_workers, PLAN_GPUS_PER_NODE)
    optimizer, params = cfg.offload != "none", cfg.offload == "optimizer+parameters"
    with contextlib.redirect_stdout(io.StringIO()):
        if cfg.zero_stage == 3:
            return estimate_zero3_model_states_mem_needs(total, largest, per_node, nodes, cpu_offload=optimizer,
                                                         cpu_offload_params=params, zero_init=True)[1]
        if cfg.zero_stage == 2:
            return estimate_zero2_model_states_mem_needs(total, per_node, nodes, cpu_offload=optimizer)[1]
    if cfg.zero_stage == 1:
        return 4 * total + (0 if optimizer else 16 * total // cfg.num_workers)
    return 20 * total


def memory_plan(cfg: PretrainConfig, objective: Objective, model: "DebertaConfig", seq_len: int,
                total: int | None = None, largest: int | None = None) -> MemoryPlan:
    """The memory plan of one device of the run (GPU with `use_gpu`, else a CPU worker's RAM: fp32 states)."""
    from core.config import checkpoint_every
    from deberta.activations import Shape
    from training.precision import resolve

    total = objective.parameter_counts(model)["total"] if total is None else total
    largest = largest_layer_params(objective, model) if largest is None else largest
    every = checkpoint_every(cfg.activation_checkpointing)
    bf16 = resolve(cfg.precision, cfg.use_gpu, model.hidden_size) == "bf16"
    shape = Shape(seq_len, 1, value_bytes=2 if bf16 else 4, device="cuda" if cfg.use_gpu else "cpu")
    one = {k: objective.activations(model, shape, k) for k in {0, 1, every}}
    per_sequence = {k: a.total - a.tied_gradient for k, a in one.items()}
    states = (model_states_bytes(cfg, total, largest) if cfg.use_gpu else 16 * total) + one[0].tied_gradient
    return MemoryPlan(states, per_sequence, every, cfg.micro_batch_size, shape.value_bytes)


def _gb(n: int) -> str:
    return f"{n / GB:.3g} GB"


def memory_lines(cfg: PretrainConfig, plan: MemoryPlan, seq_len: int, gpu_memory: int | None) -> list[str]:
    """The dry run's memory lines: states + activations per device, the largest micro-batch that fits."""
    ckpt = cfg.activation_checkpointing
    where = f"ZeRO-{cfg.zero_stage}, offload {cfg.offload}" if cfg.use_gpu else "fp32 weights, gradients, Adam"
    acts = plan.micro * plan.per_sequence[plan.every]
    lines = [f"  memory per {'GPU' if cfg.use_gpu else 'worker'} (docs/pretraining.md, Memory plan): model states "
             f"and the tied embedding's gradient {_gb(plan.states)} ({where}) + activations {_gb(acts)} (micro {plan.micro} x {seq_len} tokens, "
             f"{8 * plan.value_bytes}-bit, activation_checkpointing={ckpt}) = {_gb(plan.needs())}"]
    if not cfg.use_gpu:
        return lines
    memories = [(m * GB, f"{m} GB") for m in PLAN_MEMORIES_GB if gpu_memory != m * GB]
    if gpu_memory is not None:
        memories.insert(0, (gpu_memory, f"the run's GPU, {_gb(gpu_memory)},"))
    settings = [(0, "none"), (1, "all")] + ([(plan.every, ckpt)] if plan.every > 1 else [])
    for memory, name in memories:
        fits = ", ".join(f"{plan.largest_micro(memory, k)} ({label})" for k, label in settings)
        lines.append(f"  largest micro-batch per GPU at {name} (less {RESERVE_BYTES / GIB:.0f} GiB reserve), by "
                     f"activation checkpointing: {fits}")
    if gpu_memory is not None:
        verdict = "fits" if plan.needs() <= gpu_memory - RESERVE_BYTES else "DOES NOT FIT"
        lines.append(f"  this plan {verdict} the run's GPU, {_gb(gpu_memory)} (less the reserve)")
    return lines


def gpu_memory_bytes(cfg: PretrainConfig) -> int | None:
    """One training GPU's memory: `pretrain.gpu_memory_gb`, else this machine's first GPU's, else None (unknown)."""
    if cfg.gpu_memory_gb is not None:
        return int(cfg.gpu_memory_gb * GB)
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def memory_lacks(cfg: PretrainConfig, model: "DebertaConfig", seq_len: int, gpu_memory: int) -> str:
    """Empty when a micro-batch of the plan fits `gpu_memory` bytes per GPU; else what does not fit and the fixes
    (the real run refuses with it before Ray starts)."""
    plan = memory_plan(cfg, objective_for(cfg), model, seq_len)
    if plan.needs() <= gpu_memory - RESERVE_BYTES:
        return ""
    fixes = [f"pretrain.micro_batch_size={plan.largest_micro(gpu_memory)}"] if plan.largest_micro(gpu_memory) else []
    if plan.every != 1 and plan.largest_micro(gpu_memory, 1) >= 1:
        fixes.append("pretrain.activation_checkpointing=all (fits "
                     f"micro {plan.largest_micro(gpu_memory, 1)})")
    if cfg.offload != "optimizer+parameters" and plan.states > plan.needs() - plan.states:
        fixes.append("pretrain.offload=optimizer (ZeRO 1-3) or optimizer+parameters (ZeRO-3)")
    return (f"pretrain: a GPU needs {_gb(plan.needs())} (model states {_gb(plan.states)} + activations of micro "
            f"{plan.micro} x {seq_len} tokens), more than its {_gb(gpu_memory)} less {RESERVE_BYTES / GIB:.0f} GiB "
            f"reserve (docs/pretraining.md, Memory plan); set {' or '.join(fixes) or 'a shorter sequence'}")


def sequence_length(model: "DebertaConfig", inputs: dict | None, tokenize=None) -> tuple[int, str]:
    """(tokens per sequence the run reads, where that comes from): the token shards' own when they are built here,
    else what the tokenize stage will write (`tokenize.max_seq_len`), else the model's longest."""
    tokens_art = (inputs or {}).get("tokenize")
    shards = sorted((Path(tokens_art.path) / "train").glob("*.arrow")) if tokens_art else []
    if shards:
        import pyarrow as pa

        field = pa.ipc.open_file(pa.memory_map(str(shards[0]))).schema.field("input_ids")
        return int(field.type.list_size), "the token shards"
    if tokenize is not None:
        return tokenize.max_seq_len, "tokenize.max_seq_len"
    return model.max_position_embeddings, "model.max_position_embeddings"


def cpu_measurement(objective_name: str, model: "DebertaConfig", seq_len: int,
                    table: str = CPU_TABLE) -> tuple[str, dict] | None:
    """(preset, row) of the measured table with this shape (objective, model, sequence length), or None."""
    rows = _cpu_rows(table)
    shape = {"objective": objective_name, "hidden_size": model.hidden_size, "num_hidden_layers":
             model.num_hidden_layers, "intermediate_size": model.intermediate_size, "seq_len": seq_len}
    for name, row in rows.items():
        if all(row.get(k) == v for k, v in shape.items()):
            return name, row
    return None


def cpu_lines(cfg: PretrainConfig, objective: Objective, model: "DebertaConfig", counts: dict, largest: int,
              seq_len: int, seq_from: str, accum: int) -> list[str]:
    """The plan on CPU workers: their number and CPUs, tokens, compute and the step time measured on this machine."""
    tokens = cfg.train_batch_size * seq_len
    flops_tok = objective.train_flops_per_token(model, seq_len)
    per_worker = tokens * flops_tok / cfg.num_workers  # FLOPs each worker computes per step
    found = cpu_measurement(cfg.objective, model, seq_len)
    if found is None:
        rows = _cpu_rows()
        if rows:  # no row of this shape: the FLOP rate of the nearest measured one
            name, row = min(rows.items(), key=lambda kv: abs(math.log(kv[1]["flops_per_token"] / flops_tok)))
            how = (f"at the {row['flops_per_s_per_worker'] / 1e9:.3g} GFLOP/s per worker measured for preset "
                   f"{name}'s model, the nearest measured ({CPU_TABLE}); this shape was not measured")
            step_s = per_worker / row["flops_per_s_per_worker"]
        else:
            how, step_s = f"no measurement ({CPU_TABLE} missing: run python -m bench.cpu_plan)", None
    else:
        name, row = found
        # the measured step, scaled by the sequences each worker computes per step
        step_s = row["step_s"] * (cfg.train_batch_size / cfg.num_workers) / (row["train_batch_size"] / row["num_workers"])
        how = (f"measured on this machine: {CPU_TABLE}, preset {name}, {row['step_s']:.3g} s/step with "
               f"{row['num_workers']} workers x {row['cpus_per_worker']} CPU at {row['train_batch_size']} sequences")
    params_gib = counts["total"] * 16 / 2**30  # fp32 weights and gradients, Adam's two moments
    time_line = (f"  time: {step_s:.3g} s/step ({how}), {cfg.max_steps:,} steps = "
                 f"{_duration(cfg.max_steps * step_s)} ({tokens * cfg.max_steps / 1e6:,.1f}M tokens)"
                 if step_s is not None else f"  time: {how}")
    return [
        f"pretrain plan: {cfg.num_workers} CPU worker(s) x {cfg.cpus_per_worker} CPU = "
        f"{cfg.num_workers * cfg.cpus_per_worker} CPUs (pretrain.use_gpu=false; gloo), no GPU",
        objective.plan_line(model, counts, largest),
        f"  batch: {cfg.train_batch_size} sequences x {seq_len} tokens ({seq_from}) = {tokens:,} tokens/step; "
        f"micro {cfg.micro_batch_size} x accumulation {accum} x {cfg.num_workers} workers",
        f"  compute: {flops_tok / 1e9:.3g} GFLOP/token for training (deberta.flops) = "
        f"{tokens * flops_tok / 1e12:.3g} TFLOP/step",
        time_line,
        f"  model states per worker: {params_gib:.2f} GiB of RAM (fp32 weights, gradients and Adam's moments)",
        *memory_lines(cfg, memory_plan(cfg, objective, model, seq_len, counts["total"], largest), seq_len, None),
    ]


def _cpu_rows(table: str = CPU_TABLE) -> dict:
    """The measured rows by preset; empty without the file."""
    try:
        return json.loads((REPO / table).read_text())["presets"]
    except (OSError, ValueError, KeyError):
        return {}


def _duration(seconds: float) -> str:
    return (f"{seconds / 60:.3g} min" if seconds < 3 * 3600 else f"{seconds / 3600:.3g} h" if seconds < 3 * 86400
            else f"{seconds / 86400:.3g} days")


def dry_run(cfg: PretrainConfig, model: DebertaConfig, inputs: dict | None = None, tokenize=None) -> str:
    """The plan on paper for the hardware configured: on CPUs (`use_gpu=false`) the workers and the measured step
    time (`cpu_lines`); on GPUs parameters, ZeRO-2/3 memory per GPU (DeepSpeed's estimators), tokens, time at the
    measured MFU. Tokens per step are the sequences the run reads (`sequence_length`). With named corpus sources
    and the token shards already on this machine (`inputs`: the finished input artifacts), what the run reads of
    each source (`stages.pretrain.data.Blend.delivered`)."""
    from deberta.flops import PEAK_FLOPS

    check_config(cfg, model)
    objective = objective_for(cfg)
    counts = objective.parameter_counts(model)
    largest = largest_layer_params(objective, model)
    seq_len, seq_from = sequence_length(model, inputs, tokenize)
    accum = build_deepspeed_config(cfg, cfg.num_workers, cfg.use_gpu).accumulation
    if not cfg.use_gpu:
        return "\n".join(cpu_lines(cfg, objective, model, counts, largest, seq_len, seq_from, accum)
                         + _blend_lines(cfg, inputs, accum))
    nodes = max(1, math.ceil(cfg.num_workers / PLAN_GPUS_PER_NODE))
    gpus_per_node = min(cfg.num_workers, PLAN_GPUS_PER_NODE)
    zero2, zero3, tables = zero_estimates(counts["total"], largest, nodes, gpus_per_node)
    tokens = cfg.train_batch_size * seq_len
    flops_tok = objective.train_flops_per_token(model, seq_len)
    peak = PEAK_FLOPS[(PLAN_DEVICE, "bf16")]
    step_s = tokens * flops_tok / (cfg.num_workers * peak * PLAN_MFU)
    lines = [
        f"pretrain plan: {nodes} node(s) x {gpus_per_node} {PLAN_DEVICE} = {cfg.num_workers} workers, "
        f"ZeRO-{cfg.zero_stage}",
        objective.plan_line(model, counts, largest),
        f"  batch: {cfg.train_batch_size} sequences x {seq_len} tokens ({seq_from}) = "
        f"{tokens:,} tokens/step; micro {cfg.micro_batch_size} x accumulation {accum} x {cfg.num_workers} workers",
        f"  compute: {flops_tok / 1e9:.3g} GFLOP/token for training (deberta.flops: 3 x forward incl. attention "
        f"and EMD{objective.flops_note}) = {tokens * flops_tok / 1e15:.3g} PFLOP/step",
        f"  at {PLAN_MFU:.1%} MFU (measured: {PLAN_MFU_SOURCE[0]}) of {peak / 1e12:.0f} TFLOP/s bf16 per "
        f"{PLAN_DEVICE}: {step_s:.3g} s/step, "
        f"{cfg.max_steps:,} steps = {cfg.max_steps * step_s / 86400:.3g} days "
        f"({tokens * cfg.max_steps / 1e9:,.1f}B tokens)",
        f"  model states per GPU without offload: ZeRO-2 {zero2 / 2**30:.2f} GiB, ZeRO-3 {zero3 / 2**30:.2f} GiB "
        f"(ZeRO-3 builds the model inside zero.Init, partitioned module by module)",
        "  DeepSpeed's estimator tables (model states only: bf16 params/grads + fp32 master and Adam):",
        *("    " + line for line in tables.strip().splitlines()),
        *memory_lines(cfg, memory_plan(cfg, objective, model, seq_len, counts["total"], largest), seq_len,
                      gpu_memory_bytes(cfg)),
    ]
    return "\n".join(lines + _blend_lines(cfg, inputs, accum))


def _blend_lines(cfg: PretrainConfig, inputs: dict | None, accum: int) -> list[str]:
    """With the token shards on this machine: what the run reads of each corpus source."""
    tokens_art = (inputs or {}).get("tokenize")
    shards = sorted(str(f) for f in (Path(tokens_art.path) / "train").glob("*.arrow")) if tokens_art else []
    blend = Blend.of_files(shards) if shards else None
    if blend is None:
        return []
    return [f"  per corpus source, over {cfg.max_steps:,} steps:",
            report_lines(blend.delivered(cfg.max_steps, accum, cfg.num_workers, cfg.micro_batch_size))]
