"""MinHash + LSH banding, vectorised with numpy (no Ray here; the corpus stage maps these over batches).

Why by hand: datasketch hashes every shingle with SHA-1 in a Python loop and permutes with a
modulo by a Mersenne prime; here one document's shingles are hashed in a handful of numpy
passes (a polynomial n-gram hash over code points) and permuted with multiply-add-shift on
uint64, which is ~an order of magnitude cheaper per shingle (see bench/dedup.py).

Definitions shared by signatures and the Jaccard check, so the two agree:
- `normalize(text)`: Unicode NFC, control/format characters and whitespace runs -> one space.
- shingles: character n-grams of the normalised text (or word n-grams), each a uint64 hash;
  a text shorter than n is a single shingle.
- signature[i] = min over shingles of (a_i * x + b_i) mod 2^32, x the top 32 bits of the (fmix64-
  mixed) shingle hash, a_i odd. uint32 products are SIMD in numpy (uint64 ones are not: 4x slower);
  on real text the estimator's error matches the binomial sqrt(J(1-J)/num_perm) with no bias
  (checked in tests/unit/test_minhash.py), and every candidate is confirmed by exact Jaccard anyway.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import xxhash

# Control characters (C0, C1), zero-width/format characters and every whitespace run collapse to one space.
_SPACE_RE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202f\u2060\ufeff]+")
_POLY = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the rolling n-gram hash
_M64 = 0xFFFFFFFFFFFFFFFF

# LSH candidates are confirmed by true Jaccard, so a false positive costs one comparison while a
# false negative is a duplicate left in the corpus: weigh misses 9:1 when choosing bands x rows.
FALSE_NEGATIVE_WEIGHT = 0.9


def normalize(text: str) -> str:
    """The text that is hashed (exact duplicates) and shingled (near duplicates); never stored."""
    return _SPACE_RE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def _fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, in place: spreads the polynomial hash over all bits."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB93FE53E1A85)
    h ^= h >> np.uint64(33)
    return h


def _ngram_hash(units: np.ndarray, n: int) -> np.ndarray:
    """Polynomial hash of every n-gram of `units` (uint64), one vector pass per position in the gram."""
    if len(units) < n:  # a short text is one shingle
        n = max(len(units), 1)
        if len(units) == 0:
            return np.zeros(0, dtype=np.uint64)
    m = len(units) - n + 1
    h = units[:m].copy()
    for k in range(1, n):
        h *= _POLY
        h += units[k:k + m]
    return _fmix64(h)


def shingle_hashes(norm_text: str, kind: str = "char", size: int = 5) -> np.ndarray:
    """uint64 hashes of the n-gram shingles of a normalised text (with repeats; order of occurrence)."""
    if kind == "char":
        units = np.frombuffer(norm_text.encode("utf-32-le"), dtype="<u4").astype(np.uint64)
    elif kind == "word":
        units = np.fromiter((xxhash.xxh3_64_intdigest(w.encode()) for w in norm_text.split(" ") if w), dtype=np.uint64)
    else:
        raise ValueError(f"shingle kind {kind!r}: use char or word")
    with np.errstate(over="ignore"):
        return _ngram_hash(units, size)


def shingle_set(norm_text: str, kind: str = "char", size: int = 5) -> np.ndarray:
    """Sorted unique shingle hashes: the set whose Jaccard similarity decides a near-duplicate."""
    return np.unique(shingle_hashes(norm_text, kind, size))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique uint64 arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


@functools.lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, fn_weight: float = FALSE_NEGATIVE_WEIGHT) -> tuple[int, int]:
    """(bands, rows), bands x rows <= num_perm, minimising the weighted false-positive and
    false-negative areas of the S-curve P(s) = 1 - (1 - s^rows)^bands around `threshold`
    (datasketch's criterion, with misses weighted by `fn_weight`)."""
    best, best_err = (1, num_perm), math.inf
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            lo = np.linspace(0.0, threshold, 201)
            hi = np.linspace(threshold, 1.0, 201)
            fp = np.trapezoid(1 - (1 - lo ** r) ** b, lo)
            fn = np.trapezoid((1 - hi ** r) ** b, hi)
            err = (1 - fn_weight) * fp + fn_weight * fn
            if err < best_err - 1e-12:
                best, best_err = (b, r), err
    return best


@dataclass(frozen=True)
class MinHasher:
    """Seeded MinHash over uint64 shingle hashes; `signature` of one text, `band_keys` for LSH."""

    num_perm: int = 128
    seed: int = 0
    shingle: str = "char"
    shingle_size: int = 5

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        a = rng.integers(0, 1 << 32, self.num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        b = rng.integers(0, 1 << 32, self.num_perm, dtype=np.uint64).astype(np.uint32)
        object.__setattr__(self, "_a", a[:, None])  # (P, 1)
        object.__setattr__(self, "_b", b[:, None])  # (P, 1)

    def signature_of_hashes(self, hashes: np.ndarray, chunk: int = 4096) -> np.ndarray:
        """(num_perm,) uint32 MinHash of a set of uint64 shingle hashes; all-ones for an empty set."""
        sig = np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        x = (hashes >> np.uint64(32)).astype(np.uint32)[None, :]  # (1, S)
        buf = np.empty((self.num_perm, min(chunk, max(x.shape[1], 1))), dtype=np.uint32)
        for start in range(0, x.shape[1], chunk):  # chunks keep the (P, chunk) buffer in cache
            part = x[:, start:start + chunk]
            out = buf[:, :part.shape[1]]
            np.multiply(self._a, part, out=out)  # (P, c), wraps mod 2^32
            out += self._b
            np.minimum(sig, out.min(axis=1), out=sig)
        return sig

    def signature(self, norm_text: str) -> np.ndarray:
        return self.signature_of_hashes(shingle_hashes(norm_text, self.shingle, self.shingle_size))

    def signatures(self, norm_texts: list[str]) -> np.ndarray:
        """(N, num_perm) uint32 signatures of normalised texts."""
        out = np.empty((len(norm_texts), self.num_perm), dtype=np.uint32)
        for i, t in enumerate(norm_texts):
            out[i] = self.signature(t)
        return out


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(N, bands) uint64 bucket keys: a hash of (band index, the band's `rows` signature values).

    Keys of different bands never meet on purpose (the band index is hashed in), so one
    groupby over all keys buckets every band at once. A 64-bit key collision only adds a
    candidate, which the Jaccard check then rejects.
    """
    n = sigs.shape[0]
    v = sigs[:, :bands * rows].astype(np.uint64).reshape(n, bands, rows)  # (N, B, R)
    with np.errstate(over="ignore"):
        h = np.broadcast_to(np.arange(1, bands + 1, dtype=np.uint64) * _POLY, (n, bands)).copy()  # (N, B)
        for j in range(rows):
            h *= np.uint64(0x100000001B3)
            h ^= v[:, :, j]
            h = _fmix64(h)
    return h


def candidate_pairs(keys: np.ndarray) -> set[tuple[int, int]]:
    """Index pairs (i < j) sharing at least one band key; in-memory LSH for benchmarks and tests."""
    n, bands = keys.shape
    flat = keys.ravel()
    doc = np.repeat(np.arange(n), bands)
    order = np.argsort(flat, kind="stable")
    flat, doc = flat[order], doc[order]
    starts = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    ends = np.r_[starts[1:], len(flat)]
    pairs: set[tuple[int, int]] = set()
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        members = np.unique(doc[s:e])
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                pairs.add((int(members[i]), int(members[j])))
    return pairs
