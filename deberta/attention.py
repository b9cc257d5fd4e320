"""Disentangled self-attention (DeBERTa §3.1), in the efficient form (DeBERTa §3.1.1).

score(i,j) = [Qc_i·Kc_j + Qc_i·Kr[r(i,j)] + Kc_j·Qr[r(i,j)]] / sqrt(3d),  r(i,j) = clamp(bucket(i-j) + s, 0, 2s-1)

The two relative terms form an additive bias (B, nh, Tq, Tk) for torch's fused
`scaled_dot_product_attention`; no (Tq, Tk, d) tensor is ever built. Relative projections are computed
once per layer on the (at most 2s) table rows a sequence of length T can reach, never per batch element.

The (Tq x R) products are gathered by r(i,j) into the (Tq x Tk) bias, as the references do, but with
broadcast (not repeated) relative projections, only the R reachable rows (R = 2T-1 at most, not 2k),
the 1/sqrt(3d) folded into the small projected tables, and query positions given explicitly so the
EMD can query masked positions only. (A Transformer-XL style `as_strided` shift instead of the gather
was measured slower on CPU: its backward zero-fills a (B, nh, T, 2T-1) buffer.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deberta.config import DebertaConfig


def log_bucket_position(relative_pos: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """Map relative distances to log buckets: |δ| <= bucket_size/2 exact, beyond that logarithmic.

    Written with the same float operations as the references (HF `make_log_bucket_position`) so the
    ceil() lands on the same side at every boundary and checkpoints interchange.
    """
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    # below mid the log branch is discarded anyway; mid-1 keeps log() finite there
    abs_pos = torch.where(
        (relative_pos < mid) & (relative_pos > -mid),
        torch.tensor(mid - 1).type_as(relative_pos),
        torch.abs(relative_pos),
    )
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    bucket_pos = torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign)
    return bucket_pos.to(torch.long)


def relative_index(delta: torch.Tensor, cfg: DebertaConfig) -> torch.Tensor:
    """Row of the relative table for distance δ = i - j: clamp(bucket(δ) + s, 0, 2s - 1)."""
    if cfg.position_buckets > 0:
        delta = log_bucket_position(delta, cfg.position_buckets, cfg.max_relative)
    span = cfg.att_span
    return torch.clamp(delta + span, 0, 2 * span - 1)


@functools.lru_cache(maxsize=32)
def _full_rows(key_len: int, device: str, cfg: DebertaConfig) -> tuple[int, int, torch.Tensor]:
    """(lo, hi, (1, Tk, Tk) rows - lo) for queries at every position; cached: the same every step."""
    pos = torch.arange(key_len, device=device)
    rows = relative_index(pos[:, None] - pos[None, :], cfg)  # (Tk, Tk)
    # bucketing is monotonic in δ: the extreme distances give the reachable block of rows
    lo, hi = int(rows[0, -1]), int(rows[-1, 0])
    return lo, hi, (rows - lo).unsqueeze(0)


@functools.lru_cache(maxsize=32)
def _delta_rows(key_len: int, device: str, cfg: DebertaConfig) -> torch.Tensor:
    """(2 Tk - 1,) int32: the table row (minus the first reachable one) of distance i - j = t - (Tk - 1) at index t,
    the layout the fused kernels read (`deberta.fused_attention`)."""
    delta = torch.arange(-(key_len - 1), key_len, device=device)
    rows = relative_index(delta, cfg)
    return (rows - int(rows.min())).to(torch.int32).contiguous()


@dataclass
class RelativeContext:
    """Per-forward relative-position state shared by all layers (built once by the encoder).

    table: the relative embedding table after its LayerNorm, (2s, H).
    key_len: Tk. lo/hi: the range of table rows reachable from distances in [-(Tk-1), Tk-1]
    (bucketing is monotonic, so the reachable rows form one contiguous block).
    full_rows: (1, Tk, Tk) table row (minus lo) of r(i, j) for queries at every position.
    """

    table: torch.Tensor
    key_len: int
    lo: int
    hi: int
    full_rows: torch.Tensor

    @classmethod
    def build(cls, table: torch.Tensor, key_len: int, cfg: DebertaConfig) -> "RelativeContext":
        lo, hi, full_rows = _full_rows(key_len, str(table.device), cfg)
        return cls(table=table, key_len=key_len, lo=lo, hi=hi, full_rows=full_rows)

    def rows_for(self, query_pos: torch.Tensor | None, cfg: DebertaConfig) -> torch.Tensor:
        """(B, Mq) query positions -> (B, Mq, Tk) table rows (minus lo) of r(i, j); None = every position."""
        if query_pos is None:
            return self.full_rows  # (1, Tk, Tk)
        keys = torch.arange(self.key_len, device=query_pos.device)
        return relative_index(query_pos[:, :, None] - keys, cfg) - self.lo  # (B, Mq, Tk)


@dataclass
class KeyState:
    """Everything an attention call derives from the keys side: reused by both EMD passes."""

    k: torch.Tensor  # (B, nh, Tk, d)
    v: torch.Tensor  # (B, nh, Tk, d)
    pos_k: torch.Tensor  # (nh, R, d), scaled: position keys Kr of the reachable rows
    pos_q: torch.Tensor  # (nh, R, d), scaled: position queries Qr of the reachable rows
    key_mask: torch.Tensor | None  # (B, Tk) bool, True = real token


class DisentangledSelfAttention(nn.Module):
    """Content + c2p + p2c attention. Parameter names follow HF `DisentangledSelfAttention`."""

    def __init__(self, cfg: DebertaConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        # 3 = content + c2p + p2c terms; the scale keeps the summed score's variance that of one term
        self.scale = 1.0 / math.sqrt(3 * self.head_dim)
        h = cfg.hidden_size
        self.query_proj = nn.Linear(h, h)
        self.key_proj = nn.Linear(h, h)
        self.value_proj = nn.Linear(h, h)
        if not cfg.share_att_key:
            self.pos_key_proj = nn.Linear(h, h)
            self.pos_query_proj = nn.Linear(h, h)
        self.pos_dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.attn_dropout_p = cfg.attention_probs_dropout_prob

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, T, H) -> (B, nh, T, d)

    def _rel_heads(self, x: torch.Tensor) -> torch.Tensor:
        r = x.shape[0]
        return x.view(r, self.num_heads, self.head_dim).transpose(0, 1)  # (R, H) -> (nh, R, d)

    def prepare_keys(
        self, hidden: torch.Tensor, key_mask: torch.Tensor | None, rel: RelativeContext
    ) -> KeyState:
        """Project keys, values and the reachable relative rows (once per layer call)."""
        table = self.pos_dropout(rel.table[rel.lo : rel.hi + 1])  # (R, H)
        if self.cfg.share_att_key:
            pos_k, pos_q = self.key_proj(table), self.query_proj(table)
        else:
            pos_k, pos_q = self.pos_key_proj(table), self.pos_query_proj(table)
        return KeyState(
            k=self._heads(self.key_proj(hidden)),
            v=self._heads(self.value_proj(hidden)),
            # the 1/sqrt(3d) of the relative terms is folded into these small (nh, R, d) tensors
            pos_k=self._rel_heads(pos_k) * self.scale,
            pos_q=self._rel_heads(pos_q) * self.scale,
            key_mask=key_mask,
        )

    def relative_bias(
        self,
        q: torch.Tensor,
        ks: KeyState,
        rel: RelativeContext,
        query_pos: torch.Tensor | None,
        p2c: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c2p + p2c, already scaled: (B, nh, Mq, Tk) for queries q (B, nh, Mq, d) at query_pos (B, Mq)
        (None = every position 0..Tk-1). Returns (bias, p2c) so a second pass with the same keys and
        positions (the EMD) can pass p2c back in and skip it."""
        b, nh, mq, _ = q.shape
        tk = ks.k.shape[2]
        if query_pos is None and mq != tk:
            query_pos = torch.arange(mq, device=q.device).expand(b, mq)  # (Mq,) -> (B, Mq)
        rows = rel.rows_for(query_pos, self.cfg)  # (B or 1, Mq, Tk)
        c2p = torch.matmul(q, ks.pos_k.transpose(-1, -2))  # (B, nh, Mq, d) @ (nh, d, R) -> (B, nh, Mq, R)
        c2p = torch.gather(c2p, -1, rows[:, None].expand(b, nh, mq, tk))  # (B, nh, Mq, Tk)
        if p2c is None:
            # p2c[i, j] = Kc_j·Qr[r(i, j)]: same index r(i, j) as c2p, as HF deberta_v2 and microsoft/DeBERTa index it
            # (DeBERTa §3.1 eq. 4 writes δ(j, i)); following the references keeps checkpoints interchangeable
            p2c = torch.matmul(ks.k, ks.pos_q.transpose(-1, -2))  # (B, nh, Tk, R)
            index = rows.transpose(1, 2)[:, None].expand(b, nh, tk, mq)  # (B, nh, Tk, Mq)
            p2c = torch.gather(p2c, -1, index).transpose(-1, -2)  # (B, nh, Tk, Mq) -> (B, nh, Mq, Tk)
        # in place: gather's output is not saved for backward, and a (B, nh, Mq, Tk) allocation is saved
        return c2p.add_(p2c), p2c

    def attend(self, q: torch.Tensor, ks: KeyState, bias: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(3d) + bias) v with the key padding mask; returns (B, Tq, H)."""
        if ks.key_mask is not None:
            # fill (not add) with the dtype minimum, as the references do; padded keys get zero weight.
            # A (B, 1, Mq, Tk) mask (documents of a packed row, `deberta.model.document_mask`) is used as it is
            allowed = ks.key_mask if ks.key_mask.dim() == 4 else ks.key_mask[:, None, None, :]
            bias = bias.masked_fill_(~allowed, torch.finfo(bias.dtype).min)
        dropout_p = self.attn_dropout_p if self.training else 0.0
        if self.cfg.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q, ks.k, ks.v, attn_mask=bias, dropout_p=dropout_p, scale=self.scale)
        else:
            # the bias is added inside the GEMM (beta=1), saving a pass over the (Tq, Tk) scores
            qf, kf = (q * self.scale).flatten(0, 1), ks.k.flatten(0, 1)  # (B, nh, T, d) -> (B*nh, T, d)
            scores = torch.baddbmm(bias.flatten(0, 1), qf, kf.transpose(-1, -2)).view_as(bias)  # (B, nh, Tq, Tk)
            probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p, training=self.training)
            out = torch.matmul(probs, ks.v)  # (B, nh, Tq, d)
        b, _, tq, _ = out.shape
        return out.transpose(1, 2).reshape(b, tq, self.num_heads * self.head_dim)  # (B, nh, Tq, d) -> (B, Tq, H)

    def fused(self, hidden: torch.Tensor, ks: KeyState, rel: RelativeContext) -> torch.Tensor:
        """attn_impl="fused": the disentangled-flash kernels on every query position (self-attention)."""
        from deberta import fused_attention

        reason = fused_attention.unavailable_reason(hidden.device)
        if reason is not None:
            raise RuntimeError(f"attn_impl='fused' {reason}; use attn_impl='sdpa'")
        if ks.key_mask is not None and ks.key_mask.dim() == 4:
            raise RuntimeError("attn_impl='fused' takes a key mask, not a document mask; use attn_impl='sdpa'")
        q = self._heads(self.query_proj(hidden))  # (B, nh, T, d)
        out = fused_attention.attend(  # the position tables unscaled: the kernel applies the scale to every term
            q, ks.k, ks.v, ks.pos_k / self.scale, ks.pos_q / self.scale,
            _delta_rows(rel.key_len, str(hidden.device), self.cfg), ks.key_mask, self.scale,
            self.attn_dropout_p if self.training else 0.0)
        b, _, t, _ = out.shape
        return out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, nh, T, d) -> (B, T, H)

    def forward(
        self,
        hidden: torch.Tensor,
        key_mask: torch.Tensor | None,
        rel: RelativeContext,
        query_states: torch.Tensor | None = None,
        query_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (B, T, H) gives keys/values; queries from query_states (B, Mq, H) (default: hidden) at
        query_pos (B, Mq) (default: 0..Mq-1). Returns (B, Mq, H)."""
        ks = self.prepare_keys(hidden, key_mask, rel)
        if self.cfg.attn_impl == "fused" and query_states is None and query_pos is None:
            return self.fused(hidden, ks, rel)
        q = self._heads(self.query_proj(hidden if query_states is None else query_states))  # (B, nh, Mq, d)
        bias, _ = self.relative_bias(q, ks, rel, query_pos)
        return self.attend(q, ks, bias)
