"""DeBERTa backbone and its two task models (SPEC.md "Model").

* `DebertaModel`: word embedding -> LayerNorm -> dropout (padding zeroed; no absolute positions),
  L post-LN layers of disentangled attention, one relative table with its LayerNorm, conv beside layer 1.
* `DebertaForMaskedLM`: the backbone's first L-1 layers, then the Enhanced Mask Decoder (the last layer
  run twice with shared weights, absolute positions added to the first query), then the tied LM head;
  queries only at MLM targets.
* `DebertaForSequenceClassification`: first-token pooler + task-layer dropout + linear head
  (one label = regression with MSE); no EMD. Accepts an `embedding_delta` for SiFT (`deberta.sift`).

Parameter names are those of HF `DebertaV2*` (`legacy=False` for the LM head), so `deberta.hf` converts
checkpoints with a copy loop. Distribution (FSDP/ZeRO, compile) is applied from outside.
"""

from __future__ import annotations

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
    """Word embedding -> (SiFT normalisation + delta) -> LayerNorm -> x mask -> dropout."""

    def __init__(self, cfg: DebertaConfig, sift: bool = False):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        # SiFT perturbs *normalised* embeddings; the clean pass must see the same normalisation
        self.sift = sift
        self.eps = cfg.layer_norm_eps

    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor | None, delta: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (B, T, H)
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


class DebertaLayer(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.attention = DebertaAttention(cfg)
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


class DebertaEncoder(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.cfg = cfg
        self.layer = nn.ModuleList(DebertaLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rel_embeddings = nn.Embedding(2 * cfg.att_span, cfg.hidden_size)
        if cfg.norm_rel_ebd:
            self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.conv = ConvLayer(cfg) if cfg.conv_kernel_size > 0 else None
        self.gradient_checkpointing = False
        """Recompute each layer in the backward pass (set from outside, like any distribution choice)."""

    def relative_context(self, key_len: int) -> RelativeContext:
        table = self.rel_embeddings.weight
        if self.cfg.norm_rel_ebd:
            table = self.LayerNorm(table)
        return RelativeContext.build(table, key_len, self.cfg)

    def forward(
        self, emb: torch.Tensor, mask: torch.Tensor | None, num_layers: int | None = None
    ) -> tuple[torch.Tensor, RelativeContext]:
        """emb (B, T, H), mask (B, T) bool or None -> (output of layer `num_layers` (default: all), rel)."""
        rel = self.relative_context(emb.shape[1])
        x = emb
        for i, layer in enumerate(self.layer[:num_layers]):
            if self.gradient_checkpointing and self.training:
                x_new = checkpoint(layer, x, mask, rel, use_reentrant=False)
            else:
                x_new = layer(x, mask, rel)
            if i == 0 and self.conv is not None:
                x_new = self.conv(emb, x_new, mask)
            x = x_new
        return x, rel


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
    ) -> tuple[torch.Tensor, torch.Tensor | None, RelativeContext]:
        """-> (hidden after `num_layers` layers (B, T, H), key mask (B, T) bool or None, relative context)."""
        mask = None if attention_mask is None else attention_mask.bool()
        if mask is not None and bool(mask.all()):
            mask = None  # nothing to mask (packed pretraining batches): skip the masked_fill in every layer
        emb = self.embeddings(input_ids, mask, embedding_delta)
        hidden, rel = self.encoder(emb, mask, num_layers)
        return hidden, mask, rel

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        embedding_delta: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        hidden, _, _ = self.encode(input_ids, attention_mask, embedding_delta=embedding_delta)
        return {"last_hidden_state": hidden}


class DebertaLMPredictionHead(nn.Module):
    """dense -> GELU -> LayerNorm -> tied word-embedding matmul + bias (HF `lm_predictions.lm_head`)."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        x = self.LayerNorm(F.gelu(self.dense(x)))
        return F.linear(x, word_embeddings, self.bias)  # (..., V)


class DebertaOnlyMLMHead(nn.Module):
    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.lm_head = DebertaLMPredictionHead(cfg)


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
    """MLM with the Enhanced Mask Decoder (paper §3.2, A.8).

    forward(input_ids, attention_mask, labels):
      labels given ((B, T), -100 = not a target): queries only at targets; returns loss (mean CE over
        targets), logits (M, V) in row-major target order, num_targets, correct (argmax == label count).
      labels None: EMD queries at every position; returns logits (B, T, V).
    Both EMD passes share the keys, values and p2c term (keys are the layer L-1 output both times), so
    in training they also share one dropout mask on the relative table; eval is exactly the reference.
    """

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.cfg = cfg
        self.deberta = DebertaModel(cfg, _init=False)
        self.lm_predictions = DebertaOnlyMLMHead(cfg)
        self.emd = EnhancedMaskDecoder(cfg)
        self.apply(lambda m: init_weights(m, cfg))

    def _decode(self, hidden, mask, rel, query_pos) -> torch.Tensor:
        """Two passes of the last layer; hidden (B, T, H) are keys/values, queries at query_pos (B, Mq)."""
        layer = self.deberta.encoder.layer[-1]
        b, _, h = hidden.shape
        idx = query_pos.unsqueeze(-1).expand(-1, -1, h)  # (B, Mq, H)
        query = torch.gather(hidden, 1, idx) + self.emd.position_embeddings(query_pos)  # (B, Mq, H)
        ks = layer.attention.self.prepare_keys(hidden, mask, rel)
        p2c = None
        for _ in range(2):
            query, p2c = layer.decode_pass(query, ks, rel, query_pos, p2c)
        return query

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        # H = output of layer L-1: the last layer is only ever run inside the EMD
        hidden, mask, rel = self.deberta.encode(input_ids, attention_mask, num_layers=self.cfg.num_hidden_layers - 1)
        word = self.deberta.embeddings.word_embeddings.weight
        head = self.lm_predictions.lm_head
        b, t = input_ids.shape
        if labels is None:
            query_pos = torch.arange(t, device=input_ids.device).expand(b, t)  # (T,) -> (B, T)
            return {"logits": head(self._decode(hidden, mask, rel, query_pos), word)}  # (B, T, V)
        targets = labels != IGNORE_INDEX
        query_pos, valid = target_layout(targets)
        out = self._decode(hidden, mask, rel, query_pos)[valid]  # (M, H)
        logits = head(out, word)  # (M, V)
        target_ids = labels[targets]  # (M,)
        if target_ids.numel():
            loss = F.cross_entropy(logits.float(), target_ids)
        else:
            loss = logits.sum()  # no targets: a zero that keeps the graph connected
        correct = (logits.detach().argmax(-1) == target_ids).sum()
        return {"loss": loss, "logits": logits, "num_targets": targets.sum(), "correct": correct}


class ContextPooler(nn.Module):
    """First-token pooler (HF `ContextPooler`): dropout -> dense -> GELU."""

    def __init__(self, cfg: DebertaConfig, dropout: float):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(self.dropout(hidden[:, 0])))  # (B, H)


class DebertaForSequenceClassification(nn.Module):
    """Sequence classification / regression (HF `DebertaV2ForSequenceClassification`).

    classifier_dropout: the Table 9 "task-layer dropout" before the classifier (HF `cls_dropout`).
    pooler_dropout: dropout inside the pooler (HF `pooler_dropout`, reference default 0).
    sift: normalise word embeddings before the embedding LayerNorm so `deberta.sift` can perturb them.
    num_labels == 1 means regression: logits (B, 1), loss = MSE against float labels.
    """

    def __init__(
        self,
        cfg: DebertaConfig,
        num_labels: int,
        classifier_dropout: float,
        pooler_dropout: float = 0.0,
        sift: bool = False,
    ):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"DebertaForSequenceClassification: num_labels={num_labels} must be >= 1 (1 = regression)")
        self.cfg = cfg
        self.num_labels = num_labels
        self.classifier_dropout = classifier_dropout
        self.pooler_dropout = pooler_dropout
        self.deberta = DebertaModel(cfg, sift=sift, _init=False)
        self.pooler = ContextPooler(cfg, pooler_dropout)
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self.apply(lambda m: init_weights(m, cfg))

    @property
    def regression(self) -> bool:
        return self.num_labels == 1

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        embedding_delta: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """embedding_delta (B, T, H): added to the normalised word embeddings (SiFT; needs sift=True)."""
        hidden, _, _ = self.deberta.encode(input_ids, attention_mask, embedding_delta=embedding_delta)
        logits = self.classifier(self.dropout(self.pooler(hidden)))  # (B, num_labels)
        out = {"logits": logits}
        if labels is not None:
            if self.regression:
                out["loss"] = F.mse_loss(logits.view(-1).float(), labels.view(-1).float())
            else:
                out["loss"] = F.cross_entropy(logits.float(), labels.view(-1).long())
        return out
