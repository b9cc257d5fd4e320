"""The one place a DeepSpeed config is built, for pretraining (`PretrainConfig`) and a fine-tuning trial.

`DeepSpeedConfig` is typed; `to_dict()` writes the JSON DeepSpeed reads and nothing reads it back. Only DeepSpeed's
own settings live here: ZeRO stage, precision (DeepSpeed's bf16 on GPU when the run's precision resolves to bf16
(`training.precision.deepspeed_bf16`); fp32 on CPU, where gloo has no bf16 all-reduce worth having), the batch
arithmetic and clipping. The optimizer and the schedule are client objects built by
`training.engine` (DeepSpeed's own Adam JIT-compiles a C++/CUDA op for minutes; its `WarmupDecayLR` is off by two
steps against the reference linear schedule), so the JSON has no "optimizer" or "scheduler" section and allows ZeRO
with an "untested" optimizer. Inputs are valid: `core.config.validate` checked them.

What differs between ZeRO stages is decided here and only here (`DeepSpeedConfig`'s properties and `to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from core.config import PretrainConfig, pretrain_accumulation
from training.precision import deepspeed_bf16

QUIET_STEPS = 10**9
"""DeepSpeed prints its own progress every `steps_per_print`; the training loop prints ours instead."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    """One DeepSpeed engine's settings."""

    train_batch: int
    """Sequences (examples) per optimizer step over all ranks."""
    micro: int
    """Per rank per forward pass."""
    accumulation: int
    """Micro-batches per optimizer step on each rank."""
    grad_clip: float
    zero_stage: int
    """ZeRO 0 (plain data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters)."""
    use_gpu: bool
    """GPUs (NCCL) or CPUs (gloo)."""
    bf16: bool = False
    """DeepSpeed's bf16 mode (`training.precision.deepspeed_bf16`: the run's precision decides, nothing else)."""
    offload: str = "none"
    """ZeRO-Offload (`core.config.OFFLOADS`): "optimizer" keeps the fp32 master weights and Adam's moments in CPU
    memory and steps them there; "optimizer+parameters" (ZeRO-3) also keeps the parameters there between uses."""
    zero_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra `zero_optimization` settings (tests size DeepSpeed's buffers for a CPU with them)."""

    @property
    def partitions_parameters(self) -> bool:
        """ZeRO-3: every rank holds 1/world of each parameter, so the model is built inside `deepspeed.zero.Init` and
        initialised module by module on gathered parameters (`training.engine.construct`)."""
        return self.zero_stage == 3

    @property
    def sharded_checkpoint(self) -> bool:
        """ZeRO 1-3 save optimizer (and parameter) shards per rank, merged by DeepSpeed's `zero_to_fp32`; ZeRO-0's
        checkpoint holds the whole model in rank 0's module states."""
        return self.zero_stage > 0

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed JSON: batch arithmetic, clipping, ZeRO, precision."""
        zero: dict[str, Any] = {"stage": self.zero_stage}
        if self.zero_stage >= 2:
            zero.update(contiguous_gradients=True, overlap_comm=self.use_gpu, reduce_scatter=True)
        if self.offload != "none":
            # DeepSpeed's own offload; pinned pages speed the GPU's copies (there is nothing to pin for on a CPU)
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.use_gpu}
            if self.offload == "optimizer+parameters":
                zero["offload_param"] = {"device": "cpu", "pin_memory": self.use_gpu}
        if self.partitions_parameters:
            # lets `engine.save_16bit_model` gather a full state dict (fine-tuning saves the best epoch with it)
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        zero.update(self.zero_options)
        return {
            "train_batch_size": self.train_batch,
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.accumulation,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # the client torch AdamW
            # ... also under offload, where DeepSpeed would ask for its DeepSpeedCPUAdam (`training.engine` says why)
            "zero_force_ds_cpu_optimizer": False,
            "bf16": {"enabled": bool(self.bf16)},
            "fp16": {"enabled": False},
            "steps_per_print": QUIET_STEPS,
            "wall_clock_breakdown": False,
        }


def build_deepspeed_config(cfg: PretrainConfig, world_size: int, use_gpu: bool) -> DeepSpeedConfig:
    """The pretraining engine on `world_size` workers."""
    return DeepSpeedConfig(cfg.train_batch_size, cfg.micro_batch_size, pretrain_accumulation(cfg, world_size),
                           cfg.grad_clip, cfg.zero_stage, use_gpu, deepspeed_bf16(cfg.precision, use_gpu),
                           offload=cfg.offload)


def build_finetune_config(grad_clip: float, zero_stage: int, use_gpu: bool, batch_size: int,
                          world_size: int, precision: str = "auto") -> DeepSpeedConfig:
    """One fine-tuning trial: `batch_size` examples per step split evenly over the workers
    (`check_finetune_trainer` made sure every grid batch size divides)."""
    return DeepSpeedConfig(batch_size, batch_size // world_size, 1, grad_clip, zero_stage, use_gpu,
                           deepspeed_bf16(precision, use_gpu))
