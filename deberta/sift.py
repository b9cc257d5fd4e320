"""SiFT: scale-invariant fine-tuning (paper §4, SPEC.md "Fine-tuning").

The perturbation lives on the *normalised* word embeddings: the model (built with `sift=True`) applies
a LayerNorm without affine to the word embeddings before the embedding LayerNorm, on clean and
perturbed passes alike, and adds `embedding_delta` after it. Because the normalised embeddings have
unit scale whatever the model size, one perturbation size suits every model (the paper's point).

One SiFT step, after the clean forward pass produced `clean_logits`:
  δ ~ N(0, 0.01²) clamped to ±0.02                                  (per token and feature)
  g = ∂ L_adv(f(x + δ), clean) / ∂δ                                 (parameters get no gradient)
  δ ← δ + 1e-4 · g / (1e-6 + max_feature |g|)                       (per token)
  loss = λ · L_adv(f(x + δ), clean)                                 (λ ≈ 5)
L_adv is the symmetric KL for classification and MSE for a one-output regression head (KL is zero
there), as the reference does; clean logits are detached. The caller adds the returned term to the
task loss: `loss = out["loss"] + sift_loss(model, ids, mask, out["logits"], model.regression)`.

Usage with the pipeline's fine-tuning stage:
    model = DebertaForSequenceClassification(cfg, num_labels, classifier_dropout, sift=True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.01
CLAMP = 0.02  # 2 x INIT_STD, as the reference PerturbationLayer
STEP_SIZE = 1e-4
GRAD_EPS = 1e-6
DEFAULT_LAMBDA = 5.0


def symmetric_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(p||q) + KL(q||p) per example, p = softmax(logits), q = softmax(target_logits); shape (B,)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    logq = F.log_softmax(target_logits.float(), dim=-1)
    return ((logp.exp() - logq.exp()) * (logp - logq)).sum(-1)


def adversarial_divergence(logits: torch.Tensor, clean: torch.Tensor, regression: bool) -> torch.Tensor:
    """Mean over examples of the SiFT divergence between perturbed and (detached) clean outputs."""
    clean = clean.detach()
    if regression:
        return F.mse_loss(logits.float().view(-1), clean.float().view(-1))
    return symmetric_kl(logits, clean).mean()


def _sift_model_check(model: nn.Module) -> None:
    embeddings = getattr(getattr(model, "deberta", None), "embeddings", None)
    if embeddings is None or not getattr(embeddings, "sift", False):
        raise ValueError(
            "sift_loss: the model must be built with sift=True "
            "(DebertaForSequenceClassification(cfg, num_labels, classifier_dropout, sift=True)) so that clean "
            "and perturbed passes share the embedding normalisation"
        )


def sift_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    clean_logits: torch.Tensor,
    regression: bool,
    lam: float = DEFAULT_LAMBDA,
    init_std: float = INIT_STD,
    step_size: float = STEP_SIZE,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """λ · divergence(perturbed, clean) after one ascent step on δ. Backward it with the task loss.

    model: a `DebertaForSequenceClassification` built with `sift=True`, in the same train/eval mode
    as for the clean pass. input_ids / attention_mask: (B, T), as for the clean pass. clean_logits:
    (B, C) from the clean pass (detached here). generator: for δ's initial draw (reproducible runs).
    Returns a scalar; with λ = 0 it is skipped (zero, no extra passes).
    """
    _sift_model_check(model)
    if lam == 0.0:
        return clean_logits.new_zeros(())
    b, t = input_ids.shape
    hidden = model.deberta.cfg.hidden_size
    device = clean_logits.device
    noise = torch.randn(b, t, hidden, generator=generator, device="cpu" if generator is not None else device)
    delta = (noise.to(device) * init_std).clamp_(-2 * init_std, 2 * init_std).requires_grad_(True)  # (B, T, H)

    # ascent step on δ alone: autograd.grad with inputs=[δ] accumulates nothing into the parameters
    adv = model(input_ids, attention_mask, embedding_delta=delta)["logits"]
    (grad,) = torch.autograd.grad(adversarial_divergence(adv, clean_logits, regression), [delta])
    if not torch.isfinite(grad).all():
        # the reference skips the update on a non-finite gradient rather than poisoning δ
        grad = torch.zeros_like(grad)
    with torch.no_grad():
        scale = GRAD_EPS + grad.abs().amax(dim=-1, keepdim=True)  # (B, T, 1): per-token max over features
        delta = delta + step_size * grad / scale

    adv = model(input_ids, attention_mask, embedding_delta=delta.detach())["logits"]
    return lam * adversarial_divergence(adv, clean_logits, regression)
