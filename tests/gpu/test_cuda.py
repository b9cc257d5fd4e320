"""GPU checks (skipped without CUDA): bf16 forward agrees with fp32, and an MLM step trains in bf16."""

import pytest
import torch

from deberta.config import debug
from deberta.model import DebertaForMaskedLM, DebertaModel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_forward_close_to_fp32():
    torch.manual_seed(0)
    cfg = debug(vocab_size=1000).replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = DebertaModel(cfg).cuda().eval()
    ids = torch.randint(5, 1000, (4, 128), device="cuda")
    with torch.no_grad():
        ref = model(ids)["last_hidden_state"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(ids)["last_hidden_state"]
    # bf16 keeps 8 significant bits: eps = 2^-7. Autocast rounds each matmul's inputs to bf16 (a relative error of
    # eps / 2 each, independent across entries) and accumulates in fp32; the post-LN layers renormalise, so errors
    # do not compound through the 3 layers, and the output (unit RMS, entries up to ~5) is back in fp32. Bounds: a
    # relative RMS error of at most one eps, and no entry off by more than 8 eps (~4 roundings of the largest
    # entry). CPU autocast, which rounds the same inputs, measures 0.0012 (eps / 6.5) and 0.011 (1.4 eps).
    eps = torch.finfo(torch.bfloat16).eps
    err = low.float() - ref
    assert (err.norm() / ref.norm()).item() <= eps, (err.norm() / ref.norm()).item()
    assert err.abs().max().item() <= 8 * eps, err.abs().max().item()


def test_bf16_mlm_step_reduces_loss():
    torch.manual_seed(0)
    cfg = debug(vocab_size=1000)
    model = DebertaForMaskedLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(5, 1000, (8, 64), device="cuda")
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
