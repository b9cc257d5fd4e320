"""Model FLOPs per token, for throughput and model-FLOPs utilisation (MFU) reporting.

Counted: every matmul of the algorithm in `deberta.model`, at 2 FLOPs per multiply-add. Not counted:
elementwise work (softmax, LayerNorm, GELU, dropout, gathers), the embedding lookup, and the relative
table projections (4·R·H² per layer per *batch*, not per token: < 0.1% at batch >= 8 x 512).
Training = 3 x forward (the backward pass does two matmuls per forward matmul): the usual "6·N" rule
plus the attention terms that 6·N leaves out.

Per token and layer, with T = sequence length, H = hidden, I = FFN width, R = relative table rows
reachable at length T (min(2s, 2T-1); 2s = 512 rows for the 1.5B, 1024 for base/large):
  projections Q, K, V, O     8·H²
  feed-forward               4·H·I
  content scores + A·V       4·T·H
  c2p (Qc·Krᵀ) + p2c (Kc·Qrᵀ) 4·R·H      (the efficient form: T x R products, then a gather)
The conv beside layer 1 adds 2·k·H². The MLM ("mlm") runs layers 1..L-1 on every token and the
Enhanced Mask Decoder (last layer twice, queries at the targets only: fraction f of tokens, keys and
p2c once) plus the LM head (2·H² + 2·H·V) at the targets only.
An RTD step (`deberta.rtd`, DeBERTaV3) runs that MLM on the generator's configuration, then the
discriminator's L full layers and its RTD head (dense 2·H² + classifier 2·H) at every token; the
draws from the generator's softmax and the GDES embedding sum are elementwise and not counted.

ALBERT's options (ALBERT §3.1): a factorised embedding (E != H) adds the E -> H projection, 2·E·H at every
token, and its LM head maps H -> E before the V x E decoder: 2·H·E + 2·E·V per target (2·H² + 2·H·V when
E = H). Shared layers (`share_layers`) run at every depth: the same FLOPs, fewer parameters.
The sentence-order head (`sop`) works once per *sequence*, so per token it is divided by T: in the MLM the
last layer runs once more for the [CLS] query (Q, O, FFN, scores, A·V and c2p as one EMD query:
4·H² + 4·H·I + 4·T·H + 2·R·H, plus p2c as T dot products, 2·T·H; K and V are the EMD's), then the pooler
2·H² and the classifier 4·H; in RTD the discriminator's backbone has the [CLS] state: pooler + classifier.
"""

from __future__ import annotations

from deberta.config import DebertaConfig

# Dense (no sparsity) peak tensor throughput per device, FLOP/s, from the vendors' data sheets.
PEAK_FLOPS = {
    ("H100", "bf16"): 989e12,
    ("H200", "bf16"): 989e12,
    ("A100", "bf16"): 312e12,
    ("H100", "fp32"): 67e12,
    ("H200", "fp32"): 67e12,
    ("A100", "fp32"): 19.5e12,
}


def reachable_rows(cfg: DebertaConfig, seq_len: int) -> int:
    """R: rows of the relative table that distances in [-(T-1), T-1] can reach."""
    return min(2 * cfg.att_span, 2 * seq_len - 1)


def _attention_flops(cfg: DebertaConfig, seq_len: int) -> float:
    """Score and relative matmuls for one query (or, for p2c, one key) against seq_len keys."""
    h = cfg.hidden_size
    return 4.0 * seq_len * h + 4.0 * reachable_rows(cfg, seq_len) * h


def layer_flops_per_token(cfg: DebertaConfig, seq_len: int) -> float:
    """Forward FLOPs of one full encoder layer, per token."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return 8.0 * h * h + 4.0 * h * i + _attention_flops(cfg, seq_len)


def _emd_flops_per_token(cfg: DebertaConfig, seq_len: int, target_fraction: float) -> float:
    """The EMD as `DebertaForMaskedLM` computes it: K, V and p2c once for every key; per pass, Q and O
    projections, FFN, content scores, A·V and c2p for the targets only."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    r = reachable_rows(cfg, seq_len)
    keys_once = 4.0 * h * h + 2.0 * r * h  # K, V projections + Kc·Qrᵀ (p2c)
    per_query_pass = 4.0 * h * h + 4.0 * h * i + 4.0 * seq_len * h + 2.0 * r * h
    return keys_once + 2 * target_fraction * per_query_pass


def _sop_flops_per_token(cfg: DebertaConfig, seq_len: int, cls_query: bool) -> float:
    """The SOP head once per sequence, spread over its tokens; cls_query: the MLM's extra [CLS] pass of the
    last layer (the EMD never computes that state; the RTD discriminator's backbone already has it)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    head = 2.0 * h * h + 2.0 * 2 * h  # pooler dense + 2-way classifier
    query = 4.0 * h * h + 4.0 * h * i + 4.0 * seq_len * h + 2.0 * reachable_rows(cfg, seq_len) * h + 2.0 * seq_len * h
    return (head + (query if cls_query else 0.0)) / seq_len


def forward_flops_per_token(
    cfg: DebertaConfig, seq_len: int, task: str = "mlm", target_fraction: float = 0.15, sop: bool = False
) -> float:
    """Forward FLOPs per input token.

    task: "backbone" (`DebertaModel`: L full layers), "mlm" (`DebertaForMaskedLM`: L-1 full layers,
    EMD and LM head at `target_fraction` of tokens) or "mlm_full_head" (HF `DebertaV2ForMaskedLM`:
    L full layers, no EMD, LM head at every token; for comparisons only).
    sop: the MLM carries ALBERT's sentence-order head (`DebertaForMaskedLM(cfg, sop=True)`; task "mlm" only).
    """
    h, e = cfg.hidden_size, cfg.embedding_dim
    conv = 2.0 * cfg.conv_kernel_size * h * h
    embed_proj = 2.0 * e * h if cfg.factorised_embedding else 0.0
    head = 2.0 * h * e + 2.0 * e * cfg.vocab_size  # dense H -> E, tied decoder E -> V
    layers = layer_flops_per_token(cfg, seq_len)
    if sop and task != "mlm":
        raise ValueError(f"forward_flops_per_token: sop=True needs task='mlm' (got {task!r})")
    if task == "backbone":
        return cfg.num_hidden_layers * layers + conv + embed_proj
    if task == "mlm":
        emd = _emd_flops_per_token(cfg, seq_len, target_fraction)
        extra = _sop_flops_per_token(cfg, seq_len, cls_query=True) if sop else 0.0
        return (cfg.num_hidden_layers - 1) * layers + conv + embed_proj + emd + target_fraction * head + extra
    if task == "mlm_full_head":
        return cfg.num_hidden_layers * layers + conv + embed_proj + head
    raise ValueError(f"forward_flops_per_token: task={task!r}; choose 'backbone', 'mlm' or 'mlm_full_head'")


def train_flops_per_token(
    cfg: DebertaConfig, seq_len: int, task: str = "mlm", target_fraction: float = 0.15, sop: bool = False
) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward). Used for MFU."""
    return 3.0 * forward_flops_per_token(cfg, seq_len, task, target_fraction, sop)


def rtd_forward_flops_per_token(
    cfg: DebertaConfig, seq_len: int, generator: DebertaConfig | None = None, target_fraction: float = 0.15,
    sop: bool = False,
) -> float:
    """Forward FLOPs per token of an RTD step: generator MLM (`generator`, default `deberta.rtd.generator_config(cfg)`:
    half depth) + discriminator backbone (`cfg`) + RTD head (+ the SOP head on the discriminator's [CLS])."""
    if generator is None:
        from deberta.rtd import generator_config  # local import: flops stays importable without building modules

        generator = generator_config(cfg)
    h = cfg.hidden_size
    head = 2.0 * h * h + 2.0 * h
    sop_head = _sop_flops_per_token(cfg, seq_len, cls_query=False) if sop else 0.0
    return (forward_flops_per_token(generator, seq_len, "mlm", target_fraction)
            + forward_flops_per_token(cfg, seq_len, "backbone") + head + sop_head)


def rtd_train_flops_per_token(
    cfg: DebertaConfig, seq_len: int, generator: DebertaConfig | None = None, target_fraction: float = 0.15,
    sop: bool = False,
) -> float:
    """Training FLOPs per token of the whole RTD step (both models, forward + backward = 3 x forward). For MFU."""
    return 3.0 * rtd_forward_flops_per_token(cfg, seq_len, generator, target_fraction, sop)


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Peak dense FLOP/s of a known accelerator (matched by substring of its name), else None."""
    for (model, kind), value in PEAK_FLOPS.items():
        if model in device_name.upper() and kind == dtype:
            return value
    return None


def mfu(tokens_per_second: float, flops_per_token: float, peak: float) -> float:
    """Model-FLOPs utilisation: achieved model FLOP/s over the device's peak."""
    return tokens_per_second * flops_per_token / peak
