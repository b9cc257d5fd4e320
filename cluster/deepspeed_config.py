"""The one place a DeepSpeed config is built, from `PretrainConfig` or (per fine-tuning trial) `FinetuneConfig`.

Table 8 lives in the stage config (lr, betas, eps, weight decay, warmup, steps, clipping); this module
turns it into DeepSpeed's JSON: ZeRO stage, precision (bf16 on GPU, fp32 on CPU, where gloo has no bf16
all-reduce worth having), the exact batch arithmetic, and DeepSpeed's `WarmupDecayLR` (linear warmup
from 0, then linear decay to 0 at `max_steps`). The optimizer itself is a client `torch.optim.AdamW`
built by the training loop (DeepSpeed's own Adam JIT-compiles a C++/CUDA op for minutes), so the JSON
carries no "optimizer" section and allows ZeRO with an "untested" optimizer.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import (ConfigError, FinetuneConfig, PretrainConfig, check_zero_stage,
                             pretrain_accumulation)

QUIET_STEPS = 10**9
"""DeepSpeed prints its own progress every `steps_per_print`; the training loop prints ours instead."""


def _engine_config(train_batch: int, micro: int, accum: int, clip: float, zero_stage: int, use_gpu: bool,
                   what: str) -> dict[str, Any]:
    """What pretraining and fine-tuning engines share: batch arithmetic, clipping, ZeRO, precision."""
    check_zero_stage(zero_stage, what)
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
    """DeepSpeed JSON for `world_size` workers; every invariant DeepSpeed would assert deep inside is checked here."""
    accum = pretrain_accumulation(cfg, world_size)  # the same check `validate` runs
    if cfg.max_steps < 1 or cfg.warmup_steps < 0:
        raise ConfigError(f"pretrain.max_steps={cfg.max_steps} must be >= 1 and warmup_steps={cfg.warmup_steps} >= 0")
    config = _engine_config(cfg.train_batch_size, cfg.micro_batch_size, accum, cfg.grad_clip, cfg.zero_stage,
                            use_gpu, "pretrain")
    config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": cfg.lr,
            "warmup_num_steps": max(1, cfg.warmup_steps),  # DeepSpeed rejects 0 (and uses >= 2)
            "warmup_type": "linear",
            "total_num_steps": cfg.max_steps,
        },
    }
    return config


def build_finetune_config(cfg: FinetuneConfig, batch_size: int, world_size: int) -> dict[str, Any]:
    """DeepSpeed JSON for one fine-tuning trial: `batch_size` examples per step split evenly over the workers.

    No "scheduler" section: the trial passes its own LambdaLR (Table 9's warmup then linear decay), the one the
    single-process trials use, so both trainers follow the same schedule.
    """
    if world_size < 1 or batch_size % world_size:
        raise ConfigError(f"finetune.batch_size={batch_size} cannot be split evenly over {world_size} workers; "
                          f"use batch sizes that are multiples of finetune.workers_per_trial")
    return _engine_config(batch_size, batch_size // world_size, 1, cfg.grad_clip, cfg.zero_stage, cfg.use_gpu,
                          "finetune")
