"""ALBERT's sentence-order prediction data (seed 004): rows `[CLS] A [SEP] B [SEP]` of two consecutive segments.

Each document's token ids are cut into windows of at most `max_seq_len - 3` tokens (room for [CLS] and two
[SEP]); a window of at least 2 tokens is split at a uniformly drawn point into A (its start) and B (the rest),
so A and B are consecutive text of one document and a pair never crosses documents. With probability 0.5 the
two segments are swapped (B first): `sop_label` 1 = swapped, 0 = in order. The draws come from a generator
seeded by (seed, the document's id), so a document's pairs do not depend on which batch or worker tokenised it.
A window shorter than 2 tokens (a document's last few tokens) cannot make a pair and is dropped.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

SOP_COLUMN = "sop_label"


def document_rng(seed: int, doc_id: str) -> np.random.Generator:
    return np.random.default_rng([seed, xxhash.xxh64_intdigest(doc_id.encode())])


def segment_pairs(ids: Sequence[int], max_seq_len: int, cls_id: int, sep_id: int, pad_id: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One document's ids -> (rows (n, max_seq_len) uint32, unpadded lengths (n,), sop labels (n,) int8)."""
    budget = max_seq_len - 3
    ids = np.asarray(ids, dtype=np.uint32)
    windows = [ids[i:i + budget] for i in range(0, len(ids), budget)]
    windows = [w for w in windows if len(w) >= 2]
    rows = np.full((len(windows), max_seq_len), pad_id, dtype=np.uint32)  # (n, L)
    lengths = np.zeros(len(windows), dtype=np.int32)
    labels = np.zeros(len(windows), dtype=np.int8)
    for r, window in enumerate(windows):
        cut = int(rng.integers(1, len(window)))  # A = window[:cut], B = window[cut:], both non-empty
        first, second = window[:cut], window[cut:]
        if rng.random() < 0.5:
            first, second = second, first
            labels[r] = 1
        row = np.concatenate([[cls_id], first, [sep_id], second, [sep_id]]).astype(np.uint32)
        rows[r, :len(row)] = row
        lengths[r] = len(row)
    return rows, lengths, labels
