"""MinHash, LSH banding and exact Jaccard, vectorised with numpy over whole batches (no Ray here).

Why by hand: datasketch hashes every shingle with SHA-1 in a Python loop and permutes with a modulo
by a Mersenne prime; here a batch of documents is shingled in a handful of numpy passes (a
polynomial n-gram hash over code points) and permuted by a multiplication on uint32, so the cost is
under a nanosecond per (shingle, permutation) and nothing per document (see bench/dedup.py).

Definitions shared by signatures and the Jaccard check, so the two agree:
- `normalize(text)`: Unicode NFC, control/format characters and whitespace runs -> one space.
- shingles: character n-grams of the normalised text (or word n-grams), each a uint64 hash;
  a text shorter than n is a single shingle.
- signature[i] = min over shingles of (a_i * x) mod 2^32, x the top 32 bits of the (fmix64-mixed)
  shingle hash, a_i odd: multiplying by an odd number permutes the 32-bit words, and x is already a
  well-mixed hash, so the textbook family's "+ b_i" is left out - it was a third pass over the
  (permutations x shingles) block, and changes neither the estimator's bias nor its spread
  (`python -m bench.minhash_family` measures both families). uint32 products are SIMD in numpy (uint64
  ones are not: 4x slower); on real text the estimator's error matches the binomial sqrt(J(1-J)/num_perm)
  with no bias (checked in tests/unit/test_minhash.py), and every candidate is confirmed by exact Jaccard.

Batches are CSR-shaped: `hashes` holds every document's values back to back and `offsets[d]:offsets[d+1]`
is document d's slice. Sets are sorted unique segments; the Jaccard of a pair sorts both sets together
and counts equal neighbours. Short segments (tweets, titles) are sorted many at a time as rows of one
padded `np.sort(axis=1)`; a segment of LOOP_LENGTH or more values gets its own call, whose Python cost
is then under a tenth of the sort's (gathering long rows into a padded block costs more than it saves).
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

# Control characters (C0, C1), zero-width/format characters and every whitespace run collapse to one space.
SPACE_RE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202f\u2060\ufeff]+")
# The characters of SPACE_RE that str.split() does not split on (not str.isspace()): a text without
# them normalises with split/join, 3x faster than the regex (tests/unit/test_minhash.py checks every code point).
NOT_SPACE_RE = re.compile(r"[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\u200b-\u200f\u202a-\u202e\u2060\ufeff]")
_ASCII_SPACE = bytes(32 if c <= 32 or c == 127 else c for c in range(256))  # ASCII members of SPACE_RE -> " "
_POLY = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the rolling n-gram hash
_PAD = np.uint64(0xFFFFFFFFFFFFFFFF)  # padding of sorted rows: sorts last (ties with a real max value are harmless)
SHINGLE_CHUNK = 1 << 18  # characters shingled per numpy pass (a few MiB of uint64 temporaries)
SIGNATURE_CHUNK = 4096  # shingles per (P, chunk) product: a 2 MiB block that stays in a core's L2 between
# its two passes (multiply, min); 16,384 (8 MiB) is slower per element (bench.minhash_family), 2,048 pays numpy's
# per-call cost
SORT_CELLS = 1 << 19  # padded cells per np.sort(axis=1) call: 4 MiB of uint64, ~90 MB with the index arrays that fill it
LOOP_LENGTH = 512  # segments this long are sorted one numpy call each: the call costs < 10% of the sort

# LSH candidates are confirmed by true Jaccard, so a false positive costs one comparison while a
# false negative is a duplicate left in the corpus: weigh misses 9:1 when choosing bands x rows.
FALSE_NEGATIVE_WEIGHT = 0.9


def normalize(text: str) -> str:
    """The text that is hashed (exact duplicates) and shingled (near duplicates); never stored.

    NFC, then every run of SPACE_RE characters -> one space, no edge spaces. Same result three ways,
    fastest first: ASCII bytes (translate, then halve runs of spaces until none is left), text without
    controls (str.split), the regex.
    """
    text = unicodedata.normalize("NFC", text)
    if text.isascii():
        raw = text.encode("ascii").translate(_ASCII_SPACE)
        while b"  " in raw:
            raw = raw.replace(b"  ", b" ")
        return raw.strip(b" ").decode("ascii")
    if NOT_SPACE_RE.search(text) is None:
        return " ".join(text.split())
    return SPACE_RE.sub(" ", text).strip()


def _fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, in place: spreads the polynomial hash over all bits."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB93FE53E1A85)
    h ^= h >> np.uint64(33)
    return h


def mix64(values: np.ndarray, seed: int = 0) -> np.ndarray:
    """A seeded 64-bit hash of uint64 values (a copy): for chunking buckets and routing, not for shingles."""
    with np.errstate(over="ignore"):
        return _fmix64(values.astype(np.uint64) ^ (np.uint64(seed + 1) * _POLY))


# ---------------------------------------------------------------- shingles


def _ngram_hash(units: np.ndarray, n: int, mixed: bool = True) -> np.ndarray:
    """Polynomial hash of every n-gram of `units` (uint64), one vector pass per position in the gram; `mixed`:
    then fmix64'd (a bijection of uint64: it changes no set's size or intersection, only which bits vary)."""
    m = len(units) - n + 1
    h = units[:m].copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            h *= _POLY
            h += units[k:k + m]
        return _fmix64(h) if mixed else h


def shingle_hashes(norm_text: str, kind: str = "char", size: int = 5) -> np.ndarray:
    """uint64 hashes of the n-gram shingles of a normalised text (with repeats; order of occurrence)."""
    hashes, _ = batch_shingles([norm_text], kind, size)
    return hashes


def _units(norm_texts: Sequence[str], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(units, lengths): every text's code points (or word hashes) back to back, as uint64."""
    if kind == "char":
        lengths = np.fromiter(map(len, norm_texts), dtype=np.int64, count=len(norm_texts))
        units = np.frombuffer("".join(norm_texts).encode("utf-32-le"), dtype="<u4").astype(np.uint64)
        return units, lengths
    if kind == "word":
        words = [[w for w in t.split(" ") if w] for t in norm_texts]
        lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        flat = (xxhash.xxh3_64_intdigest(w.encode()) for ws in words for w in ws)
        return np.fromiter(flat, dtype=np.uint64, count=int(lengths.sum())), lengths
    raise ValueError(f"shingle kind {kind!r}: use char or word")


def _chunks(norm_texts: Sequence[str]) -> list[slice]:
    """Consecutive groups of texts of about SHINGLE_CHUNK characters (a longer text is a group alone)."""
    ends = np.cumsum(np.fromiter(map(len, norm_texts), dtype=np.int64, count=len(norm_texts)))
    marks = np.arange(SHINGLE_CHUNK, ends[-1], SHINGLE_CHUNK) if len(ends) else np.zeros(0, np.int64)
    cuts = np.unique(np.r_[0, np.searchsorted(ends, marks) + 1, len(norm_texts)])
    cuts = cuts[cuts <= len(norm_texts)]
    return [slice(int(s), int(e)) for s, e in zip(cuts[:-1], cuts[1:])]


def _concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One CSR batch from consecutive ones."""
    if len(parts) == 1:
        return parts[0]
    sizes = np.array([len(v) for v, _ in parts], dtype=np.int64)
    offsets = [np.zeros(1, np.int64)] + [o[1:] + base for (_, o), base in zip(parts, np.cumsum(sizes) - sizes)]
    return np.concatenate([v for v, _ in parts]), np.concatenate(offsets)


def batch_shingles(norm_texts: Sequence[str], kind: str = "char", size: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets): the shingle hashes of every text (with repeats), CSR-shaped.

    One n-gram pass over the concatenated texts of each group of ~SHINGLE_CHUNK characters (its
    temporaries stay in cache); grams that straddle two texts are dropped. A text shorter than `size`
    (but not empty) is one shingle: the hash of all its units.
    """
    return _concat([_shingles(norm_texts[c], kind, size) for c in _chunks(norm_texts)] or [_shingles([], kind, size)])


def shingle_sets(norm_texts: Sequence[str], kind: str = "char", size: int = 5,
                 mixed: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique shingle hashes of every text, CSR-shaped, built a group of texts at a time (peak
    memory: the sets, 8 bytes per distinct shingle, plus one group's temporaries). Character shingles are
    written straight into one array sized by their count (an upper bound of the sets'), not gathered and
    then concatenated, which would hold the sets twice. `mixed=False` leaves out the hashes' final fmix64:
    a bijection, so every set size and Jaccard is the same, for a fifth less work (what exact Jaccard needs;
    MinHash needs the mix, as it reads the top bits)."""
    chunks = _chunks(norm_texts)
    if kind != "char" or not chunks:
        return _concat([unique_sets(*_shingles(norm_texts[c], kind, size, mixed)) for c in chunks]
                       or [_shingles([], kind, size)])
    lengths = np.fromiter(map(len, norm_texts), dtype=np.int64, count=len(norm_texts))
    values = np.empty(int(np.where(lengths >= size, lengths - size + 1, np.minimum(lengths, 1)).sum()), np.uint64)
    offsets, filled = [np.zeros(1, np.int64)], 0
    for c in chunks:
        v, o = unique_sets(*_shingles(norm_texts[c], kind, size, mixed))
        values[filled:filled + len(v)] = v
        offsets.append(o[1:] + filled)
        filled += len(v)
    return values[:filled], np.concatenate(offsets)


def _shingles(norm_texts: Sequence[str], kind: str, size: int, mixed: bool = True) -> tuple[np.ndarray, np.ndarray]:
    units, lengths = _units(norm_texts, kind)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    counts = np.where(lengths >= size, lengths - size + 1, np.minimum(lengths, 1))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    out = np.empty(int(offsets[-1]), dtype=np.uint64)
    long_docs = lengths >= size
    if len(units) >= size and long_docs.any():
        grams = _ngram_hash(units, size, mixed)  # (T - size + 1,): every window, straddling ones included
        doc_end = np.repeat(starts[1:], lengths)[:len(grams)]
        inside = np.arange(len(grams)) + size <= doc_end
        if long_docs.all():  # the usual case: no text shorter than a shingle, so no holes to leave
            out = grams[inside]
        else:
            out[np.repeat(long_docs, counts)] = grams[inside]
    for d in np.flatnonzero((lengths > 0) & ~long_docs):  # rare: texts shorter than one shingle
        out[offsets[d]] = _ngram_hash(units[starts[d]:starts[d + 1]], int(lengths[d]), mixed)[0]
    return out, offsets


# ---------------------------------------------------------------- sets and exact Jaccard


def _length_classes(lengths: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """Short rows (0 < length < LOOP_LENGTH) grouped by padded width (next power of two), each group cut
    to at most SORT_CELLS cells."""
    short = (lengths > 0) & (lengths < LOOP_LENGTH)
    width = np.left_shift(1, np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    groups = []
    for w in np.unique(width[short]):
        rows = np.flatnonzero(short & (width == w))
        step = max(1, SORT_CELLS // int(w))
        groups.extend((rows[s:s + step], int(w)) for s in range(0, len(rows), step))
    return groups


def _padded(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], rows: int, width: int) -> np.ndarray:
    """(rows, width) of _PAD with each part's values written at (row, column)."""
    buf = np.full(rows * width, _PAD, dtype=np.uint64)
    for values, row, col in parts:
        buf[row * width + col] = values
    return buf.reshape(rows, width)


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments [starts[i], starts[i] + lengths[i]): (source index, segment number, position in segment)."""
    seg = np.repeat(np.arange(len(lengths)), lengths)
    col = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + col, seg, col


def unique_sets(hashes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique values of every CSR segment: the shingle *sets* whose Jaccard decides a near duplicate."""
    lengths = np.diff(offsets)
    flat = hashes.copy()
    for d in np.flatnonzero(lengths >= LOOP_LENGTH):
        flat[offsets[d]:offsets[d + 1]].sort()
    for rows, width in _length_classes(lengths):
        src, seg, col = _ragged(offsets[rows], lengths[rows])
        flat[src] = np.sort(_padded([(hashes[src], seg, col)], len(rows), width), axis=1)[seg, col]
    keep = np.ones(len(flat), dtype=bool)
    keep[1:] = flat[1:] != flat[:-1]
    keep[offsets[:-1][lengths > 0]] = True  # a segment's first value is new even if the previous one ends equal
    doc = np.repeat(np.arange(len(lengths)), lengths)
    new_offsets = np.concatenate([[0], np.cumsum(np.bincount(doc[keep], minlength=len(lengths)))])
    return flat[keep], new_offsets


def intersections(values: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|set_a ∩ set_b| for every pair (a[i], b[i]) of CSR sets (each sorted unique).

    Both sets of a pair are sorted together; a shared value is then an equal adjacent pair. Short pairs
    share one padded np.sort(axis=1) per length class (only the first len_a + len_b cells of a row count).
    """
    la, lb = np.diff(offsets)[a], np.diff(offsets)[b]
    out = np.zeros(len(a), dtype=np.int64)
    long_pairs = np.flatnonzero(la + lb >= LOOP_LENGTH)
    bounds, firsts, seconds, counts = offsets.tolist(), a[long_pairs].tolist(), b[long_pairs].tolist(), []
    for x, y in zip(firsts, seconds):  # Python ints: numpy scalar indexing cost more than the sort here
        both = np.concatenate((values[bounds[x]:bounds[x + 1]], values[bounds[y]:bounds[y + 1]]))
        both.sort(kind="stable")  # two sorted runs: timsort merges them, 2x faster than a quicksort
        counts.append(np.count_nonzero(both[1:] == both[:-1]))
    out[long_pairs] = counts
    for rows, width in _length_classes(la + lb):
        src_a, seg_a, col_a = _ragged(offsets[a[rows]], la[rows])
        src_b, seg_b, col_b = _ragged(offsets[b[rows]], lb[rows])
        buf = np.sort(_padded([(values[src_a], seg_a, col_a), (values[src_b], seg_b, col_b + la[rows][seg_b])],
                              len(rows), width), axis=1)  # (rows, width)
        inside = np.arange(1, width)[None, :] < (la[rows] + lb[rows])[:, None]  # (rows, width - 1)
        out[rows] = ((buf[:, 1:] == buf[:, :-1]) & inside).sum(axis=1)
    return out


def jaccard_pairs(values: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact Jaccard similarity of CSR sets for every pair (a[i], b[i]); two empty sets are identical (1.0)."""
    inter = intersections(values, offsets, a, b)
    union = np.diff(offsets)[a] + np.diff(offsets)[b] - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


# ---------------------------------------------------------------- MinHash and LSH


@functools.lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, fn_weight: float = FALSE_NEGATIVE_WEIGHT) -> tuple[int, int]:
    """(bands, rows), bands x rows <= num_perm, minimising the weighted false-positive and
    false-negative areas of the S-curve P(s) = 1 - (1 - s^rows)^bands around `threshold`
    (datasketch's criterion, with misses weighted by `fn_weight`)."""
    best, best_err = (1, num_perm), math.inf
    lo = np.linspace(0.0, threshold, 201)
    hi = np.linspace(threshold, 1.0, 201)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = np.trapezoid(1 - (1 - lo ** r) ** b, lo)
            fn = np.trapezoid((1 - hi ** r) ** b, hi)
            err = (1 - fn_weight) * fp + fn_weight * fn
            if err < best_err - 1e-12:
                best, best_err = (b, r), err
    return best


@dataclass(frozen=True)
class MinHasher:
    """Seeded MinHash over uint64 shingle hashes: `signature` of one text, `signatures` of a batch."""

    num_perm: int = 128
    seed: int = 0
    shingle: str = "char"
    shingle_size: int = 5

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        a = rng.integers(0, 1 << 32, self.num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        object.__setattr__(self, "_a", a[:, None])  # (P, 1)

    def signatures_of_hashes(self, hashes: np.ndarray, offsets: np.ndarray, perms: int | None = None) -> np.ndarray:
        """(N, perms) uint32 MinHash of CSR shingle hashes, the first `perms` (default all) permutations;
        all-ones for an empty segment."""
        n, perms = len(offsets) - 1, self.num_perm if perms is None else perms
        a = self._a[:perms]  # (perms, 1)
        sig = np.full((n, perms), 0xFFFFFFFF, dtype=np.uint32)
        counts = np.diff(offsets)
        doc_of = np.repeat(np.arange(n), counts)
        x = (hashes >> np.uint64(32)).astype(np.uint32)[None, :]  # (1, S)
        buf = np.empty((perms, min(SIGNATURE_CHUNK, max(x.shape[1], 1))), dtype=np.uint32)
        for c0 in range(0, x.shape[1], SIGNATURE_CHUNK):
            c1 = min(c0 + SIGNATURE_CHUNK, x.shape[1])
            vals = buf[:, :c1 - c0]
            np.multiply(a, x[:, c0:c1], out=vals)  # (P, c), wraps mod 2^32
            docs = np.arange(doc_of[c0], doc_of[c1 - 1] + 1)
            docs = docs[counts[docs] > 0]
            mins = np.minimum.reduceat(vals, np.maximum(offsets[docs], c0) - c0, axis=1)  # (P, docs in chunk)
            sig[docs] = np.minimum(sig[docs], mins.T)
        return sig

    def signatures(self, norm_texts: Sequence[str], perms: int | None = None) -> np.ndarray:
        """(N, perms) uint32 signatures of normalised texts (the first `perms` permutations, default all)."""
        return self.signatures_of_hashes(*batch_shingles(norm_texts, self.shingle, self.shingle_size), perms)

    def signature_of_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """(num_perm,) uint32 MinHash of one set (or multiset) of uint64 shingle hashes."""
        return self.signatures_of_hashes(hashes, np.array([0, len(hashes)]))[0]

    def signature(self, norm_text: str) -> np.ndarray:
        return self.signatures([norm_text])[0]


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(N, bands) uint64 bucket keys: a hash of (band index, the band's `rows` signature values).

    Keys of different bands never meet on purpose (the band index is hashed in), so one
    shuffle over all keys buckets every band at once. A 64-bit key collision only adds a
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


def run_pairs(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every index pair (i < j) inside each run [starts[k], starts[k] + lengths[k]), vectorised."""
    span = np.arange(int(lengths.sum()))
    first = np.repeat(starts, lengths) + (span - np.repeat(np.cumsum(lengths) - lengths, lengths))  # element index
    end = np.repeat(starts + lengths, lengths)
    partners = end - first - 1  # later members of the same run
    i = np.repeat(first, partners)
    j = i + 1 + (np.arange(int(partners.sum())) - np.repeat(np.cumsum(partners) - partners, partners))
    return i, j


def candidate_pairs(keys: np.ndarray) -> set[tuple[int, int]]:
    """Index pairs (i < j) sharing at least one band key; in-memory LSH for benchmarks and tests."""
    n, bands = keys.shape
    flat = keys.ravel()
    doc = np.repeat(np.arange(n), bands)
    order = np.lexsort((doc, flat))
    flat, doc = flat[order], doc[order]
    starts = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    lengths = np.diff(np.r_[starts, len(flat)])
    i, j = run_pairs(starts[lengths > 1], lengths[lengths > 1])
    pairs = np.unique(np.stack([doc[i], doc[j]], axis=1), axis=0)
    return {(int(x), int(y)) for x, y in pairs if x != y}
