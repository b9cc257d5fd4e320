"""Which arithmetic a training run's forward pass uses, decided in one place for pretraining and fine-tuning.

GPU: bf16 through DeepSpeed's bf16 optimizer (or `torch.autocast` for a plain torch trial). CPU: `torch.autocast`
to bfloat16 around the forward pass and the loss, with fp32 master weights, fp32 gradients and an fp32 gloo
all-reduce: the optimizer and the collectives never see a bf16 tensor. "auto" takes bf16 on a CPU only where it
is faster: oneDNN must have native bf16 (AVX512-BF16 or AMX), and the model wide enough for the matrix products to
outweigh the casts. bench/results/step_speed.json measured both presets on an AVX512-BF16 CPU: the debug model
(hidden 64) stepped slower in bf16, cpu-small (hidden 256) faster, so `auto` starts at that width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUTO_CPU_MIN_HIDDEN = 256
"""The narrowest hidden size at which bf16 autocast measured faster than fp32 on CPU (step_speed.json)."""


def cpu_has_bf16() -> bool:
    """oneDNN computes bf16 natively on this CPU (AVX512-BF16 or AMX), rather than emulating it."""
    import torch  # here, not at the top: the plan (DeepSpeed's config) reads this module without torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve(asked: str, use_gpu: bool, hidden_size: int) -> str:
    """"bf16" or "fp32" for a run that asked `asked` ("auto", "fp32", "bf16")."""
    if asked != "auto":
        return asked
    if use_gpu:
        return "bf16"
    return "bf16" if cpu_has_bf16() and hidden_size >= AUTO_CPU_MIN_HIDDEN else "fp32"


def emulated_cost(setting: str, asked: str, use_gpu: bool, native: bool | None = None) -> str | None:
    """The one line a run that asked for bf16 on a CPU without native bf16 (`native`: `cpu_has_bf16()` unless
    given) prints at its start; `auto` never takes bf16 there. oneDNN then emulates bf16 with fp32 arithmetic and
    conversions, so the request costs time rather than saving it."""
    if asked != "bf16" or use_gpu or (cpu_has_bf16() if native is None else native):
        return None
    return (f"{setting}=bf16 on a CPU without native bf16 (oneDNN emulates it): measured 14x slower than fp32 "
            f"(cpu-small on an AVX2-only CPU: 242 against 3,459 tokens/s); {setting}=auto takes fp32 on this CPU")


def deepspeed_bf16(asked: str, use_gpu: bool) -> bool:
    """Whether DeepSpeed's own bf16 mode is on: on GPU exactly when the run resolves to bf16 ("auto" does there);
    on CPU never (bf16 there is `torch.autocast` over fp32 DeepSpeed, `autocast_dtype`)."""
    return use_gpu and resolve(asked, use_gpu, AUTO_CPU_MIN_HIDDEN) == "bf16"


def autocast_dtype(precision: str, use_gpu: bool, deepspeed: bool) -> torch.dtype | None:
    """The dtype the engine autocasts its forward pass to, or None: on GPU under DeepSpeed the bf16 optimizer holds
    bf16 weights itself, so no autocast is needed there."""
    import torch

    if precision != "bf16" or (use_gpu and deepspeed):
        return None
    return torch.bfloat16
