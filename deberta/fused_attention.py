"""Disentangled attention fused into Triton kernels by the `disentangled-flash` package (Apache-2.0, optional:
`pip install -e '.[fused]'`): content, c2p and p2c scores, softmax, dropout and the value product in one forward
kernel and a fused backward, never building the (Tq, Tk) scores that our SDPA path adds as a bias. CUDA only, and
self-attention only (every query position): the EMD's second pass, which queries masked positions, keeps the SDPA
path. `attn_impl="fused"` asks for it; where it cannot run the model says why (`unavailable_reason`) instead of
falling back, so a run never reports a backend it did not use.
"""

from __future__ import annotations

import importlib.util

import torch

PACKAGE = "disentangled_flash"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on `device` here, or None when they can."""
    if device.type != "cuda":
        return f"needs a CUDA device (the model is on {device.type})"
    if importlib.util.find_spec(PACKAGE) is None:
        return "needs the disentangled-flash package (pip install -e '.[fused]')"
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_k: torch.Tensor, pos_q: torch.Tensor,
           delta_rows: torch.Tensor, key_mask: torch.Tensor | None, scale: float, dropout_p: float) -> torch.Tensor:
    """softmax((q k^T + c2p + p2c) * scale) v for q, k, v (B, nh, T, d); pos_k, pos_q (nh, R, d) unscaled position
    keys and queries of the reachable table rows; delta_rows (2T - 1,) int32: the row (minus the first reachable
    one) of distance i - j = t - (T - 1) at index t. Returns (B, nh, T, d)."""
    from disentangled_flash.training._kernels import training_attention

    b, _, t, _ = q.shape
    mask = key_mask if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
    return training_attention(q.contiguous(), k.contiguous(), v.contiguous(), pos_k.contiguous(),
                              pos_q.contiguous(), delta_rows, mask.contiguous(), score_scale=scale,
                              has_padding=key_mask is not None, strict_fp32=q.dtype == torch.float32,
                              dropout_p=dropout_p)
