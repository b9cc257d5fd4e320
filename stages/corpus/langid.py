"""Language identification of a whole batch at once: py3langid's own model, read from its wheel, evaluated in numpy.

py3langid has no batch interface (its `classify` walks one document's bytes in a Python loop), so its model is
evaluated here over the flat bytes of every document of a batch. The model is langid.py's (Lui & Baldwin 2012):
a document is NFC UTF-8 bytes (lower-cased when it is all upper case); a byte-level Aho-Corasick automaton
(Aho & Corasick 1975) walks them and each state it enters names at most one feature (a byte n-gram); the class
scores are naive Bayes over the features' counts, `log1p(count) @ ptc + pc` in py3langid 0.4, divided by the
square root of the byte length and normalised by a softmax; the columns of a label listed twice (a script
variant) are summed into the first.

What makes the walk vectorisable: the automaton's states are the nodes of a trie of the features, and its state
after a string is the longest suffix of that string which is a node; no node is deeper than `depth` (6 bytes), so
the state at each byte is the one reached from the root over the last `depth` bytes alone: `depth` gathers over
the whole batch's bytes. `Model.load` checks that property on the automaton it reads (`trie_depth`), so a model
without it fails loudly instead of answering differently.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Iterator

import numpy as np
import scipy.sparse as sp

LANGID_CHARS = 2_000  # py3langid's cost is linear in bytes; the first 2,000 characters decide a page's language
FEATURE_BITS = 17  # a key is document << 17 | feature: py3langid's 100,053 features and "none" fit
BATCH_BYTES = 1 << 21  # bytes walked at once: ~30 bytes of temporaries each, about 60 MB in all


@dataclass(frozen=True, eq=False)
class Model:
    """py3langid's model in arrays. Its automaton's table holds the distinct 256-byte rows of its states, flat:
    from state s on byte b the next state is `moves[row(s) + b]`, with `row(s)` 256 x the index of s's row. Here
    `steps` holds the next state's `row` instead, and `named` the feature it names, so a walk is one gather per
    byte and never needs a state's number. About 130 MB per process (ptc 54, steps and named 37 each), where
    py3langid's own identifier holds about 65 MB."""

    classes: list[str]
    aliases: list[tuple[int, int]]  # (first, repeat) columns of a label listed twice
    ptc: np.ndarray  # (F + 1, C) float32: log P(feature | class), less its mean; the last row, zeros: no feature
    pc: np.ndarray  # (C,) float32: log P(class)
    steps: np.ndarray  # (R * 256,) int32: the next state's row
    named: np.ndarray  # (R * 256,) int32: the feature the next state names (F: none)
    root: int  # the root's row
    depth: int  # the trie's depth: the state at a byte depends on the last `depth` bytes only
    pairs: np.ndarray  # (65536,) int32: the row of the state two bytes from the root, by 256 x first + second

    @classmethod
    @lru_cache(maxsize=1)
    def load(cls) -> "Model":
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        lid = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        moves = np.asarray(lid.tk_nextmove).astype(np.int32)
        row = np.asarray(lid.tk_row).astype(np.int32) << 8
        ptc = np.zeros((len(lid.nb_ptc) + 1, len(lid.nb_pc)), np.float32)  # (F + 1, C) its last row: none
        # Each feature's row less its mean over the classes: every score of a document moves by the same amount
        # (the softmax is unchanged), and float32 sums of these small numbers lose far less than of the raw ones.
        ptc[:-1] = lid.nb_ptc - lid.nb_ptc.astype(np.float64).mean(axis=1, keepdims=True)
        if len(ptc) > 1 << FEATURE_BITS:
            raise ValueError(f"py3langid's model has {len(ptc) - 1} features; at most {(1 << FEATURE_BITS) - 1} fit")
        output = np.asarray(lid.tk_output, np.int32)
        output[output < 0] = len(ptc) - 1
        depth = trie_depth(moves, row)
        first = moves[row[0] + np.arange(256)]
        pairs = row[moves[(row[first][:, None] + np.arange(256)[None]).ravel()]]  # (256 * 256,)
        return cls(list(lid.nb_classes), list(lid._alias_pairs), ptc, np.asarray(lid.nb_pc, np.float32),
                   row[moves], output[moves], int(row[0]), depth, pairs)


def trie_depth(moves: np.ndarray, row: np.ndarray) -> int:
    """The depth of the automaton's trie, after checking that it is an Aho-Corasick automaton: every state's
    move on a byte goes to its trie child on that byte if it has one, else to the move of its failure state (the
    state of its longest proper suffix in the trie) on that byte. A ValueError if not."""
    n = len(row)

    def table(states: np.ndarray) -> np.ndarray:  # (L, 256): the moves of these states
        return moves[(row[states][:, None] + np.arange(256)[None]).ravel()].reshape(len(states), 256)

    depth = np.full(n, -1, np.int64)
    depth[0] = 0
    fail = np.zeros(n, np.int64)
    level, d = np.array([0]), 0
    while len(level):
        # A state with its failure state's row has its moves: no trie child, nothing more to check. (A model whose
        # rows were not made distinct only has more to compare.)
        level = level[(row[level] != row[fail[level]]) | (d == 0)]
        nxt = table(level)  # (L, 256)
        parent = np.repeat(level, 256)
        byte = np.tile(np.arange(256), len(level))
        to = nxt.ravel().astype(np.int64)
        new = depth[to] < 0
        to_new, at = np.unique(to[new], return_index=True)  # each new state once: its first (parent, byte)
        depth[to_new] = d + 1
        p, b = parent[new][at], byte[new][at]
        # A trie node's failure state: the root at depth 1, else the move of its parent's failure state on b.
        fail[to_new] = 0 if d == 0 else moves[row[fail[p]] + b]
        mask = np.zeros((len(level), 256), bool)
        mask[np.searchsorted(level, p), b] = True  # the trie edges out of this level
        expected = np.where(mask, nxt, table(fail[level]) if d else 0)  # the root's other moves stay there
        if not np.array_equal(expected, nxt):
            raise ValueError("py3langid's automaton is not an Aho-Corasick automaton: batched language "
                             "identification needs the state at a byte to depend on the last few bytes only")
        level, d = to_new, d + 1
    if (depth < 0).any():
        raise ValueError("py3langid's automaton has states the root never reaches")
    return int(depth.max())


def encode(texts: Iterable[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(bytes, lengths) of runs of texts of about BATCH_BYTES bytes (a longer text alone), flat: of each text, what
    py3langid's `classify` reads of its first LANGID_CHARS characters."""
    run: list[bytes] = []
    size = 0
    for t in texts:
        t = t[:LANGID_CHARS]
        if t.isupper():
            t = t.lower()
        data = unicodedata.normalize("NFC", t).encode("utf8", errors="surrogatepass")
        if run and size + len(data) > BATCH_BYTES:
            yield np.frombuffer(b"".join(run), np.uint8), np.fromiter(map(len, run), np.int64, len(run))
            run, size = [], 0
        run.append(data)
        size += len(data)
    if run:
        yield np.frombuffer(b"".join(run), np.uint8), np.fromiter(map(len, run), np.int64, len(run))


def features(m: Model, flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(N,) int32: the feature named by the automaton's state after each byte (F: none), each document walked from
    the root."""
    n, d = len(flat), m.depth
    b = flat.astype(np.int32)
    out = np.empty(n, np.int32)
    if n >= d:
        # every position, over the `d` bytes ending there (across a document's start: redone below)
        r = m.pairs[(b[:n - d + 1] << 8) + b[1:n - d + 2]]  # (N - d + 1,) the row after the first two
        for k in range(2, d - 1):
            r += b[k:n - d + 1 + k]
            np.take(m.steps, r, out=r)
        r += b[d - 1:]
        out[d - 1:] = m.named[r]
    # the first d - 1 bytes of each document, walked from its start
    starts = np.cumsum(lengths) - lengths
    head = np.minimum(lengths, d - 1)
    offset = np.arange(head.sum()) - np.repeat(np.cumsum(head) - head, head)  # (H,) position in its document
    at = np.repeat(starts, head) + offset
    r = np.full(len(at), m.root, np.int32)
    named = np.full(len(at), len(m.ptc) - 1, np.int32)
    for k in range(d - 1):  # step k reads byte k of the document, for the heads at or past it
        on = np.flatnonzero(offset >= k)
        move = r[on] + b[at[on] - offset[on] + k]
        named[on] = m.named[move]
        r[on] = m.steps[move]
    out[at] = named
    return out


def _scores(m: Model, flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(D, C) float64: each document's class probabilities, as py3langid's `_decide` with norm_probs."""
    n, none = len(lengths), len(m.ptc) - 1  # the last row of ptc: no feature (zeros)
    # (document, feature) at every byte as one sorted key: a run of equal keys is that feature's count
    key = np.repeat(np.arange(n, dtype=np.int64) << FEATURE_BITS, lengths)
    key += features(m, flat, lengths)
    key.sort()
    first = np.flatnonzero(np.diff(key, prepend=-1))
    count = np.log1p(np.diff(np.r_[first, len(key)]).astype(np.float32))
    feature = (key[first] & ((1 << FEATURE_BITS) - 1)).astype(np.int32)
    indptr = np.r_[0, np.cumsum(np.bincount(key[first] >> FEATURE_BITS, minlength=n))]
    counts = sp.csr_matrix((count, feature, indptr), shape=(n, len(m.ptc)))
    counts.has_canonical_format = True
    raw = np.asarray(counts @ m.ptc, np.float64) + m.pc  # (D, C)
    # no feature (no byte, or every byte's `none`): py3langid's uniform scores
    size = np.diff(indptr)
    featureless = size == 0
    single = np.flatnonzero(size == 1)
    featureless[single] = feature[indptr[single]] == none
    raw[featureless] = 0.0
    raw /= np.sqrt(np.maximum(lengths, 1))[:, None]
    p = np.exp(raw - raw.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for i, j in m.aliases:
        p[:, i] += p[:, j]
        p[:, j] = 0.0
    return p


def classify(texts: Iterable[str]) -> tuple[list[str], np.ndarray]:
    """(top language, its probability) of each text on its first LANGID_CHARS characters: py3langid's
    `LanguageIdentifier.classify` with norm_probs, a run of texts at a time."""
    m = Model.load()
    top, prob = [], []
    for flat, lengths in encode(texts):
        p = _scores(m, flat, lengths)
        best = p.argmax(axis=1)
        top.append(best)
        prob.append(p[np.arange(len(best)), best])
    best = np.concatenate(top) if top else np.zeros(0, np.int64)
    return [m.classes[i] for i in best], np.concatenate(prob) if prob else np.zeros(0)
