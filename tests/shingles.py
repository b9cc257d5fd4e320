"""One-text shingle sets and their Jaccard: the definitions the tests hold the batch kernels of
`stages.corpus.minhash` to (tests/unit/test_minhash.py) and plant near-duplicates with
(tests/integration/test_corpus.py)."""

from __future__ import annotations

import numpy as np

from stages.corpus.minhash import batch_shingles, jaccard_pairs, unique_sets


def shingle_set(norm_text: str, kind: str = "char", size: int = 5) -> np.ndarray:
    """Sorted unique shingle hashes of one normalised text."""
    return unique_sets(*batch_shingles([norm_text], kind, size))[0]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique uint64 arrays."""
    values, offsets = np.concatenate([a, b]), np.array([0, len(a), len(a) + len(b)])
    return float(jaccard_pairs(values, offsets, np.array([0]), np.array([1]))[0])
