"""DeBERTaV3 pretraining: replaced token detection (RTD) with a DeBERTa generator (DeBERTaV3 §3).

    model = RTDPretrainer(cfg, embedding_sharing="gdes", rtd_weight=50.0)
    out = model(input_ids=masked, attention_mask=mask, labels=labels)   # labels: original id at targets, -100 elsewhere
    out["loss"].backward()                                               # L = L_MLM + rtd_weight * L_RTD
    backbone = model.discriminator_state_dict()                          # loads into deberta.model.DebertaModel

Step: the generator (`DebertaForMaskedLM` of `generator_config(cfg)`: same width, half the depth, with its
EMD) predicts the targets; at every target one token is drawn from its softmax (temperature 1, no gradient);
the discriminator reads the original sequence with those draws in place and predicts, at every
non-padding token, whether it differs from the original (a draw equal to the original counts as original).

Decisions, with where they come from (the authors' code is microsoft/DeBERTa `DeBERTa/apps/tasks/rtd_task.py`
and `apps/models/replaced_token_detection_model.py`):

* Generator input: the reference's. Its RTD task masks with `NGramMaskGenerator(max_gram=1, keep_prob=0,
  mask_prob=1)`: every target becomes [MASK] (`SpanMasker(..., max_ngram=1, mask_prob=1.0, random_prob=0.0)`
  here). BERT's 80/10/10 (DeBERTaV3 §2.3) exists to soften the [MASK] mismatch between pretraining and
  fine-tuning of the model that is fine-tuned; here that model is the discriminator, which never sees
  [MASK], and the generator is thrown away. Kept targets would instead show the generator the answer, so
  it learns to copy and replaces fewer tokens. The code itself reads the original token from `labels`,
  so an 80/10/10 input works too; only the masker's setting decides.
* Discriminator: the plain backbone, no EMD. The reference `ReplacedTokenDetectionModel` runs all L
  encoder layers and puts its head on the last one; the EMD (and any absolute position) appears only in
  the generator (`MaskedLanguageModel`). DeBERTaV3 §3.1 says the discriminator keeps the EMD; the code, and the
  released V3 checkpoints (`position_biased_input=false`, no position table), say otherwise; we follow
  the code. The generator keeps `DebertaForMaskedLM`'s EMD, as in the reference config `rtd_*.json`
  (relative attention, `position_biased_input=false`), not DeBERTaV3 §3.1's "absolute position embeddings".
* RTD head: the reference's `LMMaskPredictionHead`, names included (`mask_predictions.dense`,
  `.LayerNorm`, `.classifier`, as in the HF hub's deberta-v3 files): LayerNorm(h_i + h_[CLS]) -> dense ->
  GELU -> one logit. BCE is averaged over every non-padding token ([CLS] and [SEP] included, as there);
  the MLM loss over targets.
* Embedding sharing (reference `RTDModel`): "es" ties the discriminator's word table to the generator's
  (one Parameter, both losses update it); "nes" keeps two tables; "gdes" makes the discriminator's own
  table the residual E_delta (zero-initialised) and adds the generator's rows under no_grad, so
  E_D[x] = sg(E_G)[x] + E_delta[x]. The reference builds the same sum as a whole V x H table in a forward
  pre-hook; adding looked-up rows is the same number per token and never materialises the table. It also
  shares absolute position tables; neither backbone here has one (the EMD's belongs to the generator).
* One module, one backward, one optimizer step, where the reference alternates two trainers (generator
  step on L_MLM, then discriminator step on lambda*L_RTD). The routing is the same: the draws carry no
  gradient, so L_RTD reaches only the discriminator (and E_delta, or the ES table), L_MLM only the
  generator; under GDES the stop-gradient keeps L_RTD off E_G. What differs: one gradient-norm clip over
  both models (ELECTRA's own recipe), and the discriminator sees E_G from before this step's update rather
  than after it. One module is also what DeepSpeed wants: one engine, one set of shards, one checkpoint;
  a table shared by two engines (ES, GDES) cannot be partitioned by both.
* ZeRO-3: every parameter is read inside the forward of the module that owns it. The GDES rows come from
  calling the generator's `nn.Embedding` module a second time (under no_grad: nothing to gather in
  backward); the ES tie is a shared Parameter, the way HF ties LM heads (ZeRO-3 tracks the modules
  using each parameter), not a shared module (DeepSpeed would hook it twice). The generator's LM head
  reads its tied table as `DebertaForMaskedLM` always has. Built inside `deepspeed.zero.Init`, the
  constructor's zero E_delta is lost on empty shards: re-initialise with `rtd_init_weights`, which keeps it
  zero. `tests/unit/test_rtd.py` builds the model that way on 2 gloo ranks, every tensor partitioned, and
  gets plain torch's losses and merged discriminator after three steps (GDES and ES).

Reproducibility: the draws use `generator` (a `torch.Generator` on the model's device, or an int seed),
else the device's default RNG, which the pretraining loop already reseeds per step (`torch.manual_seed`),
so a resumed step draws the same tokens. `torch.multinomial` with one sample is an argmax over
exponential noise: deterministic on CPU and CUDA for a given generator state.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from deberta.config import EMBEDDING_SHARING, DebertaConfig
from deberta.model import (IGNORE_INDEX, DebertaForMaskedLM, DebertaModel, SentenceOrderHead, init_weights,
                           sop_outputs)

GENERATOR_PREFIX = "generator."
DISCRIMINATOR_PREFIX = "discriminator.deberta."
HEAD_PREFIX = "discriminator.mask_predictions."
WORD_TABLE = "embeddings.word_embeddings.weight"
GDES_RESIDUAL = "is_gdes_residual"
"""Attribute marking the discriminator's word embedding as E_delta under GDES (zero init, see `rtd_init_weights`)."""


def rtd_init_weights(module: nn.Module, cfg: DebertaConfig) -> None:
    """Per-module init of an RTDPretrainer: `deberta.model.init_weights`, except that the GDES residual
    E_delta starts at zero. Under ZeRO-3 the model is built inside `deepspeed.zero.Init`, where the
    constructor's init runs on empty shards; pass `init_module=lambda m: rtd_init_weights(m, cfg)` to
    `training.engine.build` (plain `init_weights` there would give E_delta a random start)."""
    if getattr(module, GDES_RESIDUAL, False):
        nn.init.zeros_(module.weight)
    else:
        init_weights(module, cfg)


def generator_config(disc_cfg: DebertaConfig, layers: int | None = None) -> DebertaConfig:
    """The generator: the discriminator's configuration at `layers` depth (default half, at least 1; Table 10)."""
    n = max(1, disc_cfg.num_hidden_layers // 2) if layers is None else layers
    if n < 1:
        raise ValueError(f"generator_config: layers={n}; the generator needs at least 1 layer")
    if n > disc_cfg.num_hidden_layers:
        depth = disc_cfg.num_hidden_layers
        raise ValueError(f"generator_config: a {n}-layer generator is deeper than the {depth}-layer discriminator; "
                         f"DeBERTaV3 uses half the depth (pass layers <= {depth}, or None for {max(1, depth // 2)})")
    return disc_cfg.replace(num_hidden_layers=n)


class RTDHead(nn.Module):
    """Reference `LMMaskPredictionHead`: LayerNorm(h_i + h_[CLS]) -> dense -> GELU -> classifier: a logit per token."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.classifier = nn.Linear(cfg.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.LayerNorm(hidden + hidden[:, :1])  # (B, T, H) + (B, 1, H): the [CLS] state at every token
        return self.classifier(F.gelu(self.dense(x))).squeeze(-1)  # (B, T, 1) -> (B, T)


class DebertaForReplacedTokenDetection(nn.Module):
    """The discriminator: backbone (`deberta.*`, L layers, no EMD) + RTD head (`mask_predictions.*`), and with
    sop=True ALBERT's sentence-order head (`sop_head.*`, `deberta.model.SentenceOrderHead`) on its last [CLS] state."""

    def __init__(self, cfg: DebertaConfig, sop: bool = False):
        super().__init__()
        self.cfg = cfg
        self.deberta = DebertaModel(cfg, _init=False)
        self.mask_predictions = RTDHead(cfg)
        self.sop_head = SentenceOrderHead(cfg) if sop else None
        self.apply(lambda m: init_weights(m, cfg))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, word_base: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """-> {"logits": (B, T) replaced-token logits, "last_hidden_state": (B, T, H)}, and with sop "sop_logits"
        (B, 2)."""
        hidden, _, _ = self.deberta.encode(input_ids, attention_mask, word_base=word_base)
        out = {"logits": self.mask_predictions(hidden), "last_hidden_state": hidden}
        if self.sop_head is not None:
            out["sop_logits"] = self.sop_head(hidden[:, 0])  # (B, H) -> (B, 2)
        return out


def sample_replacements(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (M, V) -> (M,) token ids drawn from softmax(logits), temperature 1, without gradient."""
    if logits.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device)
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(f"RTDPretrainer: the torch.Generator is on {generator.device} but the model runs on "
                         f"{logits.device}; create it with torch.Generator(device={str(logits.device)!r}) "
                         f"or pass an int seed")
    probs = torch.softmax(logits.detach().float(), dim=-1)  # (M, V); fp32 even under bf16
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (M, 1) -> (M,)


def _as_generator(seed_or_gen: torch.Generator | int | None, device: torch.device) -> torch.Generator | None:
    if seed_or_gen is None or isinstance(seed_or_gen, torch.Generator):
        return seed_or_gen
    return torch.Generator(device=device).manual_seed(int(seed_or_gen))


def _rtd_loss(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """BCE (mean over kept tokens), correct count, kept count; logits/labels/keep (B, T)."""
    per_token = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")  # (B, T)
    hit = (logits.detach() > 0) == labels
    if keep is None:
        return per_token.mean(), hit.sum(), torch.tensor(labels.numel(), device=labels.device)
    n = keep.sum()
    # where, not multiply: garbage at padded positions (even inf) cannot leak into the loss or its gradient
    loss = torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / n.clamp(min=1)
    return loss, (hit & keep).sum(), n


class RTDPretrainer(nn.Module):
    """Generator (`generator.*`, a DebertaForMaskedLM) + discriminator (`discriminator.*`) trained on
    L = L_MLM + rtd_weight * L_RTD in one backward pass; see the module docstring for the design.

    embedding_sharing: "gdes" (E_D = sg(E_G) + E_delta; E_delta is `discriminator.deberta.embeddings.
    word_embeddings.weight`, zero at init), "es" (one table), "nes" (two tables).
    sop: ALBERT's sentence-order head on the discriminator's [CLS] (the generator has none, and is thrown away);
    emd: the generator's MLM with the enhanced mask decoder (`DebertaForMaskedLM`'s emd);
    with sop_labels the loss gains + L_SOP (weight 1, as ALBERT adds it to its MLM loss).
    """

    def __init__(
        self,
        cfg: DebertaConfig,
        *,
        generator_layers: int | None = None,
        embedding_sharing: str = "gdes",
        rtd_weight: float = 50.0,
        sop: bool = False,
        emd: bool = True,
    ):
        super().__init__()
        if embedding_sharing not in EMBEDDING_SHARING:
            raise ValueError(f"RTDPretrainer: embedding_sharing={embedding_sharing!r}; "
                             f"choose one of {EMBEDDING_SHARING}")
        if not (math.isfinite(rtd_weight) and rtd_weight >= 0):
            raise ValueError(f"RTDPretrainer: rtd_weight={rtd_weight} must be a finite number >= 0 "
                             f"(DeBERTaV3 §2.3 uses 50)")
        self.cfg = cfg
        self.generator_cfg = generator_config(cfg, generator_layers)
        self.embedding_sharing = embedding_sharing
        self.rtd_weight = float(rtd_weight)
        self.generator = DebertaForMaskedLM(self.generator_cfg, emd=emd)
        self.discriminator = DebertaForReplacedTokenDetection(cfg, sop=sop)
        disc_words = self.discriminator.deberta.embeddings.word_embeddings
        if embedding_sharing == "es":
            disc_words.weight = self.generator_embeddings.weight  # a shared Parameter (see ZeRO-3 above)
        elif embedding_sharing == "gdes":
            setattr(disc_words, GDES_RESIDUAL, True)
            rtd_init_weights(disc_words, cfg)  # E_delta = 0: the discriminator starts on the generator's table

    @property
    def generator_embeddings(self) -> nn.Embedding:
        """E_G: the generator's word table (also its tied LM-head decoder)."""
        return self.generator.deberta.embeddings.word_embeddings

    @property
    def embedding_delta(self) -> nn.Parameter | None:
        """E_delta under GDES (the discriminator's own table holds it), else None."""
        if self.embedding_sharing != "gdes":
            return None
        return self.discriminator.deberta.embeddings.word_embeddings.weight

    def _word_base(self, disc_ids: torch.Tensor) -> torch.Tensor | None:
        """GDES: sg(E_G) rows of the discriminator's input (B, T, H); None for ES/NES."""
        if self.embedding_sharing != "gdes":
            return None
        with torch.no_grad():  # the stop-gradient: L_RTD never reaches E_G
            return self.generator_embeddings(disc_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        generator: torch.Generator | int | None = None,
        sop_labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """input_ids (B, T): the generator's input (targets masked); labels (B, T): original id at targets, -100
        elsewhere; attention_mask (B, T): 0 at padding, which counts in neither loss (labels there are ignored).

        Returns loss, mlm_loss, rtd_loss (graph-connected) and detached metrics: rtd_accuracy, replaced_fraction
        (replaced / targets), generator_accuracy (argmax), the counts num_targets, num_tokens (non-padding),
        num_replaced, generator_correct, rtd_correct (sum these over workers), and per token rtd_logits,
        rtd_labels (bool) and discriminator_input_ids (B, T). Built with sop=True: sop_logits (B, 2), and with
        sop_labels ((B,), 1 = swapped, 0 = in order, -100 = no pair) sop_loss, sop_correct, sop_count.
        """
        if sop_labels is not None and self.discriminator.sop_head is None:
            raise ValueError("RTDPretrainer: sop_labels given, but the model has no sentence-order head; "
                             "build it with RTDPretrainer(cfg, sop=True)")
        if labels is None:
            raise ValueError("RTDPretrainer.forward: labels are required (original id at MLM targets, -100 elsewhere)")
        if labels.shape != input_ids.shape:
            raise ValueError(f"RTDPretrainer.forward: labels {tuple(labels.shape)} and input_ids "
                             f"{tuple(input_ids.shape)} must have the same (B, T) shape")
        keep = None if attention_mask is None else attention_mask.bool()
        if keep is not None:
            labels = labels.masked_fill(~keep, IGNORE_INDEX)
        gen = self.generator(input_ids, attention_mask, labels)
        targets = labels != IGNORE_INDEX  # (B, T)
        original = torch.where(targets, labels, input_ids)  # (B, T): the uncorrupted sequence
        sampled = sample_replacements(gen["logits"], _as_generator(generator, input_ids.device))  # (M,)
        # the generator's logits list the targets row-major, the order masked_scatter fills them in
        disc_ids = original.masked_scatter(targets, sampled.to(original.dtype))  # (B, T)
        rtd_labels = disc_ids != original  # False wherever the draw is the original token
        disc = self.discriminator(disc_ids, attention_mask, word_base=self._word_base(disc_ids))
        rtd_loss, rtd_correct, num_tokens = _rtd_loss(disc["logits"], rtd_labels, keep)
        num_targets = gen["num_targets"]
        num_replaced = rtd_labels.sum()
        per_target = num_targets.clamp(min=1).float()
        loss, sop = gen["loss"] + self.rtd_weight * rtd_loss, {}
        if "sop_logits" in disc:
            loss, sop = sop_outputs(loss, disc["sop_logits"], sop_labels)
            sop["sop_logits"] = disc["sop_logits"].detach()
        return {
            "loss": loss,
            "mlm_loss": gen["loss"],
            "rtd_loss": rtd_loss,
            "rtd_accuracy": rtd_correct.float() / num_tokens.clamp(min=1).float(),
            "replaced_fraction": num_replaced.float() / per_target,
            "generator_accuracy": gen["correct"].float() / per_target,
            "num_targets": num_targets,
            "num_tokens": num_tokens,
            "num_replaced": num_replaced,
            "generator_correct": gen["correct"],
            "rtd_correct": rtd_correct,
            "rtd_logits": disc["logits"].detach(),
            "rtd_labels": rtd_labels,
            "discriminator_input_ids": disc_ids,
            **sop,
        }

    def discriminator_state_dict(self, with_head: bool = False) -> dict[str, torch.Tensor]:
        """The discriminator for fine-tuning/export: `DebertaModel` keys (E_G + E_delta merged under GDES);
        with_head: `deberta.*` + `mask_predictions.*` instead (the HF hub deberta-v3 layout; what
        `deberta.checkpoint.save` / `load_into` take). Call on an unsharded module, or use
        `discriminator_weights` on a consolidated state dict."""
        return discriminator_weights(self.state_dict(), self.embedding_sharing, with_head)

    def generator_state_dict(self) -> dict[str, torch.Tensor]:
        """The generator: loads into `DebertaForMaskedLM(model.generator_cfg)`."""
        return generator_weights(self.state_dict())


def _require(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise ValueError(f"not an RTDPretrainer state dict: no {key!r}; pass RTDPretrainer.state_dict() or the "
                         f"consolidated (zero_to_fp32) state of a DeepSpeed engine around one")
    return state[key]


def discriminator_weights(
    state: Mapping[str, torch.Tensor], embedding_sharing: str, with_head: bool = False
) -> dict[str, torch.Tensor]:
    """An RTDPretrainer state dict (module or consolidated ZeRO checkpoint) -> the discriminator's weights."""
    if embedding_sharing not in EMBEDDING_SHARING:
        raise ValueError(f"discriminator_weights: embedding_sharing={embedding_sharing!r}; "
                         f"choose one of {EMBEDDING_SHARING}")
    out = {k[len(DISCRIMINATOR_PREFIX):]: v for k, v in state.items() if k.startswith(DISCRIMINATOR_PREFIX)}
    gen_table = _require(state, GENERATOR_PREFIX + "deberta." + WORD_TABLE)
    if embedding_sharing == "es":  # the one table (a consolidation may keep only one of its two names)
        out[WORD_TABLE] = gen_table
    else:
        table = _require(state, DISCRIMINATOR_PREFIX + WORD_TABLE)
        if embedding_sharing == "gdes":  # E_D = E_G + E_delta, summed in fp32 whatever the stored dtype
            out[WORD_TABLE] = (gen_table.detach().float() + table.detach().float()).to(table.dtype)
    if not with_head:
        return out
    head = {"mask_predictions." + k[len(HEAD_PREFIX):]: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
    return {**{"deberta." + k: v for k, v in out.items()}, **head}


def generator_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An RTDPretrainer state dict -> the generator's `DebertaForMaskedLM` weights (E_G as trained by L_MLM)."""
    _require(state, GENERATOR_PREFIX + "deberta." + WORD_TABLE)
    return {k[len(GENERATOR_PREFIX):]: v for k, v in state.items() if k.startswith(GENERATOR_PREFIX)}
