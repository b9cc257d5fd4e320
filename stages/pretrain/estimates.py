"""`--dry-run` for the pretrain stage: the run on paper - parameters, ZeRO-2/3 model-state memory per GPU
(DeepSpeed's own estimators), tokens per step, compute and time at the utilisation last measured on a GPU.
"""

from __future__ import annotations

import contextlib
import io
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


def dry_run(cfg: PretrainConfig, model: DebertaConfig, inputs: dict | None = None) -> str:
    """The plan on paper: parameters, ZeRO-2/3 memory per GPU (DeepSpeed's estimators), tokens, time; with named
    corpus sources and the token shards already on this machine (`inputs`: the finished input artifacts), what the
    run reads of each source (`stages.pretrain.data.Blend.delivered`)."""
    from deberta.flops import PEAK_FLOPS

    check_config(cfg, model)
    objective = objective_for(cfg)
    counts = objective.parameter_counts(model)
    largest = largest_layer_params(objective, model)
    nodes = max(1, math.ceil(cfg.num_workers / PLAN_GPUS_PER_NODE))
    gpus_per_node = min(cfg.num_workers, PLAN_GPUS_PER_NODE)
    zero2, zero3, tables = zero_estimates(counts["total"], largest, nodes, gpus_per_node)
    seq_len = model.max_position_embeddings
    tokens = cfg.train_batch_size * seq_len
    flops_tok = objective.train_flops_per_token(model, seq_len)
    peak = PEAK_FLOPS[(PLAN_DEVICE, "bf16")]
    step_s = tokens * flops_tok / (cfg.num_workers * peak * PLAN_MFU)
    accum = build_deepspeed_config(cfg, cfg.num_workers, cfg.use_gpu).accumulation
    lines = [
        f"pretrain plan: {nodes} node(s) x {gpus_per_node} {PLAN_DEVICE} = {cfg.num_workers} workers, "
        f"ZeRO-{cfg.zero_stage}",
        objective.plan_line(model, counts, largest),
        f"  batch: {cfg.train_batch_size} sequences x {seq_len} tokens (model.max_position_embeddings) = "
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
    tokens_art = (inputs or {}).get("tokenize")
    shards = sorted(str(f) for f in (Path(tokens_art.path) / "train").glob("*.arrow")) if tokens_art else []
    blend = Blend.of_files(shards) if shards else None
    if blend is not None:
        lines += [f"  per corpus source, over {cfg.max_steps:,} steps:",
                  report_lines(blend.delivered(cfg.max_steps, accum, cfg.num_workers, cfg.micro_batch_size))]
    return "\n".join(lines)
