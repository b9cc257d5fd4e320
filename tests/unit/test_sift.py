"""SiFT (deberta.sift) as the reference `DeBERTa/sift/sift.py` runs it: perturbation on detached normalised
embeddings, one ascent step on the summed divergence, final term of two cross-entropies against the clean
logits, undetached; the "mse" regression term is our extension, "reference" gives zero."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deberta.config import debug
from deberta.heads import DebertaForSequenceClassification
from deberta.sift import (
    adversarial_delta,
    ascent_step,
    divergence_for,
    initial_delta,
    sift_loss,
    squared_error,
    symmetric_cross_entropy,
)

B, T, H = 4, 24, 64


def _setup(num_labels: int = 3, sift: bool = True):
    cfg = debug(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = DebertaForSequenceClassification(cfg, num_labels=num_labels, classifier_dropout=0.0, sift=sift)
    ids = torch.randint(5, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    return model, ids.masked_fill(mask == 0, 0), mask


def _seed(k: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(k)


def test_divergence_is_two_cross_entropies_against_detached_probabilities():
    a = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, 4, requires_grad=True)
    d = symmetric_cross_entropy(a, b)
    # direct formula: soft-target cross-entropies, each target the other side's detached softmax
    want = (F.cross_entropy(a, F.softmax(b, -1).detach(), reduction="none")
            + F.cross_entropy(b, F.softmax(a, -1).detach(), reduction="none"))
    torch.testing.assert_close(d, want)
    # its value is the symmetric KL plus both entropies (not zero at a == b, unlike a true KL)
    lp, lq = F.log_softmax(a, -1), F.log_softmax(b, -1)
    sym_kl = ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1)
    entropies = -(lp.exp() * lp).sum(-1) - (lq.exp() * lq).sum(-1)
    torch.testing.assert_close(d, sym_kl + entropies)
    # gradients: softmax(a) - softmax(b) on a, the reverse on b (a true symmetric KL's differ)
    ga, gb = torch.autograd.grad(d.sum(), [a, b])
    torch.testing.assert_close(ga, F.softmax(a, -1) - F.softmax(b, -1))
    torch.testing.assert_close(gb, F.softmax(b, -1) - F.softmax(a, -1))
    (ga_kl,) = torch.autograd.grad(sym_kl.sum(), [a])
    assert not torch.allclose(ga, ga_kl)


def test_needs_sift_model_and_zero_delta_is_clean_pass():
    model, ids, mask = _setup(sift=False)
    clean = model(ids, mask)["logits"]
    with pytest.raises(ValueError, match="sift=True"):
        sift_loss(model, ids, mask, clean, regression=False)
    with pytest.raises(ValueError, match="sift=True"):
        model(ids, mask, embedding_delta=torch.zeros(B, T, H))
    model, ids, mask = _setup()
    with pytest.raises(ValueError, match="regression_term"):
        sift_loss(model, ids, mask, clean, regression=True, regression_term="kl")
    with torch.no_grad():
        clean = model(ids, mask)["logits"]
        same = model(ids, mask, embedding_delta=torch.zeros(B, T, H))["logits"]
        # (a constant delta would vanish in the embedding LayerNorm: use a random one)
        moved = model(ids, mask, embedding_delta=0.05 * torch.randn(B, T, H))["logits"]
    torch.testing.assert_close(clean, same)
    assert not torch.allclose(clean, moved)


def test_initial_draw_is_clamped_normal():
    d = initial_delta((8, 64, 64), 0.01, torch.device("cpu"), _seed(0))
    assert d.dtype == torch.float32 and d.abs().max().item() == pytest.approx(0.02)
    # N(0, 0.01²) with the tails clipped (not redrawn) at 2 sigma: 4.55% sit on the bounds
    assert 0.0093 < d.std().item() < 0.0099
    assert abs((d.abs() == d.abs().max()).double().mean().item() - 0.0455) < 0.005
    torch.testing.assert_close(d, initial_delta((8, 64, 64), 0.01, torch.device("cpu"), _seed(0)))


def test_ascent_step_normalises_the_summed_divergence_per_token():
    model, ids, mask = _setup()
    clean = model(ids, mask)["logits"].detach()
    delta = adversarial_delta(model, ids, mask, clean, symmetric_cross_entropy, generator=_seed())
    # the same step by hand: gradient of the *summed* divergence at the initial draw
    d0 = initial_delta((B, T, H), 0.01, torch.device("cpu"), _seed()).requires_grad_(True)
    adv = model(ids, mask, embedding_delta=d0)["logits"]
    (g,) = torch.autograd.grad(symmetric_cross_entropy(adv, clean).sum(), [d0])
    want = d0.detach() + 1e-4 * g / (1e-6 + g.abs().amax(-1, keepdim=True))
    torch.testing.assert_close(delta, want)
    # at init the gradients are below the 1e-6 floor, so a mean (B times smaller) would shrink the step
    from_mean = ascent_step(d0.detach(), g / B)
    assert g.abs().max() < 1e-6
    assert ((delta - from_mean).abs().max() / (delta - d0).abs().max()) > 0.5
    # a non-finite gradient leaves delta at its draw
    bad = g.clone()
    bad[0, 0, 0] = float("nan")
    assert torch.equal(ascent_step(d0.detach(), bad), d0.detach())


def test_ascent_increases_divergence_and_only_final_pass_reaches_parameters():
    model, ids, mask = _setup()
    # at init the logits are ~0.01 and their divergences sit at float32 rounding (~1e-7): scale the task layer so
    # the logits are O(1) and the divergences measurable
    with torch.no_grad():
        model.classifier.weight.mul_(100.0)
    clean = model(ids, mask)["logits"].detach()
    q = F.softmax(clean, -1)
    ascended = {}
    for step in (0.0, 3e-2):
        delta = adversarial_delta(model, ids, mask, clean, symmetric_cross_entropy, step_size=step, generator=_seed())
        with torch.no_grad():
            adv = model(ids, mask, embedding_delta=delta)["logits"]
        # the ascent gradient (softmax(adv) - q on the logits) is that of KL(q || softmax(adv))
        ascended[step] = F.kl_div(F.log_softmax(adv, -1), q, reduction="sum").item()
    assert ascended[3e-2] > 10 * ascended[0.0] > 0
    # the ascent step leaves no gradient on the parameters; the returned term does
    loss = sift_loss(model, ids, mask, clean, regression=False, lam=1.0, generator=_seed())
    assert all(p.grad is None for p in model.parameters())
    loss.backward()
    assert model.deberta.encoder.layer[0].attention.self.query_proj.weight.grad.abs().sum() > 0


def test_perturbed_passes_send_no_gradient_into_the_embedding_table():
    model, ids, mask = _setup()
    clean = model(ids, mask)["logits"].detach()
    sift_loss(model, ids, mask, clean, regression=False, lam=1.0, generator=_seed()).backward()
    emb = model.deberta.embeddings
    assert emb.word_embeddings.weight.grad is None  # delta rides on detached normalised embeddings
    assert emb.LayerNorm.weight.grad.abs().sum() > 0  # everything after the perturbation is trained
    assert not emb.word_embeddings._forward_hooks  # the detaching hook is gone after the call
    out = model(ids, mask)["logits"].sum()
    out.backward()
    assert emb.word_embeddings.weight.grad.abs().sum() > 0  # ordinary passes still train the table


def test_final_term_sends_gradient_into_clean_logits():
    model, ids, mask = _setup()
    clean = model(ids, mask)["logits"].detach().requires_grad_(True)  # (B, C), a leaf standing for the clean pass
    loss = sift_loss(model, ids, mask, clean, regression=False, lam=5.0, generator=_seed())
    loss.backward()
    delta = adversarial_delta(model, ids, mask, clean, symmetric_cross_entropy, generator=_seed())
    with torch.no_grad():
        adv = model(ids, mask, embedding_delta=delta)["logits"]
    # λ · mean over examples of H(sg(p), q) differentiated in the clean logits: λ (q - p) / B
    torch.testing.assert_close(clean.grad, 5.0 * (F.softmax(clean, -1) - F.softmax(adv, -1)) / B)
    torch.testing.assert_close(loss, 5.0 * symmetric_cross_entropy(adv, clean).mean())


def test_lambda_scales_and_is_reproducible():
    model, ids, mask = _setup()
    clean = model(ids, mask)["logits"].detach()
    one = sift_loss(model, ids, mask, clean, False, lam=1.0, generator=_seed(3))
    five = sift_loss(model, ids, mask, clean, False, lam=5.0, generator=_seed(3))
    torch.testing.assert_close(five, 5 * one)
    assert sift_loss(model, ids, mask, clean, False, lam=0.0).item() == 0.0


def test_regression_mse_extension_and_reference_zero():
    model, ids, mask = _setup(num_labels=1)
    clean = model(ids, mask)["logits"].detach()
    # over a single output the reference's divergence is identically zero; the squared error is not
    assert symmetric_cross_entropy(clean + 1.0, clean).abs().max() == 0.0
    assert divergence_for(True, "reference") is symmetric_cross_entropy
    assert divergence_for(False, "mse") is symmetric_cross_entropy
    torch.testing.assert_close(divergence_for(True)(clean + 1.0, clean), torch.ones(B))
    torch.testing.assert_close(squared_error(torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [1.0]])),
                               torch.tensor([1.0, 4.0]))
    leaf = clean.clone().requires_grad_(True)
    mse = sift_loss(model, ids, mask, leaf, regression=True, lam=1.0, generator=_seed(0))
    assert mse.item() > 0
    mse.backward()
    assert leaf.grad.abs().sum() > 0  # as for classification, the clean outputs are not detached
    ref = sift_loss(model, ids, mask, clean.clone().requires_grad_(True), regression=True, lam=1.0,
                    generator=_seed(0), regression_term="reference")
    assert ref.item() == 0.0
