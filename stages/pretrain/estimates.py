"""`--dry-run` for the pretrain stage: the run on paper for the hardware configured - parameters, tokens per step
(the sequences tokenize writes), compute, and time: on GPUs (`pretrain.use_gpu=true`) ZeRO-2/3 model-state memory per
GPU (DeepSpeed's own estimators) and the utilisation last measured on a GPU; on CPUs the step time this machine
measured for the presets' CPU models (bench/cpu_plan.py -> CPU_TABLE).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
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
        "  DeepSpeed's estimator tables (model states only: bf16 params/grads + fp32 master and Adam; no activations):",
        *("    " + line for line in tables.strip().splitlines()),
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
