"""What the tests measure about the pretraining data order (`stages.pretrain.data`), without reading the shards."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from stages.pretrain.data import Block, batches_per_epoch, windows


def sequence_order(split: Sequence[Block], seed: int, epoch: int, rank: int, world: int, micro: int,
                   buffer: int) -> np.ndarray:
    """(batches_per_epoch * micro,) split-wide indices of the sequences this rank consumes in the epoch, in order
    (what `rank_batches` reads, without reading it)."""
    want = batches_per_epoch(split, seed, epoch, world, micro) * micro
    parts = [np.concatenate([b.offset + np.arange(b.rows) for b in window])[order]
             for window, order in windows(split, seed, epoch, rank, world, buffer)]
    return np.concatenate(parts)[:want] if parts else np.empty(0, dtype=np.int64)


def mixing_deviation(labels: np.ndarray, window_share: float = 0.05) -> float:
    """Largest gap, in points, between a label's share in any window (sliding) of `window_share` of the sequence
    and its share overall: near 0 for a well mixed order, 100 - share for one sorted by label."""
    size = max(1, int(len(labels) * window_share))
    worst = 0.0
    for value in np.unique(labels):
        counts = np.concatenate([[0], np.cumsum(labels == value)])  # (N + 1,)
        in_window = (counts[size:] - counts[:-size]) / size  # (N - size + 1,) share in each window
        worst = max(worst, float(np.abs(in_window - counts[-1] / len(labels)).max()) * 100)
    return worst
