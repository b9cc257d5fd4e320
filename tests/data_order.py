"""What the tests measure about a data order: how evenly it mixes the sources of a corpus."""

from __future__ import annotations

import numpy as np


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
