"""The one place a DeepSpeed config is built, for pretraining (`PretrainConfig`) and a fine-tuning trial.

Only DeepSpeed's own settings live here: ZeRO stage, precision (bf16 on GPU, fp32 on CPU, where gloo has no bf16
all-reduce worth having), the batch arithmetic and clipping. The optimizer and the schedule are client objects
built by `training.engine` (DeepSpeed's own Adam JIT-compiles a C++/CUDA op for minutes; its `WarmupDecayLR` is off
by two steps against the reference linear schedule), so the JSON has no "optimizer" or "scheduler" section and
allows ZeRO with an "untested" optimizer. Inputs are valid: `core.config.validate` checked them.
"""

from __future__ import annotations

from typing import Any

from core.config import PretrainConfig, pretrain_accumulation

QUIET_STEPS = 10**9
"""DeepSpeed prints its own progress every `steps_per_print`; the training loop prints ours instead."""


def engine_config(train_batch: int, micro: int, accum: int, clip: float, zero_stage: int,
                  use_gpu: bool) -> dict[str, Any]:
    """DeepSpeed JSON: batch arithmetic, clipping, ZeRO, precision."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage >= 2:
        zero.update(contiguous_gradients=True, overlap_comm=use_gpu, reduce_scatter=True)
    if zero_stage == 3:
        # lets `engine.save_16bit_model` gather a full state dict (fine-tuning saves the best epoch with it)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_batch_size": train_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client torch AdamW
        "bf16": {"enabled": bool(use_gpu)},
        "fp16": {"enabled": False},
        "steps_per_print": QUIET_STEPS,
        "wall_clock_breakdown": False,
    }


def build_deepspeed_config(cfg: PretrainConfig, world_size: int, use_gpu: bool) -> dict[str, Any]:
    """DeepSpeed JSON of the pretraining engine on `world_size` workers."""
    return engine_config(cfg.train_batch_size, cfg.micro_batch_size, pretrain_accumulation(cfg, world_size),
                         cfg.grad_clip, cfg.zero_stage, use_gpu)


def build_finetune_config(grad_clip: float, zero_stage: int, use_gpu: bool, batch_size: int,
                          world_size: int) -> dict[str, Any]:
    """DeepSpeed JSON of one fine-tuning trial: `batch_size` examples per step split evenly over the workers
    (`check_finetune_trainer` made sure every grid batch size divides)."""
    return engine_config(batch_size, batch_size // world_size, 1, grad_clip, zero_stage, use_gpu)
