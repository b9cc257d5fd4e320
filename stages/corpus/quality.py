"""Quality rules of the corpus stage, over a batch of documents at once.

The rules are Gopher's (Rae et al. 2021, App. A.1.1 and Table A1), C4's (Raffel et al. 2020, §2.2) and
FineWeb's (Penedo et al. 2024, §3.3), as datatrove 0.10 measures them; their names and thresholds are
`core.corpus_filters`. datatrove runs each rule per document in Python; here a batch is split once into a flat
Arrow array of words and one of lines (pyarrow's string kernels, in C++), every measure is a numpy reduction over
those by document (`np.bincount` on the parent index), and duplicates are found by Arrow's dictionary encoding of
exact (document, piece) keys. The words are spaCy's, as datatrove splits them (`stages.corpus.words`: its English
prefix, suffix and infix rules, not its exceptions), each distinct white-space piece of a batch split once and
each distinct word measured once.

A document is removed by the first rule that fires, in FineWeb's order (repetition, quality, C4, FineWeb), with
the rule's measure as its value. The stage removes documents and never rewrites one: datatrove's C4 filter also
drops the lines that do not count from the text it keeps, here they only decide c4_min_sentences, c4_lorem_ipsum
and c4_curly_brace, and the text trained on is the text read.

The `Filters` also carry the languages kept: language identification is `stages.corpus.langid` (py3langid's model,
over the whole batch at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.contamination import DevGrams
from core.corpus_filters import BY_NAME, LINE, RULES
from stages.corpus.words import counts as count_words, split as split_words

LINE_BREAK = "\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]"  # what str.splitlines splits on
OTHER_BREAK = "[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]"
SPACE = r"[\s\pZ]"
SYMBOL_ONLY = r"^[\pP$+<=>^`|~]+$"  # datatrove's PUNCTUATION: a word made only of these is not counted
STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")  # Rae et al. 2021, App. A.1.1
C4_END = r"[.?!\"']$"
CITATION = r"\[\d*\]|\[edit\]|\[citation needed\]"
POLICY = "terms of use|privacy policy|cookie policy|uses cookies|use of cookies|use cookies"
# Sentence-final punctuation of the scripts langid.py covers (FineWeb's stop characters; no quotes).
TERMINAL = "[.!?\u0589\u061f\u06d4\u0700-\u0702\u07f9\u0964\u0965\u104a\u104b\u1362\u1367\u1368\u166e\u1803" \
           "\u1809\u203c\u203d\u2047-\u2049\u2e2e\u3002\ua4ff\ua60e\ua60f\ua6f3\ua6f7\ufe52\ufe56\ufe57\uff01" \
           "\uff0e\uff1f\uff61]$"
SENTENCE_BREAK = r"[.!?]+[\"'”’)\]]*[\s\pZ]+\S"  # an end of sentence with more text after it on the line
CHAIN_ROUNDS = 1  # vectorised rounds of _dup_gram before a document is read in Python


@dataclass(frozen=True, eq=False)
class Filters:
    """What the stage removes (picklable, sent to every Ray worker): rules on with their thresholds, the
    languages kept (empty: no language identification) above `language_threshold`, and the dev n-grams of the
    tasks of `corpus.decontaminate` by task name (`stages.corpus.decontaminate`). Ray Data puts a map's arguments
    in the object store once per pass, so the n-gram keys are built on the driver and read by every worker."""

    rules: tuple[tuple[str, float], ...] = ()
    languages: tuple[str, ...] = ()
    language_threshold: float = 0.65
    decontaminate: tuple[tuple[str, DevGrams], ...] = ()

    @property
    def on(self) -> bool:
        return bool(self.rules or self.languages or self.decontaminate)


# ---------------------------------------------------------------- splitting a batch


@dataclass
class Parts:
    """A batch split into flat pieces, each with the index of its document (`*_doc`)."""

    values: pa.Array
    doc: np.ndarray  # (P,) int64, ascending

    @classmethod
    def of(cls, lists: pa.Array) -> "Parts":
        lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
        return cls(lists.flatten(), pc.list_parent_indices(lists).to_numpy().astype(np.int64))

    def where(self, mask: np.ndarray) -> "Parts":
        return Parts(self.values.filter(pa.array(mask)), self.doc[mask])

    def count(self, n: int, mask: np.ndarray | None = None, weights: np.ndarray | None = None) -> np.ndarray:
        """Per document: the pieces (where `mask`), or the sum of `weights` over them."""
        doc = self.doc if mask is None else self.doc[mask]
        w = None if weights is None else (weights if mask is None else weights[mask])
        return np.bincount(doc, weights=w, minlength=n).astype(np.float64)

    def lengths(self) -> np.ndarray:
        return _numpy(pc.utf8_length(self.values)).astype(np.int64)

    def matches(self, pattern: str, ignore_case: bool = False) -> np.ndarray:
        return _numpy(pc.match_substring_regex(self.values, pattern, ignore_case=ignore_case))


class Words(Parts):
    """The batch's words: `values` holds each distinct word once (the batch's vocabulary), `ids` (W,) each word's
    index there, `doc` (W,) its document. What a rule asks of a word (its length, a pattern) is asked of the
    vocabulary once and read back by id."""

    def __init__(self, vocab: pa.Array, ids: np.ndarray, doc: np.ndarray):
        super().__init__(vocab, doc)
        self.ids = ids

    @cached_property
    def word_lengths(self) -> np.ndarray:
        return Parts.lengths(self)[self.ids]

    def lengths(self) -> np.ndarray:
        return self.word_lengths

    def matches(self, pattern: str, ignore_case: bool = False) -> np.ndarray:
        return Parts.matches(self, pattern, ignore_case)[self.ids]


def _numpy(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


def _splitlines(texts: pa.Array) -> Parts:
    """str.splitlines of every text: a line break at the very end starts no line."""
    if pc.any(pc.match_substring_regex(texts, OTHER_BREAK)).as_py():  # any break but "\n"
        parts = Parts.of(pc.split_pattern_regex(texts, LINE_BREAK))
    else:
        parts = Parts.of(pc.split_pattern(texts, "\n"))
    last = np.r_[parts.doc[1:] != parts.doc[:-1], True]
    first = np.r_[True, parts.doc[1:] != parts.doc[:-1]]
    return parts.where(~(last & ~first & (parts.lengths() == 0)))


def _split_pieces(texts: pa.Array) -> tuple[Parts, np.ndarray, pa.Array]:
    """(pieces, piece, distinct): every text's white-space pieces, each one's index among the batch's distinct
    pieces, and those."""
    pieces = Parts.of(pc.utf8_split_whitespace(texts))
    encoded = pc.dictionary_encode(pieces.values)
    return pieces, _numpy(encoded.indices).astype(np.int64), encoded.dictionary


def _word_counts(texts: pa.Array, n: int) -> np.ndarray:
    """(N,) words per text as `_words` splits them, without naming them (all FineWeb asks of words)."""
    pieces, piece, distinct = _split_pieces(texts)
    return np.bincount(pieces.doc, weights=count_words(distinct)[piece], minlength=n)


def _words(texts: pa.Array) -> Words:
    """Every text's words: split at white space, then each distinct piece (once per batch) by spaCy's rules."""
    pieces, piece, distinct = _split_pieces(texts)
    split = split_words(distinct)
    vocab = pc.dictionary_encode(split.values)
    offsets = _numpy(split.offsets).astype(np.int64)
    per = np.diff(offsets)[piece]  # (P,) words of each piece of a text
    total = int(per.sum())
    at = np.repeat(offsets[piece] - np.cumsum(per) + per, per) + np.arange(total)
    return Words(vocab.dictionary, _numpy(vocab.indices).astype(np.int64)[at], np.repeat(pieces.doc, per))


def _first_seen(keys: pa.Array | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, first): each key's id, numbered in order of first appearance (Arrow's hash table, O(N) where a sort
    is O(N log N)), and whether this position is that first appearance."""
    ids = _numpy(pc.dictionary_encode(keys).indices).astype(np.int64)
    first = ids > np.r_[-1, np.maximum.accumulate(ids)[:-1]] if len(ids) else np.zeros(0, bool)
    return ids, first


def _repeats(parts: Parts) -> np.ndarray:
    """(P,) bool: the piece equals an earlier piece of its document (datatrove's `find_duplicates`)."""
    if not len(parts.doc):
        return np.zeros(0, bool)
    ids, _ = _first_seen(parts.values)
    return ~_first_seen(parts.doc * (int(ids.max()) + 1) + ids)[1]


def _dup_fractions(parts: Parts, n: int, chars: np.ndarray, repeat: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per document: duplicate pieces / pieces, characters in duplicate pieces / `chars`."""
    repeat = _repeats(parts) if repeat is None else repeat
    pieces = np.maximum(parts.count(n), 1)
    return parts.count(n, repeat) / pieces, parts.count(n, repeat, parts.lengths()) / np.maximum(chars, 1)


# ---------------------------------------------------------------- n-grams of words


@dataclass
class Grams:
    """The n-grams of one size that can occur more than once in their document: `starts` (G,) their first word,
    ascending; `ids` (G,) numbered by first appearance in the batch (an id never spans two documents); `first`
    whether this is the id's first appearance; `counts` by id. An n-gram whose (n-1)-word prefix occurs once in
    its document occurs once too, so the n-grams of size n+1 are built from these alone, each key exact: the
    prefix's id and the next word's."""

    n: int
    starts: np.ndarray
    ids: np.ndarray
    first: np.ndarray
    counts: np.ndarray

    @classmethod
    def chain(cls, words: Words, sizes: int) -> list["Grams"]:
        """The n-grams of sizes 2..`sizes`."""
        ids, doc, vocab = words.ids, words.doc, max(len(words.values), 1)
        if int(doc[-1] + 1) * vocab * vocab >= 1 << 62:  # (document, word) numbered densely first
            ids = _first_seen(doc * vocab + ids)[0]
            vocab = int(ids.max()) + 1
        else:
            ids = doc * vocab + ids
        out, prefix, starts = [], ids, np.arange(len(ids))
        for n in range(2, sizes + 1):
            keep = starts + n - 1 < len(ids)
            starts, prefix = starts[keep], prefix[keep]
            keep = doc[starts + n - 1] == doc[starts]
            starts, prefix = starts[keep], prefix[keep]
            gram, first = _first_seen(prefix * vocab + ids[starts + n - 1])
            counts = np.bincount(gram)
            out.append(cls(n, starts, gram, first, counts))
            again = counts[gram] > 1
            starts, prefix = starts[again], gram[again]
        return out


def _top_gram(grams: Grams, words: Words, n_docs: int, cum: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Characters of the most frequent n-gram (its words joined by spaces) x its count, per document; of n-grams
    equally frequent, the first seen (Counter.most_common(1))."""
    n = grams.n
    value = np.zeros(n_docs)
    # a document with no repeated n-gram: its first n-gram, once
    firsts = heads[:-1][heads[1:] - heads[:-1] >= n]
    value[words.doc[firsts]] = cum[firsts + n] - cum[firsts] + n - 1
    repeated = grams.first & (grams.counts[grams.ids] > 1)
    if repeated.any():
        at, gram = grams.starts[repeated], grams.ids[repeated]
        count = grams.counts[gram]
        doc = words.doc[at]
        score = count * (len(grams.counts) + 1) - gram
        best = _group_argmax(score, np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]]))
        value[doc[best]] = (cum[at[best] + n] - cum[at[best]] + n - 1) * count[best]
    return value


def _dup_gram(grams: Grams, words: Words, n_docs: int, cum: np.ndarray) -> np.ndarray:
    """Characters of the duplicated n-grams per document, counted as datatrove's `find_all_duplicate` does: read
    the n-grams left to right; one seen before adds its words' characters and the reading jumps past its n words,
    neither adding the n-grams it jumps over to those seen nor counting them.

    Vectorised: only a repeat (an n-gram that occurred before) can count. Were every earlier n-gram seen, the
    counted ones would be a document's first repeat, then the first repeat at least n words after the last counted,
    and so on (`_chains`). That is datatrove's count up to the first counted n-gram whose earlier copies were all
    jumped over: there datatrove reads it as new. So that repeat is dropped and the chain of its document walked
    again, until none is left (a document still unsettled after CHAIN_ROUNDS is read in Python as datatrove does).
    """
    n = grams.n
    value = np.zeros(n_docs)
    starts, ids, doc, again = grams.starts, grams.ids, words.doc[grams.starts], ~grams.first
    for _ in range(CHAIN_ROUNDS):
        if not again.any():
            return value
        repeats = np.flatnonzero(again)
        counted = repeats[_chains(starts[repeats], doc[repeats], n)]
        at = starts[counted]
        # each counted n-gram's first copy that was read (not jumped over) must come before it
        prev = np.searchsorted(at, starts, "right") - 1
        last = at[np.maximum(prev, 0)]
        read = (prev < 0) | (starts <= last) | (starts >= last + n)  # a jump stays inside its document
        first_read = np.full(len(grams.counts), len(words.ids))
        np.minimum.at(first_read, ids[read], starts[read])
        wrong = counted[first_read[ids[counted]] >= at]
        unsettled = np.unique(doc[wrong])
        done = ~np.isin(doc[counted], unsettled)
        value += np.bincount(doc[counted[done]], weights=cum[at[done] + n] - cum[at[done]], minlength=n_docs)
        if not len(wrong):
            return value
        again[wrong[np.r_[True, doc[wrong][1:] != doc[wrong][:-1]]]] = False  # each document's first wrong one
        keep = np.isin(doc, unsettled)
        starts, ids, doc, again = starts[keep], ids[keep], doc[keep], again[keep]
    # the documents left: datatrove's reading, over the n-grams that occur more than once only (the others are
    # never counted, and being seen decides nothing)
    many = grams.counts[ids] > 1
    starts = starts[many]
    for d, chars in _read_repeats(starts.tolist(), ids[many].tolist(), doc[many].tolist(), n,
                                  (cum[starts + n] - cum[starts]).tolist()).items():
        value[d] = chars
    return value


def _read_repeats(starts: list[int], ids: list[int], docs: list[int], n: int, chars: list[int]) -> dict[int, int]:
    """datatrove's `find_all_duplicate` per document, over the starts (ascending), ids and characters of its
    n-grams that occur more than once: {document: characters counted}."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    doc, reads_from = -1, 0
    for at, gram, d, size in zip(starts, ids, docs, chars):
        if d != doc:
            doc, reads_from, out[d] = d, 0, 0
            seen.clear()
        if at < reads_from:
            continue
        if gram in seen:
            out[d] += size
            reads_from = at + n
        else:
            seen.add(gram)
    return out


def _chains(pos: np.ndarray, doc: np.ndarray, n: int) -> np.ndarray:
    """(R,) bool over the repeats at word positions `pos` (ascending) of documents `doc`: each document's first, then
    the first at least n words after the last taken, and so on (a chain of "next" pointers, walked for every
    document at once by pointer doubling: log2 of its length steps)."""
    m = len(pos)
    nxt = np.searchsorted(pos, pos + n)  # the first repeat n words on, or m
    inside = nxt < m
    nxt[inside] = np.where(doc[nxt[inside]] == doc[inside], nxt[inside], m)
    jumps = [np.r_[nxt, m]]
    while (jumps[-1][:m] < m).any():
        jumps.append(jumps[-1][jumps[-1]])
    on = np.zeros(m + 1, bool)
    on[np.r_[0, np.flatnonzero(doc[1:] != doc[:-1]) + 1]] = True
    for jump in reversed(jumps):  # from the longest jump down: mark the members 2^k steps on
        on[jump[np.flatnonzero(on)]] = True
    return on[:m]


def _ngram_measures(words: Words, n_docs: int, text_chars: np.ndarray, top: tuple[int, ...],
                    dup: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Gopher's n-gram repetition (Rae et al. 2021, Table A1) per document, by n:
    top n-gram: characters of the most frequent n-gram (words joined by spaces; ties: the first seen) x its count;
    duplicated n-grams: characters of the n-grams that occurred before, as datatrove reads them (`_dup_gram`).
    Both over the text's characters. The paper's "fraction of characters in duplicated n-grams" would count every
    word covered by a repeated n-gram; datatrove's greedy reading counts fewer (it jumps past each one it counts),
    and the referee's is the count users of these thresholds get, so it is the one here."""
    if not len(words.doc):
        return {n: np.zeros(n_docs) for n in (*top, *dup)}
    cum = np.r_[0, np.cumsum(words.word_lengths)]
    heads = np.r_[np.flatnonzero(np.r_[True, words.doc[1:] != words.doc[:-1]]), len(words.doc)]
    out: dict[int, np.ndarray] = {}
    for grams in Grams.chain(words, max((*top, *dup))):
        if grams.n in top:
            out[grams.n] = _top_gram(grams, words, n_docs, cum, heads) / np.maximum(text_chars, 1)
        if grams.n in dup:
            out[grams.n] = _dup_gram(grams, words, n_docs, cum) / np.maximum(text_chars, 1)
    return out


def _group_argmax(score: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """The index of the largest `score` in each group of consecutive positions starting at `heads`."""
    top = np.maximum.reduceat(score, heads)
    group = np.repeat(np.arange(len(heads)), np.diff(np.r_[heads, len(score)]))
    hit = np.flatnonzero(score == top[group])
    return hit[np.r_[True, group[hit][1:] != group[hit][:-1]]]


# ---------------------------------------------------------------- the rules' measures


def _gopher_quality(texts: pa.Array, words: Words, lines: Parts, n: int) -> dict[str, np.ndarray]:
    counted = ~words.matches(SYMBOL_ONLY)
    n_words = words.count(n)
    n_counted = words.count(n, counted)
    mean_length = words.count(n, counted, words.lengths()) / np.maximum(n_counted, 1)
    stop = _numpy(pc.index_in(words.values, value_set=pa.array(STOP_WORDS)))[words.ids]
    found = ~np.isnan(stop)
    distinct = np.unique(words.doc[found] * len(STOP_WORDS) + stop[found].astype(np.int64))
    ellipses = _numpy(pc.count_substring(texts, "...")) + _numpy(pc.count_substring(texts, "…"))
    n_lines = np.maximum(lines.count(n), 1)
    per_word = np.maximum(n_words, 1)
    return {
        "gopher_min_words": n_counted, "gopher_max_words": n_counted,
        "gopher_min_mean_word_length": mean_length, "gopher_max_mean_word_length": mean_length,
        "gopher_hash_ratio": _numpy(pc.count_substring(texts, "#")) / per_word,
        "gopher_ellipsis_ratio": ellipses / per_word,
        "gopher_bullet_lines": lines.count(n, lines.matches(rf"^{SPACE}*[•\-]")) / n_lines,
        "gopher_ellipsis_lines": lines.count(n, lines.matches(rf"(\.\.\.|…){SPACE}*$")) / n_lines,
        "gopher_alpha_words": words.count(n, words.matches(r"\pL")) / per_word,
        "gopher_stop_words": np.bincount(distinct // len(STOP_WORDS), minlength=n).astype(np.float64),
    }


@dataclass
class NewlinePieces:
    """Every text split at "\n" once, for Gopher's lines (runs of "\n" split, `re.split("\n+")`) and FineWeb's
    (the non-blank pieces); `repeat`: the piece equals an earlier piece of its text."""

    parts: Parts
    repeat: np.ndarray

    @classmethod
    def of(cls, texts: pa.Array) -> "NewlinePieces":
        parts = Parts.of(pc.split_pattern(texts, "\n"))
        return cls(parts, _repeats(parts))

    def gopher(self) -> tuple[Parts, np.ndarray]:
        """re.split("\n+", text): the non-empty pieces, and an empty one at the start and at the end of a text
        that starts or ends with "\n" (the second of those two is a repeat of the first)."""
        doc = self.parts.doc
        first = np.r_[True, doc[1:] != doc[:-1]]
        last = np.r_[doc[1:] != doc[:-1], True]
        empty = _numpy(pc.utf8_length(self.parts.values)) == 0
        keep = ~empty | first | last
        repeat = self.repeat & ~empty
        edge = np.flatnonzero(empty & last & ~first)
        repeat[edge] = empty[np.searchsorted(doc, doc[edge])]  # the text's first piece is empty too
        return self.parts.where(keep), repeat[keep]

    def fineweb(self) -> tuple[Parts, np.ndarray]:
        keep = _numpy(pc.not_equal(pc.utf8_trim_whitespace(self.parts.values), ""))
        return self.parts.where(keep), self.repeat[keep]


def _gopher_repetition(texts: pa.Array, words: Words, newlines: NewlinePieces, rules: dict[str, float],
                       n: int) -> dict[str, np.ndarray]:
    chars = _numpy(pc.utf8_length(texts)).astype(np.float64)
    paragraphs = Parts.of(pc.split_pattern_regex(pc.utf8_trim_whitespace(texts), r"\n\n+"))
    out = {}
    out["gopher_dup_paragraphs"], out["gopher_dup_paragraph_chars"] = _dup_fractions(paragraphs, n, chars)
    lines, repeat = newlines.gopher()
    out["gopher_dup_lines"], out["gopher_dup_line_chars"] = _dup_fractions(lines, n, chars, repeat)
    top = tuple(k for k in (2, 3, 4) if f"gopher_top_{k}gram" in rules)
    dup = tuple(k for k in range(5, 11) if f"gopher_dup_{k}gram" in rules)
    grams = _ngram_measures(words, n, chars, top, dup)
    out.update({f"gopher_top_{k}gram": grams[k] for k in top})
    out.update({f"gopher_dup_{k}gram": grams[k] for k in dup})
    return out


def _c4(lines: Parts, rules: dict[str, float], n: int) -> dict[str, np.ndarray]:
    """C4's lines that count (Raffel et al. 2020, §2.2, in the order of its reference code), then the document."""
    line = pc.utf8_trim_whitespace(lines.values)
    line_words = Parts.of(pc.utf8_split_whitespace(line))
    n_line = len(line)
    counts = np.ones(n_line, bool)
    if "c4_line_max_word_length" in rules:
        long = line_words.lengths() > rules["c4_line_max_word_length"]
        counts &= np.bincount(line_words.doc[long], minlength=n_line) == 0
    line = pc.replace_substring_regex(line, CITATION, "")
    trimmed = Parts(line, lines.doc)
    if "c4_line_terminal_punct" in rules:
        counts &= trimmed.matches(C4_END) & ~trimmed.matches(r"\.\.\.$")
    if "c4_line_min_words" in rules:
        counts &= line_words.count(n_line) >= rules["c4_line_min_words"]
    lorem = lines.count(n, counts & trimmed.matches("lorem ipsum", ignore_case=True))
    if "c4_line_javascript" in rules:
        counts &= ~trimmed.matches("javascript", ignore_case=True)
    curly = lines.count(n, counts & pc.match_substring(line, "{").to_numpy(zero_copy_only=False))
    if "c4_line_policy" in rules:
        counts &= ~trimmed.matches(POLICY, ignore_case=True)
    breaks = pc.count_substring_regex(line, SENTENCE_BREAK).to_numpy(zero_copy_only=False)
    return {"c4_lorem_ipsum": lorem, "c4_curly_brace": curly,
            "c4_min_sentences": lines.count(n, counts, breaks + 1.0)}


def _fineweb(texts: pa.Array, words: np.ndarray, newline_count: np.ndarray, newlines: NewlinePieces,
             n: int) -> dict[str, np.ndarray]:
    """FineWeb's measures; `words`, `newline_count`: (N,) words and "\n" per text."""
    lines, repeat = newlines.fineweb()
    n_lines = np.maximum(lines.count(n), 1)
    chars = _numpy(pc.utf8_length(texts)) - newline_count
    return {
        "fineweb_line_punct": lines.count(n, lines.matches(TERMINAL)) / n_lines,
        "fineweb_short_lines": lines.count(n, lines.lengths() <= 30) / n_lines,
        "fineweb_dup_line_chars": _dup_fractions(lines, n, chars, repeat)[1],
        "fineweb_list_ratio": newline_count / np.maximum(words, 1),
    }


def measure(texts: pa.Array, rules: dict[str, float], exact: bool = True) -> dict[str, np.ndarray]:
    """Every rule's measure of every text (non-null strings), as {rule: (N,) float64}; only the groups with a
    rule in `rules` are computed. Not `exact`: FineWeb's list ratio (newlines / words) is exact only where it may
    exceed its threshold; elsewhere it is newlines / white-space pieces, a bound (each piece is a word or more) at
    or below the threshold, so that FineWeb alone splits few documents into words (`first_rule`)."""
    n = len(texts)
    groups = {BY_NAME[r].group for r in rules}
    words = _words(texts) if groups & {"gopher_repetition", "gopher_quality"} else None
    lines = _splitlines(texts) if groups & {"gopher_quality", "c4"} else None
    newlines = NewlinePieces.of(texts) if groups & {"gopher_repetition", "fineweb"} else None
    out: dict[str, np.ndarray] = {}
    if "gopher_repetition" in groups:
        out.update(_gopher_repetition(texts, words, newlines, rules, n))
    if "gopher_quality" in groups:
        out.update(_gopher_quality(texts, words, lines, n))
    if "c4" in groups:
        out.update(_c4(lines, rules, n))
    if "fineweb" in groups:
        newline_count = _numpy(pc.count_substring(texts, "\n"))
        if words is not None:
            counts = words.count(n)
        elif exact or "fineweb_list_ratio" not in rules:
            counts = _word_counts(texts, n)
        else:  # words only where the bound may fire
            counts = _numpy(pc.list_value_length(pc.utf8_split_whitespace(texts))).astype(np.float64)
            some = np.flatnonzero(BY_NAME["fineweb_list_ratio"].fires(
                newline_count / np.maximum(counts, 1), rules["fineweb_list_ratio"]))
            if len(some):
                counts[some] = _word_counts(texts.take(pa.array(some)), len(some))
        out.update(_fineweb(texts, counts, newline_count, newlines, n))
    return out


def first_rule(texts: pa.Array, rules: dict[str, float]) -> tuple[list, np.ndarray]:
    """(rule, value) per text: the first rule in GROUPS order that removes it (None: kept) and its measure."""
    n = len(texts)
    reason = np.full(n, None, dtype=object)
    value = np.full(n, np.nan)
    if not rules or not n:
        return reason.tolist(), value
    measures = measure(texts, rules, exact=False)
    for rule in RULES:  # RULES is in GROUPS order
        if rule.name not in rules or rule.kind == LINE:
            continue
        fires = rule.fires(measures[rule.name], rules[rule.name]) & (reason == None)  # noqa: E711 (elementwise)
        reason[fires] = rule.name
        value[fires] = measures[rule.name][fires]
    return reason.tolist(), value
