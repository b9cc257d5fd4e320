"""The fused disentangled attention (`attn_impl="fused"`, disentangled-flash's Triton kernels) against ours, on a
GPU with the package (skipped elsewhere; bench/gpu_check.sh runs it): the same weights give the same hidden states
and the same gradients, in fp32 and in bf16."""

import importlib.util

import pytest
import torch

from deberta.config import debug
from deberta.model import DebertaModel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("disentangled_flash") is None,
                                 reason="needs the disentangled-flash package (pip install -e '.[fused]')")]


def _run(attn_impl: str, dtype: torch.dtype, padded: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Hidden states of one batch (the last 20 positions of row 0 padded when `padded`) and the gradients of a
    fixed function of them, for the same seeded weights."""
    torch.manual_seed(0)
    cfg = debug(vocab_size=1000, max_position_embeddings=256, attn_impl=attn_impl).replace(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = DebertaModel(cfg).cuda().train()
    ids = torch.randint(5, 1000, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -20:] = 0
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        hidden = model(ids, mask)["last_hidden_state"]
    weight = torch.randn(hidden.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda")
    (hidden.float() * weight * mask[..., None]).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if "attention.self" in n and p.grad is not None}
    return hidden.float() * mask[..., None], grads


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_attention_computes_what_ours_does(dtype, tol, padded):
    """fp32: 1e-4 (the kernels sum in another order); bf16: 2e-2 relative, a few bf16 roundings (eps 2^-7)."""
    ours, ours_grads = _run("sdpa", dtype, padded)
    fused, fused_grads = _run("fused", dtype, padded)
    assert ((fused - ours).norm() / ours.norm()).item() <= tol
    assert ours_grads.keys() == fused_grads.keys() and ours_grads
    for name, g in ours_grads.items():
        assert ((fused_grads[name] - g).norm() / g.norm()).item() <= tol * 10, name
