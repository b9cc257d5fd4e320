"""ALBERT's sentence-order prediction data (ALBERT §3.1): rows `[CLS] A [SEP] B [SEP]` of two consecutive segments.

ALBERT builds its positive pairs as BERT does: a document's sentences are gathered into a chunk of up to the
sequence budget, and the chunk is cut between two of its sentences (a uniformly drawn number of them goes to A);
the negative is the same pair swapped. With the tokenizer's `SentenceEnds` this module does the same:

1. a document's ids are split into sentences after every piece that ends in ".", "?" or "!" (closing quotes or
   brackets may follow) and is followed by a word-start piece - the SentencePiece form of ". ", "? ", "! ";
2. sentences are packed greedily, in order, into windows of at most the budget (`max_seq_len - 3`: room for
   [CLS] and two [SEP]); a sentence that does not fit starts the next window, and nothing is truncated;
3. a window of >= 2 sentences is cut at a uniformly drawn sentence boundary into A and B;
4. a window of one sentence is no pair: the row is `[CLS] sentence [SEP]` with `sop_label` NO_PAIR (MLM only;
   the SOP loss ignores it), and a sentence longer than the budget is cut into budget-long rows of that form.

So both segments of every pair begin and end at sentence boundaries, and the two orders differ only in the order
of the text. Cutting a one-sentence window at a token instead would mark the order: in order, the row starts a
sentence after [CLS] and ends one before the last [SEP], swapped it does both around the middle [SEP]. Measured
on the debug model, that shortcut alone took SOP to 93% on such rows while the sentence pairs stayed at chance.

Without `SentenceEnds` (the token-cut policy) a document is cut into windows of exactly the budget, each split
at a uniformly drawn token: every row is a pair, both segments start and end mid-sentence in either order, and
the order shows only in whether the text runs on across the middle [SEP].

A and B are consecutive text of one document, so a pair never crosses documents. With probability 0.5 the two
segments are swapped (B first): `sop_label` 1 = swapped, 0 = in order. The draws come from a generator seeded
by (seed, the document's id), so a document's pairs do not depend on which batch or worker tokenised it.
A window shorter than 2 tokens (a lone 1-token sentence, a document's last token) is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

SOP_COLUMN = "sop_label"
NO_PAIR = -100
"""`sop_label` of a row that holds no pair: the SOP loss's ignore index (`deberta.model.sop_outputs`)."""
TERMINALS = ".?!"
CLOSERS = "\"')]}\u201d\u2019\u00bb"
"""Closing quotes and brackets that may follow a sentence's terminal punctuation (`he said." Then`)."""
WORD_START = "\u2581"
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def document_rng(seed: int, doc_id: str) -> np.random.Generator:
    return np.random.default_rng([seed, xxhash.xxh64_intdigest(doc_id.encode())])


def _piece_text(piece: str) -> str:
    """A byte-fallback piece `<0x21>` -> "!" (ASCII bytes only); any other piece unchanged."""
    m = _BYTE.fullmatch(piece)
    if m is None:
        return piece
    code = int(m.group(1), 16)
    return chr(code) if code < 0x80 else ""


@dataclass(frozen=True)
class SentenceEnds:
    """Per-id tables of one tokenizer that locate sentence boundaries in its ids (built once, from its pieces)."""

    terminal: np.ndarray
    """(V,) bool: the piece ends in . ? ! (closing quotes or brackets may follow)."""
    closer: np.ndarray
    """(V,) bool: the piece is closing quotes or brackets only, without a word start."""
    word_start: np.ndarray
    """(V,) bool: the piece begins a word (SentencePiece's U+2581)."""

    @classmethod
    def of(cls, pieces: Sequence[str]) -> "SentenceEnds":
        """From the tokenizer's piece strings (`Tokenizer.pieces()`, index = id)."""
        texts = [_piece_text(p) for p in pieces]
        terminal = [bool(t.rstrip(CLOSERS)) and t.rstrip(CLOSERS)[-1] in TERMINALS for t in texts]
        closer = [bool(t) and all(c in CLOSERS for c in t) for t in texts]
        return cls(terminal=np.array(terminal, dtype=bool), closer=np.array(closer, dtype=bool),
                   word_start=np.array([p.startswith(WORD_START) for p in pieces], dtype=bool))

    def starts(self, ids: np.ndarray) -> np.ndarray:
        """Positions p in [1, n) where a sentence begins: ids[p - 1] ends one and ids[p] starts a word."""
        if len(ids) < 2:
            return np.empty(0, dtype=np.int64)
        ends = self.terminal[ids]  # (n,)
        closer = self.closer[ids]
        for _ in range(2):  # `."` and `.")`: a terminal carries over up to two closing pieces
            ends[1:] |= closer[1:] & ends[:-1]
        return np.flatnonzero(ends[:-1] & self.word_start[ids[1:]]) + 1


def units(ids: np.ndarray, budget: int, sentence_ends: SentenceEnds | None) -> list[tuple[np.ndarray, bool]]:
    """One document's ids -> its units in order, (ids, pairable): its sentences, each longer than `budget` cut
    into budget-long parts that cannot pair (no `sentence_ends`: the whole document in budget-long parts that
    can - the token-cut policy)."""
    if sentence_ends is None:
        return [(ids[i:i + budget], True) for i in range(0, len(ids), budget)]
    bounds = sentence_ends.starts(ids).tolist()
    out = []
    for a, b in zip([0, *bounds], [*bounds, len(ids)]):
        if b - a <= budget:
            out.append((ids[a:b], True))
        else:
            out += [(ids[i:min(i + budget, b)], False) for i in range(a, b, budget)]
    return out


def windows(parts: list[tuple[np.ndarray, bool]], budget: int) -> list[list[np.ndarray]]:
    """Pairable units packed greedily in order into windows of at most `budget` tokens (a unit that does not
    fit starts the next window); a unit that cannot pair is a window of its own."""
    out: list[list[np.ndarray]] = []
    size = budget + 1  # no open window yet
    for unit, pairable in parts:
        if not pairable or size + len(unit) > budget:
            out.append([])
            size = 0
        out[-1].append(unit)
        size = size + len(unit) if pairable else budget + 1  # nothing joins a part of a long sentence
    return out


def segment_pairs(ids: Sequence[int], max_seq_len: int, cls_id: int, sep_id: int, pad_id: int,
                  rng: np.random.Generator, sentence_ends: SentenceEnds | None = None,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One document's ids -> (rows (n, max_seq_len) uint32, unpadded lengths (n,), sop labels (n,) int8:
    1 swapped, 0 in order, NO_PAIR for a `[CLS] window [SEP]` row that is no pair)."""
    budget = max_seq_len - 3
    ids = np.asarray(ids, dtype=np.uint32)
    chunks = [w for w in windows(units(ids, budget, sentence_ends), budget) if sum(len(u) for u in w) >= 2]
    rows = np.full((len(chunks), max_seq_len), pad_id, dtype=np.uint32)  # (n, L)
    lengths = np.zeros(len(chunks), dtype=np.int32)
    labels = np.zeros(len(chunks), dtype=np.int8)
    for r, chunk in enumerate(chunks):
        if len(chunk) >= 2:  # BERT's a_end: how many of the window's units go to A
            a_end = int(rng.integers(1, len(chunk)))
            first, second = np.concatenate(chunk[:a_end]), np.concatenate(chunk[a_end:])
        elif sentence_ends is None:  # the token-cut policy: A = window[:cut], B = window[cut:], both non-empty
            cut = int(rng.integers(1, len(chunk[0])))
            first, second = chunk[0][:cut], chunk[0][cut:]
        else:  # one sentence (or part of one): a cut inside it would mark the order (see the module docstring)
            row = np.concatenate([[cls_id], chunk[0], [sep_id]]).astype(np.uint32)
            rows[r, :len(row)], lengths[r], labels[r] = row, len(row), NO_PAIR
            continue
        if rng.random() < 0.5:
            first, second = second, first
            labels[r] = 1
        row = np.concatenate([[cls_id], first, [sep_id], second, [sep_id]]).astype(np.uint32)
        rows[r, :len(row)] = row
        lengths[r] = len(row)
    return rows, lengths, labels
