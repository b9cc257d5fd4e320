"""SiFT (deberta.sift): perturbation on normalised embeddings, one ascent step, symmetric KL / MSE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deberta.config import debug
from deberta.model import DebertaForSequenceClassification
from deberta.sift import adversarial_divergence, sift_loss, symmetric_kl


def _setup(num_labels: int = 3, sift: bool = True):
    cfg = debug(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = DebertaForSequenceClassification(cfg, num_labels=num_labels, classifier_dropout=0.0, sift=sift)
    ids = torch.randint(5, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    return model, ids.masked_fill(mask == 0, 0), mask


def test_symmetric_kl_is_both_kl_directions():
    p, q = torch.randn(5, 4), torch.randn(5, 4)
    lp, lq = F.log_softmax(p, -1), F.log_softmax(q, -1)
    want = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1) + F.kl_div(lp, lq, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(symmetric_kl(p, q), want)
    assert symmetric_kl(p, p).abs().max() < 1e-6


def test_needs_sift_model_and_zero_delta_is_clean_pass():
    model, ids, mask = _setup(sift=False)
    clean = model(ids, mask)["logits"]
    with pytest.raises(ValueError, match="sift=True"):
        sift_loss(model, ids, mask, clean, regression=False)
    with pytest.raises(ValueError, match="sift=True"):
        model(ids, mask, embedding_delta=torch.zeros(4, 24, 64))
    model, ids, mask = _setup()
    with torch.no_grad():
        clean = model(ids, mask)["logits"]
        same = model(ids, mask, embedding_delta=torch.zeros(4, 24, 64))["logits"]
        # (a constant delta would vanish in the embedding LayerNorm: use a random one)
        moved = model(ids, mask, embedding_delta=0.05 * torch.randn(4, 24, 64))["logits"]
    torch.testing.assert_close(clean, same)
    assert not torch.allclose(clean, moved)


def test_ascent_step_increases_divergence_and_only_final_pass_reaches_parameters():
    model, ids, mask = _setup()
    clean = model(ids, mask)["logits"].detach()
    kw = dict(lam=1.0, generator=None)
    losses = {}
    for step in (0.0, 1e-2):
        losses[step] = sift_loss(model, ids, mask, clean, regression=False, step_size=step,
                                 **{**kw, "generator": torch.Generator().manual_seed(7)})
    assert losses[1e-2].item() > losses[0.0].item() > 0
    # the ascent step leaves no gradient on the parameters; the returned term does
    assert all(p.grad is None for p in model.parameters())
    losses[1e-2].backward()
    assert model.deberta.encoder.layer[0].attention.self.query_proj.weight.grad.abs().sum() > 0


def test_lambda_scales_and_is_reproducible():
    model, ids, mask = _setup()
    clean = model(ids, mask)["logits"].detach()
    one = sift_loss(model, ids, mask, clean, False, lam=1.0, generator=torch.Generator().manual_seed(3))
    five = sift_loss(model, ids, mask, clean, False, lam=5.0, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(five, 5 * one)
    assert sift_loss(model, ids, mask, clean, False, lam=0.0).item() == 0.0


def test_regression_uses_mse():
    model, ids, mask = _setup(num_labels=1)
    clean = model(ids, mask)["logits"].detach()
    # KL over a single output is identically zero; the MSE is not
    assert symmetric_kl(clean + 1.0, clean).abs().max() < 1e-6
    assert adversarial_divergence(clean + 1.0, clean, regression=True).item() == pytest.approx(1.0)
    loss = sift_loss(model, ids, mask, clean, regression=True, lam=1.0, generator=torch.Generator().manual_seed(0))
    assert loss.item() > 0
