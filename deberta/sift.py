"""SiFT: scale-invariant fine-tuning (DeBERTa §4), as microsoft/DeBERTa `DeBERTa/sift/sift.py` runs it.

The perturbation lives on the *normalised* word embeddings: the model (built with `sift=True`) applies
a LayerNorm without affine to the word embeddings before the embedding LayerNorm, on clean and
perturbed passes alike, and adds `embedding_delta` after it. Because the normalised embeddings have
unit scale whatever the model size, one perturbation size suits every model (DeBERTa §4's point).

One SiFT step, after the clean forward pass produced `clean_logits` (p = perturbed, c = clean):
  δ ~ N(0, 0.01²) clamped to ±0.02                                  (per token and feature)
  g = ∂ Σ_examples D(p(x̂ + δ), sg(c)) / ∂δ                          (parameters get no gradient)
  δ ← δ + 1e-4 · g / (1e-6 + max_feature |g|)                       (per token)
  loss = λ · mean_examples D(p(x̂ + δ), c)                           (λ ≈ 5; c *not* detached)
where x̂ = sg(normalised embeddings) and sg = stop-gradient. What follows the reference exactly:
* D is the reference's "symmetric KL", which is two cross-entropies, each against the other side's
  detached probabilities: D(a, b) = H(sg(softmax b), softmax a) + H(sg(softmax a), softmax b). Its value
  is the symmetric KL plus both entropies; its gradient is softmax(a) - softmax(b) on a, the reverse on b.
* the final term does not detach the clean logits, so half of its gradient reaches the clean pass;
* the ascent step differentiates the *summed* divergence: per-token max-normalisation makes the scale
  irrelevant except against the 1e-6 floor, which a mean (B times smaller) would hit B times sooner;
* both perturbed passes add δ to the detached normalised embeddings, so they send no gradient into the
  embedding table (the reference reuses the clean pass's normalised input, detached). `deberta.model`
  adds δ after its own normalisation; here a forward hook detaches the word-embedding lookup for the
  duration of the SiFT passes, which is the same thing (the normalisation has no parameters);
* a non-finite ascent gradient leaves δ at its initial draw.

Regression (one output, `regression=True`): softmax over one logit is 1, so the reference's D is
identically zero there - its SiFT term, and gradient, vanish for STS-B-like heads (it still runs the
passes). `regression_term` picks:
* "mse" (default, *our extension*, not the reference): D = squared error per example, with the same
  structure as above (ascent on the sum against detached clean outputs; final term the mean, clean
  outputs not detached);
* "reference": D is the two cross-entropies whatever the head, i.e. the term is exactly zero.

The caller adds the returned term to the task loss, passing the clean logits *undetached*:
`loss = out["loss"] + sift_loss(model, ids, mask, out["logits"], model.regression)`.

Usage with the pipeline's fine-tuning stage:
    model = DebertaForSequenceClassification(cfg, num_labels, classifier_dropout, sift=True)
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.01
CLAMP_STDS = 2.0  # δ's draw is clamped to ±2 init_std, as the reference PerturbationLayer
STEP_SIZE = 1e-4
GRAD_EPS = 1e-6
DEFAULT_LAMBDA = 5.0
REGRESSION_TERMS = ("mse", "reference")

Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def symmetric_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """The reference's `symmetric_kl`: per example (N,) over logits (..., C) flattened to (N, C).

    H(sg(q), p) + H(sg(p), q), p = softmax(logits), q = softmax(target_logits): each cross-entropy's
    target probabilities are detached, so each side only gets the gradient of its own log-softmax.
    """
    logp = F.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)  # (N, C)
    logq = F.log_softmax(target_logits.reshape(-1, target_logits.shape[-1]).float(), dim=-1)  # (N, C)
    p, q = logp.exp().detach(), logq.exp().detach()
    return -(q * logp).sum(-1) - (p * logq).sum(-1)


def squared_error(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-example squared error (N,) over outputs (N, K): the "mse" regression term (our extension)."""
    diff = outputs.float().reshape(outputs.shape[0], -1) - target.float().reshape(target.shape[0], -1)  # (N, K)
    return diff.pow(2).sum(-1)


def divergence_for(regression: bool, regression_term: str = "mse") -> Divergence:
    """The per-example divergence D for a head: see the module docstring."""
    if regression_term not in REGRESSION_TERMS:
        raise ValueError(f"sift: regression_term={regression_term!r} must be one of {', '.join(REGRESSION_TERMS)}")
    return squared_error if regression and regression_term == "mse" else symmetric_cross_entropy


def _sift_model_check(model: nn.Module) -> None:
    embeddings = getattr(getattr(model, "deberta", None), "embeddings", None)
    if embeddings is None or not getattr(embeddings, "sift", False):
        raise ValueError(
            "sift_loss: the model must be built with sift=True "
            "(DebertaForSequenceClassification(cfg, num_labels, classifier_dropout, sift=True)) so that clean "
            "and perturbed passes share the embedding normalisation"
        )


@contextlib.contextmanager
def detached_embeddings(model: nn.Module) -> Iterator[None]:
    """Within: the word-embedding lookup is detached, so δ is added to detached normalised embeddings."""
    lookup = model.deberta.embeddings.word_embeddings
    handle = lookup.register_forward_hook(lambda _module, _inputs, out: out.detach())
    try:
        yield
    finally:
        handle.remove()


def initial_delta(
    shape: tuple[int, ...], init_std: float, device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, T, H) float32 draw N(0, init_std²) clamped to ±2 init_std; `generator` (CPU) makes it reproducible."""
    noise = torch.randn(shape, generator=generator, device="cpu" if generator is not None else device)
    bound = CLAMP_STDS * init_std
    return (noise.to(device) * init_std).clamp_(-bound, bound)


def ascent_step(delta: torch.Tensor, grad: torch.Tensor, step_size: float = STEP_SIZE) -> torch.Tensor:
    """δ + step · g / (1e-6 + max over features |g|), per token; δ unchanged when g is not finite."""
    if not torch.isfinite(grad).all():
        return delta  # the reference skips the update rather than poisoning δ
    scale = GRAD_EPS + grad.abs().amax(dim=-1, keepdim=True)  # (B, T, 1)
    return delta + step_size * grad / scale


def adversarial_delta(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    clean_logits: torch.Tensor,
    divergence: Divergence,
    init_std: float = INIT_STD,
    step_size: float = STEP_SIZE,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """δ (*input_ids.shape, H) after one ascent step on Σ D(perturbed, detached clean); detached, no parameter
    gradient. input_ids (B, T), or (B, K, T) for a multiple-choice head."""
    delta = initial_delta((*input_ids.shape, model.deberta.cfg.hidden_size), init_std, clean_logits.device, generator)
    delta.requires_grad_(True)
    with detached_embeddings(model):
        adv = model(input_ids, attention_mask, embedding_delta=delta)["logits"]
    # autograd.grad with inputs=[δ] accumulates nothing into the parameters (the reference freezes them)
    (grad,) = torch.autograd.grad(divergence(adv, clean_logits.detach()).sum(), [delta])
    with torch.no_grad():
        return ascent_step(delta.detach(), grad, step_size)


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
    regression_term: str = "mse",
) -> torch.Tensor:
    """λ · mean D(perturbed, clean) after one ascent step on δ. Backward it with the task loss.

    model: a `DebertaForSequenceClassification` built with `sift=True`, in the same train/eval mode
    as for the clean pass. input_ids / attention_mask: (B, T), as for the clean pass. clean_logits:
    (B, C) from the clean pass, not detached (the reference's final term sends gradient into it).
    generator: for δ's initial draw (reproducible runs). regression_term: "mse" (our extension) or
    "reference" (zero term) for a one-output head; see the module docstring.
    Returns a scalar; with λ = 0 it is skipped (zero, no extra passes).
    """
    _sift_model_check(model)
    divergence = divergence_for(regression, regression_term)
    if lam == 0.0:
        return clean_logits.new_zeros(())
    delta = adversarial_delta(model, input_ids, attention_mask, clean_logits, divergence, init_std, step_size,
                              generator)
    with detached_embeddings(model):
        adv = model(input_ids, attention_mask, embedding_delta=delta)["logits"]
    return lam * divergence(adv, clean_logits).mean()
