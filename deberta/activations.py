"""Activation memory of one training micro-batch: what autograd keeps for the backward pass, counted from the
model's shape, in bytes. The memory plan (`--dry-run`) adds it to DeepSpeed's model-state estimates; the derivation
and its measured check are in docs/pretraining.md ("Memory plan").

Derived like Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1: a
standard layer keeps 34·s·b·h + 5·a·s²·b bytes in 16-bit with 1-byte dropout masks), but tensor by tensor from what
`deberta.model` and `deberta.attention` actually save (read off `torch.autograd.graph.saved_tensors_hooks`).
With s = sequence length, b = micro-batch, h = hidden, f = FFN width, a = heads, R = reachable relative rows
(`deberta.flops.reachable_rows`), e = bytes per value, m = bytes per dropout-mask element, one layer keeps:

  the layer's input (kept by the Q/K/V projections), Q and K (by the c2p/p2c products),
  V, the inputs of the output projection, the FFN and the two LayerNorms      8·s·b·h·e  (+ 2·s·b·h·e on CPU:
                                                                                     SDPA math's scaled Q and K)
  GELU's input and output                                     2·s·b·f·e
  two hidden dropout masks                                    2·s·b·h·m
  c2p (Qc·Krᵀ) and p2c (Kc·Qrᵀ), (b, a, s, R) each:
    torch's gather keeps its whole input for the backward     2·a·s·R·b·e   <- DeBERTa's own
  scores: CPU (SDPA's math path): softmax, dropout mask,
    dropout output                                            a·s²·b·(2e + m)
          CUDA (SDPA's memory-efficient kernel, which recomputes the
    softmax): the additive c2p + p2c bias it reads            a·s²·b·e

A checkpointed layer keeps only its input (s·b·h·e) and is recomputed, whole, during its backward. The EMD runs the
last layer twice on the Mq = ⌈f_mask·s⌉ target queries against the L-1 layer's keys (keys, values and p2c once;
per pass the query-side tensors, Mq x s scores and an Mq x R c2p); the MLM head keeps (M, h) and (M, E) inputs
and the fp32 log-softmax of its (M, V) logits; the (M, V) logits themselves the step returns and holds through
its backward pass, M = f_mask·s·b targets. The peak (`Activations.total`) is the largest of three moments:
  the head's backward      everything kept + two (M, V) fp32 gradients (of the log-softmax and of the logits)
  the LM decoder's         everything kept + the logits' gradient + the tied word embedding's V x E gradient,
                           which autograd then holds until the embedding's own share arrives (constant in the
                           micro-batch)
  a layer's, deeper down   the encoder's kept part + the held logits + the tied gradient + one layer's backward
                           working set: its score and gathered-product gradients (`working_bytes`); for a
                           checkpointed layer, the layer recomputed whole plus the larger of its first gradient
                           (the FFN's, s·b·f) and those score gradients less what the FFN's and the output
                           projection's backward freed before them (`recomputed_working_bytes`).
matmul's broadcast of the (a, R, d) position tables over the batch adds a (b, R, h) copy per c2p and p2c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deberta.config import DebertaConfig
from deberta.flops import reachable_rows

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Shape:
    """What the count depends on besides the model: tokens per sequence, sequences per micro-batch, arithmetic."""

    seq_len: int
    micro: int
    value_bytes: int = 2
    """4 for fp32, 2 for bf16 (DeepSpeed's bf16 or autocast)."""
    device: str = "cuda"
    """"cuda": SDPA's memory-efficient kernel, 1-byte dropout masks; "cpu": SDPA's math path, dropout masks of
    value_bytes (torch's CPU dropout multiplies by a mask of the input's dtype)."""

    @property
    def mask_bytes(self) -> int:
        return 1 if self.device == "cuda" else self.value_bytes


def key_bytes(cfg: DebertaConfig, shape: Shape) -> int:
    """A layer's key side: its input (kept by the K and V projections), K, V, the (b, a, s, R) p2c product and the
    (b, R, h) copy of the position queries that matmul's broadcast over the batch makes."""
    s, b, e, r, h = shape.seq_len, shape.micro, shape.value_bytes, reachable_rows(cfg, shape.seq_len), cfg.hidden_size
    return 3 * s * b * h * e + cfg.num_attention_heads * s * r * b * e + b * r * h * e


def query_bytes(cfg: DebertaConfig, shape: Shape, queries: int) -> int:
    """A layer's query side at `queries` positions: Q, the output projection's input, both LayerNorms' inputs, the
    FFN's input, GELU's input and output, two dropout masks, the (b, a, q, R) c2p product (and the broadcast copy of
    the position keys) and the scores."""
    s, b, e, m = shape.seq_len, shape.micro, shape.value_bytes, shape.mask_bytes
    q, h, f, a, r = queries, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, reachable_rows(cfg, s)
    kept = (5 * h + 2 * f) * q * b * e + 2 * q * b * h * m + a * q * r * b * e + b * r * h * e
    if shape.device == "cpu":  # softmax, dropout mask, dropout output; SDPA math's scaled copies of Q and K
        return kept + a * q * s * b * (2 * e + m) + (q + s) * b * h * e
    return kept + a * q * s * b * e  # the additive c2p + p2c bias the memory-efficient kernel reads again


def layer_bytes(cfg: DebertaConfig, shape: Shape) -> int:
    """One encoder layer's kept activations (self-attention: queries at every position)."""
    return key_bytes(cfg, shape) + query_bytes(cfg, shape, shape.seq_len)


def working_bytes(cfg: DebertaConfig, shape: Shape) -> int:
    """The largest transient of one layer's backward pass: its score gradients and its gathered products'."""
    s, b, e = shape.seq_len, shape.micro, shape.value_bytes
    a, r = cfg.num_attention_heads, reachable_rows(cfg, s)
    return 2 * a * s * s * b * e + 2 * a * s * r * b * e


def recomputed_working_bytes(cfg: DebertaConfig, shape: Shape) -> int:
    """A recomputed (checkpointed) layer's backward beyond the layer itself: it runs op by op from the top, so the
    FFN's gradient (s·b·f) comes first, and the score gradients only after the FFN's, the LayerNorms' and the
    output projection's saved tensors are freed (GELU's input and output, four (s, b, h) inputs, two masks)."""
    s, b, e, m, h, f = shape.seq_len, shape.micro, shape.value_bytes, shape.mask_bytes, cfg.hidden_size, \
        cfg.intermediate_size
    freed = 2 * s * b * f * e + 4 * s * b * h * e + 2 * s * b * h * m
    return max(s * b * f * e, working_bytes(cfg, shape) - freed)


def embedding_bytes(cfg: DebertaConfig, shape: Shape) -> int:
    """The embedding LayerNorm's input and dropout mask (+ the E -> H projection's input when factorised); the conv
    beside layer 1: its dropout mask, GELU's and LayerNorm's inputs."""
    s, b, e, m, h = shape.seq_len, shape.micro, shape.value_bytes, shape.mask_bytes, cfg.hidden_size
    kept = s * b * h * (e + m) + (s * b * cfg.embedding_dim * e if cfg.factorised_embedding else 0)
    return kept + (s * b * h * (2 * e + m) if cfg.conv_kernel_size > 0 else 0)


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch, by part, and the peak they make."""

    encoder: int
    """The encoder layers run on every token (a checkpointed one: its input)."""
    decoder: int
    """The EMD's two passes and the heads (MLM, RTD), the logits the step returns included."""
    embeddings: int
    recompute: int
    """One checkpointed layer, recomputed during its backward (0 without checkpointing)."""
    head_working: int
    """The start of the backward pass: the gradients of the fp32 log-softmax and of the logits."""
    layer_working: int
    """One layer's backward beyond what it keeps (`working_bytes`; checkpointed: `recomputed_working_bytes`)."""
    tied_gradient: int = 0
    """The word embedding's gradient from the tied LM decoder (V x E), computed at the head's backward and held by
    autograd until the embedding's own share arrives at the end of the backward pass: one micro-batch or many, the
    same bytes."""
    held: int = 0
    """What the step returns and holds through its backward pass (the LM head's (M, V) logits; part of decoder)."""

    @property
    def kept(self) -> int:
        """At the end of the forward pass: everything the backward pass will read."""
        return self.encoder + self.decoder + self.embeddings

    @property
    def total(self) -> int:
        """The peak: the head's backward, the LM decoder's (the tied gradient made while the logits' gradient is
        alive), or a layer's backward deeper down, when the heads' and the decoder's activations but the held
        logits are freed and a checkpointed layer is recomputed."""
        deep = self.encoder + self.embeddings + self.held + self.recompute + self.layer_working + self.tied_gradient
        return max(self.kept + self.head_working, self.kept + self.head_working // 2 + self.tied_gradient, deep)


def _checkpointed(layers: int, every: int) -> int:
    """Layers of 0..layers-1 that `set_activation_checkpointing(every)` recomputes: 0, every, 2 every, ..."""
    return len(range(0, layers, every)) if every else 0


def mlm_activations(cfg: DebertaConfig, shape: Shape, checkpoint_every: int = 0, target_fraction: float = 0.15,
                    emd: bool = True) -> Activations:
    """DeBERTa's MLM step (`DebertaForMaskedLM`): L-1 layers then the EMD (with `emd`; else L layers)."""
    s, b, e = shape.seq_len, shape.micro, shape.value_bytes
    h, v, dim = cfg.hidden_size, cfg.vocab_size, cfg.embedding_dim
    run = cfg.num_hidden_layers - 1 if emd else cfg.num_hidden_layers
    checkpointed = _checkpointed(run, checkpoint_every)
    layer = layer_bytes(cfg, shape)
    encoder = (run - checkpointed) * layer + checkpointed * s * b * h * e
    targets = math.ceil(target_fraction * s)
    decoder = 0
    if emd:  # keys, values and p2c once; two passes of the query side, each with its own query input
        decoder += key_bytes(cfg, shape) + 2 * (query_bytes(cfg, shape, targets) + targets * b * h * e)
    m_all = targets * b
    # head inputs, the fp32 log-softmax cross-entropy keeps, the logits the step returns
    decoder += m_all * (h + 3 * dim) * e + m_all * v * (4 + e)
    working = recomputed_working_bytes(cfg, shape) if checkpointed else working_bytes(cfg, shape)
    return Activations(encoder, decoder, embedding_bytes(cfg, shape), layer if checkpointed else 0,
                       2 * m_all * v * 4, working, v * dim * e, held=m_all * v * e)


def rtd_activations(cfg: DebertaConfig, generator: DebertaConfig, shape: Shape, checkpoint_every: int = 0,
                    target_fraction: float = 0.15, emd: bool = True) -> Activations:
    """DeBERTaV3's RTD step: the generator's MLM, then the discriminator's L layers and its per-token head; both
    graphs are alive at the backward pass of L_MLM + lambda L_RTD."""
    gen = mlm_activations(generator, shape, checkpoint_every, target_fraction, emd)
    s, b, e, h = shape.seq_len, shape.micro, shape.value_bytes, cfg.hidden_size
    checkpointed = _checkpointed(cfg.num_hidden_layers, checkpoint_every)
    layer = layer_bytes(cfg, shape)
    encoder = (cfg.num_hidden_layers - checkpointed) * layer + checkpointed * s * b * h * e
    head = 3 * s * b * h * e  # LayerNorm input, dense input, GELU input
    working = recomputed_working_bytes(cfg, shape) if checkpointed else working_bytes(cfg, shape)
    return Activations(gen.encoder + encoder, gen.decoder + head, gen.embeddings + embedding_bytes(cfg, shape),
                       layer if checkpointed else gen.recompute, gen.head_working, max(working, gen.layer_working),
                       gen.tied_gradient, held=gen.held)
