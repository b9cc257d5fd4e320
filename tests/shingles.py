"""Shingle sets and Jaccard by brute force over Python sets of strings: the independent reference the batch
kernels of `stages.corpus.minhash` are held to (tests/unit/test_minhash.py, tests/unit/test_dedup.py) and that
plants near duplicates (tests/integration/test_corpus.py). Nothing here hashes or calls the code under test."""

from __future__ import annotations


def shingle_set(norm_text: str, kind: str = "char", size: int = 5) -> frozenset:
    """The n-gram shingles of one normalised text as a set of strings (word n-grams: tuples of words); a text
    shorter than n is one shingle, an empty text none."""
    if kind == "char":
        units = norm_text
    elif kind == "word":
        units = tuple(w for w in norm_text.split(" ") if w)
    else:
        raise ValueError(f"shingle kind {kind!r}: use char or word")
    if len(units) < size:
        return frozenset([units]) if units else frozenset()
    return frozenset(units[i:i + size] for i in range(len(units) - size + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a ∩ b| / |a ∪ b|; two empty sets are identical (1.0), as the stage counts them."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0
