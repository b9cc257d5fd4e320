"""DeBERTa backbone and its pretraining model (DeBERTa §3; the 1.5B shape of §5.3); the fine-tuning heads are
`deberta.heads`.

* `DebertaModel`: word embedding (-> E x H projection when factorised) -> LayerNorm -> dropout (padding
  zeroed; no absolute positions), L post-LN layers of disentangled attention (optionally sharing weights
  across layers, ALBERT), one relative table with its LayerNorm, conv beside layer 1.
* `DebertaForMaskedLM`: the backbone's first L-1 layers, then the Enhanced Mask Decoder (the last layer
  run twice with shared weights, absolute positions added to the first query), then the tied LM head;
  queries only at MLM targets; optionally ALBERT's sentence-order head on the final [CLS] state (`sop=True`).

Parameter names are those of HF `DebertaV2*` (`legacy=False` for the LM head), so `deberta.hf` converts
checkpoints with a copy loop. Distribution (FSDP/ZeRO, compile) is applied from outside.

ALBERT's parameter reductions (ALBERT §3.1, `DebertaConfig.embedding_size` / `share_layers`):
* Factorised embedding: a V x E table and `embeddings.embed_proj` (E -> H, no bias) before the embedding
  LayerNorm, as HF `DebertaV2Embeddings` does (ALBERT itself projects after its LayerNorm, with a bias). The LM
  head maps back to E (dense H -> E, GELU, LayerNorm(E)) before the tied V x E decoder: ALBERT's head and HF's
  legacy one (`cls.predictions.transform.*`). HF's `legacy=False` head cannot run with E != H (its dense stays
  H -> H, and the matmul with the V x E table fails), so for E != H our `lm_predictions.lm_head.*` tensors
  correspond to HF's legacy names; for E == H the head is HF's `legacy=False` one.
* Shared layers: one module object per shared block, run at every depth, so its gradient is the sum over
  uses. "all": `encoder.layer` holds one layer; "attention"/"ffn": layer 0 owns the shared block and every
  other layer *borrows* it (an attribute outside the module tree: each parameter has one name, the state dict
  no duplicates, and `init_weights` / ZeRO-3 / `.to()` visit it once, through layer 0).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from deberta.attention import DisentangledSelfAttention, KeyState, RelativeContext
from deberta.config import DebertaConfig

IGNORE_INDEX = -100


def init_weights(module: nn.Module, cfg: DebertaConfig) -> None:
    """HF `_init_weights`: N(0, initializer_range) weights, zero biases, zero [PAD] row, unit LayerNorms."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=cfg.initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=cfg.initializer_range)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class DebertaEmbeddings(nn.Module):
    """Word embedding (V x E) -> embed_proj (E -> H, if E != H) -> (SiFT normalisation + delta) -> LayerNorm
    -> x mask -> dropout."""

    def __init__(self, cfg: DebertaConfig, sift: bool = False):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.embedding_dim, padding_idx=cfg.pad_token_id)
        # HF DebertaV2Embeddings' name and layout: Linear(E, H) without bias, only when E != H
        e, h = cfg.embedding_dim, cfg.hidden_size
        self.embed_proj = nn.Linear(e, h, bias=False) if cfg.factorised_embedding else None
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        # SiFT perturbs *normalised* embeddings; the clean pass must see the same normalisation
        self.sift = sift
        self.eps = cfg.layer_norm_eps

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        delta: torch.Tensor | None = None,
        word_base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (B, T, E)
        if word_base is not None:
            # GDES (`deberta.rtd`): rows of another, detached table; this table holds only the residual
            x = x + word_base.to(x.dtype)
        if self.embed_proj is not None:
            x = self.embed_proj(x)  # (B, T, E) -> (B, T, H)
        if self.sift:
            x = F.layer_norm(x, x.shape[-1:], eps=self.eps)  # no affine: the reference PerturbationLayer
            if delta is not None:
                x = x + delta.to(x.dtype)
        elif delta is not None:
            raise ValueError("embedding_delta needs a model built with sift=True (the clean pass must be normalised too)")
        x = self.LayerNorm(x)
        if mask is not None:
            x = x * mask.unsqueeze(-1).to(x.dtype)
        return self.dropout(x)


class DebertaSelfOutput(nn.Module):
    """Attention output projection; post-LN residual on the *query* states (matters for the EMD)."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class DebertaAttention(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.self = DisentangledSelfAttention(cfg)
        self.output = DebertaSelfOutput(cfg)


class DebertaIntermediate(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class DebertaOutput(nn.Module):
    """FFN output projection, post-LN residual on the attention output."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


def _borrow(module: nn.Module, name: str, block: nn.Module) -> None:
    """Use another layer's block as `module.<name>` without registering it here (it has one owner: layer 0)."""
    object.__setattr__(module, name, block)  # nn.Module.__setattr__ would register it a second time


class DebertaLayer(nn.Module):
    """Attention block (`attention`), then feed-forward block (`intermediate` + `output`), both post-LN.

    shared_with: layer 0 of an encoder with cfg.share_layers "attention" or "ffn"; this layer borrows that
    block from it (one module object for every depth) and builds only the other one.
    """

    def __init__(self, cfg: DebertaConfig, shared_with: "DebertaLayer | None" = None):
        super().__init__()
        share = cfg.share_layers if shared_with is not None else "none"
        if share == "attention":
            _borrow(self, "attention", shared_with.attention)
        else:
            self.attention = DebertaAttention(cfg)
        if share == "ffn":
            _borrow(self, "intermediate", shared_with.intermediate)
            _borrow(self, "output", shared_with.output)
        else:
            self.intermediate = DebertaIntermediate(cfg)
            self.output = DebertaOutput(cfg)

    def _finish(self, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        attn_out = self.attention.output(context, residual)
        return self.output(self.intermediate(attn_out), attn_out)

    def forward(
        self,
        hidden: torch.Tensor,
        key_mask: torch.Tensor | None,
        rel: RelativeContext,
        query_states: torch.Tensor | None = None,
        query_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        context = self.attention.self(hidden, key_mask, rel, query_states, query_pos)
        return self._finish(context, hidden if query_states is None else query_states)

    def decode_pass(
        self,
        query: torch.Tensor,
        ks: KeyState,
        rel: RelativeContext,
        query_pos: torch.Tensor,
        p2c: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One EMD pass: queries (B, Mq, H) at query_pos against prepared keys; returns (out, p2c)."""
        att = self.attention.self
        q = att._heads(att.query_proj(query))  # (B, nh, Mq, d)
        bias, p2c = att.relative_bias(q, ks, rel, query_pos, p2c)
        return self._finish(att.attend(q, ks, bias), query), p2c


class ConvLayer(nn.Module):
    """Conv1d beside the first layer (1.5B): out = LN(layer1_out + GELU(dropout(conv(emb)))) * mask."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        k = cfg.conv_kernel_size
        self.conv = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, k, padding=(k - 1) // 2)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, emb: torch.Tensor, layer_out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = self.conv(emb.transpose(1, 2)).transpose(1, 2)  # (B, T, H) -> (B, H, T) -> (B, T, H)
        if mask is not None:
            out = out.masked_fill(~mask.unsqueeze(-1), 0.0)
        out = self.LayerNorm(layer_out + F.gelu(self.dropout(out)))
        return out if mask is None else out * mask.unsqueeze(-1).to(out.dtype)


def _build_layers(cfg: DebertaConfig) -> nn.ModuleList:
    """The layers that own parameters: one for share_layers="all" (run at every depth), else L."""
    first = DebertaLayer(cfg)
    if cfg.share_layers == "all":
        return nn.ModuleList([first])
    lender = first if cfg.share_layers != "none" else None
    return nn.ModuleList([first] + [DebertaLayer(cfg, shared_with=lender) for _ in range(cfg.num_hidden_layers - 1)])


class DebertaEncoder(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.cfg = cfg
        self.layer = _build_layers(cfg)
        self.rel_embeddings = nn.Embedding(2 * cfg.att_span, cfg.hidden_size)
        if cfg.norm_rel_ebd:
            self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.conv = ConvLayer(cfg) if cfg.conv_kernel_size > 0 else None
        self.gradient_checkpointing: int = 0
        """K: recompute layers 0, K, 2K, ... in the backward pass, keeping only their inputs (1 or True: every
        layer; 0 or False: none). Set from outside, like any distribution choice (`set_activation_checkpointing`)."""
        self.compiled_layers = False
        """Its layers are `torch.compile`d (`compile_layers`, set from outside): the key mask then reaches them even
        when every token is real, so a batch with padding runs the same graph as one without."""

    def layer_at(self, depth: int) -> DebertaLayer:
        """The layer run at `depth` (0-based); with share_layers="all" the one layer at every depth."""
        return self.layer[0 if self.cfg.share_layers == "all" else depth]

    @property
    def last_layer(self) -> DebertaLayer:
        """The layer at depth L-1: the one the EMD runs twice."""
        return self.layer_at(self.cfg.num_hidden_layers - 1)

    def relative_context(self, key_len: int) -> RelativeContext:
        table = self.rel_embeddings.weight
        if self.cfg.norm_rel_ebd:
            table = self.LayerNorm(table)
        return RelativeContext.build(table, key_len, self.cfg)

    def forward(
        self, emb: torch.Tensor, mask: torch.Tensor | None, num_layers: int | None = None
    ) -> tuple[torch.Tensor, RelativeContext]:
        """emb (B, T, H), mask (B, T) bool, (B, 1, T, T) bool (`document_mask`) or None
        -> (output of layer `num_layers` (default: all), rel)."""
        rel = self.relative_context(emb.shape[1])
        x = emb
        for i in range(self.cfg.num_hidden_layers)[:num_layers]:
            layer = self.layer_at(i)
            if self.training and self.gradient_checkpointing and i % int(self.gradient_checkpointing) == 0:
                # non-reentrant: works with ZeRO-3's parameter hooks and compile; the RNG state of the first run is
                # restored for the recomputation, so dropout draws the same masks and the step is unchanged
                x_new = checkpoint(layer, x, mask, rel, use_reentrant=False, preserve_rng_state=True)
            else:
                x_new = layer(x, mask, rel)
            if i == 0 and self.conv is not None:
                # a document mask's diagonal is the key mask (a token attends to itself unless it is padding)
                key_mask = mask if mask is None or mask.dim() == 2 else mask[:, 0].diagonal(dim1=-2, dim2=-1)
                x_new = self.conv(emb, x_new, key_mask)
            x = x_new
        return x, rel


def set_activation_checkpointing(model: nn.Module, every: int) -> int:
    """Every encoder in `model` (MLM, RTD's generator and discriminator, a fine-tuning head's backbone) recomputes
    layers 0, `every`, 2 `every`, ... in its backward pass (0: none). Returns the encoders set. The EMD's two passes
    of the last layer and the heads keep their activations: they run on the masked positions only."""
    encoders = [m for m in model.modules() if isinstance(m, DebertaEncoder)]
    for encoder in encoders:
        encoder.gradient_checkpointing = every
    return len(encoders)


def compile_layers(model: nn.Module, **options) -> int:
    """`torch.compile` every encoder layer of `model` in place (the MLM, RTD's generator and discriminator, a
    fine-tuning head's backbone); returns the layers compiled. Parameter names do not change.

    Regional compilation, as torchtitan compiles each transformer block: a layer's shapes are fixed for a run
    ((B, T, H) in, the same out), so its graph compiles once per mode (train, eval) and every layer of an encoder
    runs it. What stays eager has shapes that depend on the data: the MLM targets' layout (`target_layout`, whose
    count varies per batch), the EMD's two passes and the head over those targets, and `encode`'s check for a batch
    without padding. Compiling the whole model breaks its graph at each of them and recompiles as the counts vary.
    `options`: `torch.compile`'s (e.g. `backend`)."""
    encoders = [m for m in model.modules() if isinstance(m, DebertaEncoder)]
    layers = {id(layer): layer for encoder in encoders for layer in encoder.layer}
    for encoder in encoders:
        encoder.compiled_layers = True
    for layer in layers.values():
        layer.compile(**options)
    return len(layers)


def document_mask(document_ids: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T) document index of each token of a packed row -> (B, 1, T, T) bool, True where query i may attend
    key j: same document (and j a real token). Built once per forward and broadcast over heads by SDPA; relative
    positions i - j inside a document are those of the document alone, so its states are the same as unpacked
    (with position_biased_input=False and no conv layer: both mix positions across the row)."""
    allowed = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :]
    return allowed.unsqueeze(1)


def _query_rows(mask: torch.Tensor | None, query_pos: torch.Tensor) -> torch.Tensor | None:
    """A (B, 1, T, T) document mask -> its rows at query_pos (B, Mq): (B, 1, Mq, T); a key mask passes through."""
    if mask is None or mask.dim() == 2:
        return mask
    idx = query_pos[:, None, :, None].expand(-1, 1, -1, mask.shape[-1])
    return torch.gather(mask, 2, idx)


class DebertaModel(nn.Module):
    """The backbone (HF `DebertaV2Model`): returns {"last_hidden_state": (B, T, H)}."""

    def __init__(self, cfg: DebertaConfig, sift: bool = False, _init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embeddings = DebertaEmbeddings(cfg, sift=sift)
        self.encoder = DebertaEncoder(cfg)
        if _init:
            self.apply(lambda m: init_weights(m, cfg))

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_layers: int | None = None,
        embedding_delta: torch.Tensor | None = None,
        word_base: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, RelativeContext]:
        """-> (hidden after `num_layers` layers (B, T, H), attention mask, relative context).

        The attention mask is the key mask (B, T) bool or None, or with document_ids (B, T) (the document each
        token of a packed row belongs to) the block-diagonal (B, 1, T, T) bool mask `document_mask` builds.

        word_base (B, T, E): added to the word-embedding lookup, before embed_proj and the LayerNorm (GDES,
        `deberta.rtd`).
        """
        mask = None if attention_mask is None else attention_mask.bool()
        if mask is not None and not self.encoder.compiled_layers and bool(mask.all()):
            mask = None  # nothing to mask (packed pretraining batches): skip the masked_fill in every layer
        emb = self.embeddings(input_ids, mask, embedding_delta, word_base)
        attn_mask = mask if document_ids is None else document_mask(document_ids, mask)
        hidden, rel = self.encoder(emb, attn_mask, num_layers)
        return hidden, attn_mask, rel

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        embedding_delta: torch.Tensor | None = None,
        word_base: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        hidden, _, _ = self.encode(input_ids, attention_mask, embedding_delta=embedding_delta, word_base=word_base,
                                   document_ids=document_ids)
        return {"last_hidden_state": hidden}


class DebertaLMPredictionHead(nn.Module):
    """dense -> GELU -> LayerNorm -> tied word-embedding matmul + bias (HF `lm_predictions.lm_head`).

    With a factorised embedding (E != H) the dense maps H -> E and the LayerNorm is over E, so the tied decoder
    is the V x E table itself: ALBERT's `cls/predictions/transform` and HF's legacy `cls.predictions.transform`
    (HF's legacy=False head keeps H -> H and cannot multiply by a V x E table). For E == H nothing changes.
    """

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.embedding_dim)
        self.LayerNorm = nn.LayerNorm(cfg.embedding_dim, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        x = self.LayerNorm(F.gelu(self.dense(x)))  # (..., H) -> (..., E)
        return F.linear(x, word_embeddings, self.bias)  # (..., V)


class DebertaOnlyMLMHead(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.lm_head = DebertaLMPredictionHead(cfg)


class SentenceOrderHead(nn.Module):
    """ALBERT's sentence-order prediction (SOP) head on the final [CLS] state: pooler (dense H -> H, tanh: ALBERT's
    `bert/pooler`) -> dropout (hidden_dropout_prob, as HF `AlbertSOPHead`) -> classifier (H -> 2 logits, softmax
    cross-entropy as ALBERT's `cls/seq_relationship`; class 1 = swapped, 0 = in order).

    ALBERT's head rather than DeBERTa's `ContextPooler` (GELU): SOP is ALBERT's objective and the head is a
    pretraining-only part (fine-tuning builds its own pooler), so its reference form is the one to reproduce.
    """

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.classifier = nn.Linear(cfg.hidden_size, 2)

    def forward(self, cls_state: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(torch.tanh(self.dense(cls_state))))  # (B, H) -> (B, 2)


def sop_outputs(
    loss: torch.Tensor, sop_logits: torch.Tensor, sop_labels: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the SOP loss to `loss` (the main objective's): -> (loss + sop_loss, {sop_loss, sop_correct, sop_count}).

    sop_logits (B, 2); sop_labels (B,): 1 = segments swapped, 0 = in order, -100 = no pair in this row (ignored).
    sop_loss is the mean cross-entropy over the counted rows (0 when none); sop_correct / sop_count are counts,
    so the loop can sum them over workers for an accuracy. sop_labels None: no SOP term, but the head stays in
    the graph at zero weight, so every parameter still gets a gradient (as DDP and ZeRO's buckets expect).
    """
    if sop_labels is None:
        return loss + 0.0 * sop_logits.sum(), {}
    if sop_labels.shape != sop_logits.shape[:1]:
        raise ValueError(f"sop_labels has shape {tuple(sop_labels.shape)}; need ({sop_logits.shape[0]},): one label "
                         f"per sequence, 1 = swapped, 0 = in order, -100 = no pair")
    counted = sop_labels != IGNORE_INDEX
    count = counted.sum()
    sop_loss = F.cross_entropy(sop_logits.float(), sop_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    sop_loss = sop_loss / count.clamp(min=1)
    correct = ((sop_logits.detach().argmax(-1) == sop_labels) & counted).sum()
    return loss + sop_loss, {"sop_loss": sop_loss, "sop_correct": correct, "sop_count": count}


class EnhancedMaskDecoder(nn.Module):
    """Holds the EMD's absolute position table (raw lookup: no LayerNorm, no dropout). HF has no place
    for it, so it lives only in our checkpoints; the decoder layer itself is the encoder's last layer."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)


def target_layout(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """targets (B, T) bool -> (query_pos (B, Mq) target positions left-aligned, valid (B, Mq) bool).

    Mq = most targets in one row; the valid slots, read row-major, list the targets in the same order
    as `labels[targets]`. Invalid slots point at position 0 and are computed then dropped.
    """
    counts = targets.sum(dim=1)  # (B,)
    mq = int(counts.max()) if targets.numel() else 0
    # stable sort of ~targets puts each row's target positions first, in increasing order
    order = torch.sort((~targets).to(torch.int8), dim=1, stable=True).indices[:, :mq]  # (B, Mq)
    valid = torch.arange(mq, device=targets.device)[None, :] < counts[:, None]  # (B, Mq)
    return torch.where(valid, order, torch.zeros_like(order)), valid


class DebertaForMaskedLM(nn.Module):
    """MLM with the Enhanced Mask Decoder (DeBERTa §3.2, A.8), optionally with ALBERT's SOP head (`sop=True`).

    forward(input_ids, attention_mask, labels, sop_labels):
      labels given ((B, T), -100 = not a target): queries only at targets; returns loss (mean CE over
        targets), logits (M, V) in row-major target order, num_targets, correct (argmax == label count).
      labels None: EMD queries at every position; returns logits (B, T, V).
      sop=True: also sop_logits (B, 2) from the backbone's final [CLS] state; with sop_labels ((B,), 1 = swapped,
        0 = in order, -100 = no pair) loss = MLM loss + SOP loss, plus mlm_loss, sop_loss, sop_correct, sop_count.
    Both EMD passes share the keys, values and p2c term (keys are the layer L-1 output both times), so
    in training they also share one dropout mask on the relative table; eval is exactly the reference.
    The [CLS] state is the last layer once more, one query at position 0 against the same keys: what the
    backbone's last layer gives there (the EMD never computes it), at the cost of one query per sequence.

    emd=False: no EMD (and no position table); the head reads the backbone's last layer, as HF's
    DebertaV2ForMaskedLM does. forward(use_emd=False) computes that on a model that has one (the EMD's table and
    second pass left out): what `transformers` computes for the same weights.
    """

    def __init__(self, cfg: DebertaConfig, sop: bool = False, emd: bool = True):
        super().__init__()
        self.cfg = cfg
        self.deberta = DebertaModel(cfg, _init=False)
        self.lm_predictions = DebertaOnlyMLMHead(cfg)
        self.emd = EnhancedMaskDecoder(cfg) if emd else None
        self.sop_head = SentenceOrderHead(cfg) if sop else None
        self.apply(lambda m: init_weights(m, cfg))

    def _forward_without_emd(self, input_ids, attention_mask, labels, document_ids=None) -> dict[str, torch.Tensor]:
        """All L layers, then the head: HF DebertaV2ForMaskedLM's computation."""
        hidden, _, _ = self.deberta.encode(input_ids, attention_mask, document_ids=document_ids)  # (B, T, H)
        word = self.deberta.embeddings.word_embeddings.weight
        if labels is None:
            out = {"logits": self.lm_predictions.lm_head(hidden, word)}  # (B, T, V)
        else:
            targets = labels != IGNORE_INDEX
            logits = self.lm_predictions.lm_head(hidden[targets], word)  # (M, V), row-major target order
            target_ids = labels[targets]
            loss = F.cross_entropy(logits.float(), target_ids) if target_ids.numel() else logits.sum()
            out = {"loss": loss, "logits": logits, "num_targets": targets.sum(),
                   "correct": (logits.detach().argmax(-1) == target_ids).sum()}
        out["cls_state"] = hidden[:, 0]
        return out

    def _decode(self, hidden, ks: KeyState, rel, query_pos) -> torch.Tensor:
        """Two passes of the last layer; hidden (B, T, H) are keys/values, queries at query_pos (B, Mq)."""
        layer = self.deberta.encoder.last_layer
        h = hidden.shape[-1]
        idx = query_pos.unsqueeze(-1).expand(-1, -1, h)  # (B, Mq, H)
        query = torch.gather(hidden, 1, idx) + self.emd.position_embeddings(query_pos)  # (B, Mq, H)
        p2c = None
        ks = dataclasses.replace(ks, key_mask=_query_rows(ks.key_mask, query_pos))
        for _ in range(2):
            query, p2c = layer.decode_pass(query, ks, rel, query_pos, p2c)
        return query

    def _cls_state(self, hidden: torch.Tensor, ks: KeyState, rel: RelativeContext) -> torch.Tensor:
        """The backbone's last-layer state at [CLS] (B, H): the last layer, query hidden[:, 0] at position 0."""
        layer = self.deberta.encoder.last_layer
        pos0 = torch.zeros(hidden.shape[0], 1, dtype=torch.long, device=hidden.device)  # (B, 1)
        rows = rel.rows_for(pos0[:1], self.cfg)[0, 0]  # (Tk,): table row (minus lo) of r(0, j)
        # p2c[0, j] = Kc_j . Qr[r(0, j)] as Tk dot products, not relative_bias's (Tk x R) product
        p2c = torch.einsum("bhjd,hjd->bhj", ks.k, ks.pos_q[:, rows]).unsqueeze(2)  # (B, nh, 1, Tk)
        ks = dataclasses.replace(ks, key_mask=_query_rows(ks.key_mask, pos0))
        out, _ = layer.decode_pass(hidden[:, :1], ks, rel, pos0, p2c)
        return out[:, 0]  # (B, 1, H) -> (B, H)

    def _mlm(self, hidden, ks: KeyState, rel, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        word = self.deberta.embeddings.word_embeddings.weight
        targets = labels != IGNORE_INDEX
        query_pos, valid = target_layout(targets)
        out = self._decode(hidden, ks, rel, query_pos)[valid]  # (M, H)
        logits = self.lm_predictions.lm_head(out, word)  # (M, V)
        target_ids = labels[targets]  # (M,)
        if target_ids.numel():
            loss = F.cross_entropy(logits.float(), target_ids)
        else:
            loss = logits.sum()  # no targets: a zero that keeps the graph connected
        correct = (logits.detach().argmax(-1) == target_ids).sum()
        return {"loss": loss, "logits": logits, "num_targets": targets.sum(), "correct": correct}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        sop_labels: torch.Tensor | None = None,
        use_emd: bool = True,
        document_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        if sop_labels is not None and self.sop_head is None:
            raise ValueError("DebertaForMaskedLM: sop_labels given, but the model has no sentence-order head; "
                             "build it with DebertaForMaskedLM(cfg, sop=True)")
        if self.emd is None or not use_emd:
            out = self._forward_without_emd(input_ids, attention_mask, labels, document_ids)
            cls_state = out.pop("cls_state")
            return out if self.sop_head is None else self._with_sop(out, cls_state, labels, sop_labels)
        # H = output of layer L-1: the last layer is only ever run inside the EMD (and for [CLS])
        hidden, mask, rel = self.deberta.encode(input_ids, attention_mask, num_layers=self.cfg.num_hidden_layers - 1,
                                                document_ids=document_ids)
        ks = self.deberta.encoder.last_layer.attention.self.prepare_keys(hidden, mask, rel)
        if labels is None:
            b, t = input_ids.shape
            query_pos = torch.arange(t, device=input_ids.device).expand(b, t)  # (T,) -> (B, T)
            word = self.deberta.embeddings.word_embeddings.weight
            logits = self.lm_predictions.lm_head(self._decode(hidden, ks, rel, query_pos), word)  # (B, T, V)
            out = {"logits": logits}
        else:
            out = self._mlm(hidden, ks, rel, labels)
        if self.sop_head is None:
            return out
        return self._with_sop(out, self._cls_state(hidden, ks, rel), labels, sop_labels)

    def _with_sop(self, out: dict[str, torch.Tensor], cls_state: torch.Tensor, labels, sop_labels):
        """ALBERT's SOP on the final [CLS] state (B, H): its logits, and with labels its loss added to the MLM's."""
        sop_logits = self.sop_head(cls_state)  # (B, 2)
        out["sop_logits"] = sop_logits
        if labels is None:  # no MLM loss to add to: the SOP metrics alone, if asked for
            if sop_labels is not None:
                out.update(sop_outputs(sop_logits.new_zeros(()), sop_logits, sop_labels)[1])
            return out
        mlm_loss = out["loss"]
        out["loss"], sop = sop_outputs(mlm_loss, sop_logits, sop_labels)
        out.update(sop, mlm_loss=mlm_loss)
        return out


_LAYER_KEY = re.compile(r"^(.*encoder\.layer\.)0\.(.+)$")
_SHARED_PARTS = {"all": ("",), "attention": ("attention.",), "ffn": ("intermediate.", "output.")}


def unshared_state_dict(state: Mapping[str, torch.Tensor], cfg: DebertaConfig) -> dict[str, torch.Tensor]:
    """The state dict of a model of `cfg` (one backbone: `DebertaModel`, `DebertaForMaskedLM`, a classifier) with
    shared layers -> the same model's with `share_layers="none"`: every layer gets the shared weights under its
    own names (the same tensor each time: `load_state_dict` copies; clone before saving with safetensors).
    The result computes the same outputs, so this is how a shared model reaches a format without sharing (HF)."""
    if cfg.share_layers == "none":
        return dict(state)
    parts = _SHARED_PARTS[cfg.share_layers]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _LAYER_KEY.match(name)
        if match is None or not match.group(2).startswith(parts):
            out[name] = tensor
            continue
        for depth in range(cfg.num_hidden_layers):
            out[f"{match.group(1)}{depth}.{match.group(2)}"] = tensor
    return out


def num_parameters(cfg: DebertaConfig, model: str = "backbone") -> int:
    """Parameter count, computed by building the model on the meta device (no memory is allocated).

    model: "backbone" (`DebertaModel`, comparable to `transformers.DebertaV2Model`), "mlm"
    (`DebertaForMaskedLM`: + LM head + the EMD's absolute position table; the decoder is tied) or "mlm_sop"
    (the same with ALBERT's sentence-order head). Shared layers (`share_layers`) count once; a fine-tuning head
    adds `deberta.heads.head_parameters`.
    """
    builders = {
        "backbone": lambda: DebertaModel(cfg),
        "mlm": lambda: DebertaForMaskedLM(cfg),
        "mlm_sop": lambda: DebertaForMaskedLM(cfg, sop=True),
    }
    if model not in builders:
        raise ValueError(f"num_parameters: model={model!r}; choose one of {sorted(builders)}")
    with torch.device("meta"):
        module = builders[model]()
    # parameters() already de-duplicates tied tensors (the LM decoder is the word embedding, shared layers)
    return sum(p.numel() for p in module.parameters())
