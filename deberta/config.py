"""The model's configuration, and `debug()`, the CPU-sized shape of the tests and of the debug preset.

`DebertaConfig` is also the pipeline's `[model]` section (`core.config.PipelineConfig.model`): one class, one set of
fields, one validation, whether a model is built in a notebook or from the command line. It imports nothing but the
standard library, so the command line reads it without loading torch.

The field names follow `transformers.DebertaV2Config` wherever the concept exists there, so that
`deberta.hf` converts configurations field by field. Fields that HF spells differently (or encodes
as strings) are documented with their HF equivalent.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

ATTN_IMPLS = ("sdpa", "math", "fused")
SHARE_LAYERS = ("none", "all", "attention", "ffn")
"""Cross-layer parameter sharing (ALBERT §3.1 and its Table 5 ablation): one set of weights for every layer
("all"), for every layer's attention block only ("attention") or feed-forward block only ("ffn")."""
EMBEDDING_SHARING = ("gdes", "es", "nes")
"""Word embeddings of an RTD generator and discriminator (DeBERTaV3 §3.2-3.3, `deberta.rtd`): gradient-disentangled
("gdes"), one shared table ("es") or none shared ("nes"). Here, not in deberta.rtd, so the torch-free pipeline config
checks against the same tuple."""


class DebertaConfigError(ValueError):
    """A field of `DebertaConfig` out of range; the message names the fields (`fields`) and the fix.

    A plain ValueError subclass because this library is the bottom layer and imports nothing of the pipeline;
    `core.config` turns it into the ConfigError the command line prints, with the fields written as the pipeline
    spells them (`qualified("model")`: "model.hidden_size=65 ...").
    """

    def __init__(self, message: str, *fields: str):
        super().__init__(message)
        self.fields = fields

    def qualified(self, section: str) -> str:
        """The message with each named field written `section.field`."""
        return re.sub(rf"\b({'|'.join(self.fields)})(?==)", rf"{section}.\1", str(self))


def _require(ok: bool, message: str, *fields: str) -> None:
    if not ok:
        raise DebertaConfigError(message, *fields)


@dataclass(frozen=True)
class DebertaConfig:
    """Architecture of a DeBERTa backbone (post-LayerNorm transformer with disentangled attention).

    Checked as it is built (`check`), so a config that exists is a valid one. It follows the pipeline's section
    protocol (`core.config.Section`) without importing it: `check()`, `what()` (the fields hashed into artifact
    ids) and `HOW` (the fields that change how the model runs, not what it computes: `attn_impl`).
    """

    vocab_size: int
    """Rows of the word-embedding table (and columns of the LM head). Must be >= the tokenizer length;
    pad it up with `padded_vocab_size` (the reference 1.5B uses 128,100 rows for 128,001 tokens)."""

    hidden_size: int
    """Width H of every hidden state; also the width of the relative position table."""

    num_hidden_layers: int
    """Number of transformer layers L. The MLM's Enhanced Mask Decoder reuses the last one."""

    num_attention_heads: int
    """Heads per layer; head size d = hidden_size / num_attention_heads (64 in every preset)."""

    intermediate_size: int
    """Width of the feed-forward layer (4H in every preset)."""

    hidden_dropout_prob: float = 0.1
    """Dropout on hidden states (embedding output, attention and FFN outputs, conv output) and on the
    relative position table before each layer's projection."""

    attention_probs_dropout_prob: float = 0.1
    """Dropout on the attention probabilities."""

    max_position_embeddings: int = 512
    """Longest sequence; rows of the EMD's absolute position table (the backbone has no absolute table)."""

    position_buckets: int = 0
    """Number of log buckets for relative positions (256 for 1.5B); 0 = no buckets (HF: -1).
    With buckets, the attention span is position_buckets; |i-j| <= position_buckets/2 stays exact."""

    max_relative_positions: int = -1
    """Largest relative distance k (HF semantics): -1 means max_position_embeddings. Without buckets the
    attention span is k; with buckets it is the `max_position` of the log mapping."""

    share_att_key: bool = False
    """True (1.5B): position queries/keys reuse the content query/key projections, biases included.
    False (base/large): separate `pos_query_proj` / `pos_key_proj`."""

    conv_kernel_size: int = 0
    """Kernel of the convolution beside the first layer (3 for 1.5B); 0 = no convolution."""

    norm_rel_ebd: bool = True
    """Apply `encoder.LayerNorm` to the relative position table (HF: norm_rel_ebd="layer_norm")."""

    layer_norm_eps: float = 1e-7
    """Epsilon of every LayerNorm."""

    pad_token_id: int = 0
    """[PAD] id; its embedding row gets no gradient (HF `padding_idx`)."""

    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights (HF `_init_weights`)."""

    embedding_size: int = 0
    """Width E of the word-embedding table (ALBERT's factorised embedding, HF `embedding_size`); 0 = hidden_size
    (no factorisation; E == hidden_size builds the same model). E != hidden_size: a V x E table, projected to H by
    `embeddings.embed_proj` (E -> H, no bias, as HF) before the embedding LayerNorm, and an LM head that maps back
    to E (dense H -> E, LayerNorm over E) before the tied V x E decoder (ALBERT's and HF's legacy head)."""

    share_layers: str = "none"
    """Cross-layer parameter sharing (ALBERT): "none"; "all" (one layer run L times; the EMD's passes run it too);
    "attention" (every layer uses layer 0's attention block, LayerNorm included; own FFN); "ffn" (layer 0's
    feed-forward block, LayerNorm included; own attention). Same FLOPs, fewer parameters. HF DebertaV2 has no
    shared layers: an export must first copy the shared weights into every layer
    (`deberta.model.unshared_state_dict`)."""

    attn_impl: str = "sdpa"
    """"sdpa": c2p+p2c as an additive bias to torch's fused scaled_dot_product_attention;
    "math": the same equation written out (softmax(QK^T*s + bias) V), kept as the exact fallback; "fused": the
    disentangled-flash package's Triton kernels (CUDA only, `deberta.fused_attention`; the EMD's masked-position
    pass stays on sdpa)."""

    HOW: ClassVar[frozenset[str]] = frozenset({"attn_impl"})

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise DebertaConfigError naming the field and the fix."""
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings"):
            _require(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: must be >= 1", name)
        _require(self.hidden_size % self.num_attention_heads == 0,
                 f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}; "
                 f"pick heads so that hidden/heads is an integer", "hidden_size", "num_attention_heads")
        _require(self.position_buckets >= 0 and self.position_buckets % 2 == 0,
                 f"position_buckets={self.position_buckets}: must be 0 (no buckets) or a positive even number",
                 "position_buckets")
        _require(self.vocab_size > self.pad_token_id, f"vocab_size={self.vocab_size} must exceed "
                 f"pad_token_id={self.pad_token_id}", "vocab_size", "pad_token_id")
        _require(self.attn_impl in ATTN_IMPLS, f"attn_impl={self.attn_impl!r}; choose one of {ATTN_IMPLS}", "attn_impl")
        _require(self.embedding_size >= 0, f"embedding_size={self.embedding_size} must be >= 1, or 0 for hidden_size "
                                           f"(no factorised embedding; ALBERT uses 128)", "embedding_size")
        _require(self.share_layers in SHARE_LAYERS,
                 f"share_layers={self.share_layers!r}; choose one of {SHARE_LAYERS}", "share_layers")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            _require(0.0 <= getattr(self, name) < 1.0, f"{name}={getattr(self, name)}: must be in [0, 1)", name)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_dim(self) -> int:
        """E: the word-embedding width actually built (embedding_size, or hidden_size when 0)."""
        return self.embedding_size or self.hidden_size

    @property
    def factorised_embedding(self) -> bool:
        """True when E != H: the model has `embeddings.embed_proj` and an LM head that maps back to E."""
        return self.embedding_dim != self.hidden_size

    @property
    def max_relative(self) -> int:
        """k of the references: the relative distance range (or the log mapping's max position)."""
        return self.max_relative_positions if self.max_relative_positions > 0 else self.max_position_embeddings

    @property
    def att_span(self) -> int:
        """Span s of the relative table: it has 2s rows and r(i,j) is clamped to [0, 2s-1]."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative

    def replace(self, **changes) -> "DebertaConfig":
        """A copy with some fields changed (the config is frozen)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def what(self) -> dict[str, Any]:
        """The fields hashed into artifact ids: every field but the `HOW` ones."""
        return {k: v for k, v in self.to_dict().items() if k not in self.HOW}

    @classmethod
    def from_dict(cls, d: dict) -> "DebertaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"DebertaConfig.from_dict: unknown fields {unknown}; known fields are {sorted(names)}")
        return cls(**d)


def padded_vocab_size(tokenizer_len: int, multiple: int = 100) -> int:
    """Embedding rows for a tokenizer: the smallest multiple of `multiple` >= tokenizer_len.

    The reference pads 128,001 tokens to 128,100 rows; rows past the tokenizer are never looked up
    (multiple=128 is kinder to GPU matmul tiles, 100 reproduces the reference count).
    """
    if tokenizer_len < 1 or multiple < 1:
        raise ValueError(f"padded_vocab_size: tokenizer_len={tokenizer_len} and multiple={multiple} must be >= 1")
    return int(math.ceil(tokenizer_len / multiple) * multiple)


def debug(vocab_size: int = 1000, **overrides) -> DebertaConfig:
    """CPU-sized model shaped like the 1.5B (log buckets, shared keys, conv): 3 x 64, 2 heads of 32; the tests'
    model and the debug preset's (which pads `vocab_size` to its vocabulary).

    Buckets are scaled down with the sequence (16 buckets over 128 positions) so that short test sequences
    already exercise the log region of the bucket mapping.
    """
    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
        position_buckets=16,
        max_relative_positions=-1,
        share_att_key=True,
        conv_kernel_size=3,
    )
    return DebertaConfig(**{**base, **overrides})
