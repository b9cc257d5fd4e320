"""Word n-grams shared between evaluation examples and training text, as GPT-3 (Brown et al. 2020, App. C) and NeMo
Curator's TaskDecontamination measure them: text is lower-cased, every character that is not a letter, digit or
mark becomes a space, and the words left are compared 13 at a time. An example shorter than 13 words counts whole
when it has at least 8 (NeMo's `min_ngram_size`; GPT-3 clamps its N to [8, 13] by the task's short examples), and
not at all below that: a 5-word review matches too much ordinary prose to mean anything.

Both sides are hashed the same way, vectorised over a batch (pyarrow's string kernels split and normalise, numpy
rolls a 64-bit key over each window of word hashes): the examples' keys once, on the driver (`DevGrams.of`, a
sorted uint64 array that travels to the Ray workers), and each batch of documents against them (`matches`). Two
different n-grams share a key with probability ~2^-64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

NGRAM = 13
MIN_WORDS = 8
NOT_WORD = r"[^\pL\pN\pM]+"
MIX = np.uint64(0x9E3779B97F4A7C15)


def words(texts: pa.Array | Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, text): every normalised word of every text as a 64-bit hash (xxh3 of the word, the same in every
    process), and the index of the text it is in (ascending)."""
    texts = pa.array(texts, pa.large_string()) if not isinstance(texts, (pa.Array, pa.ChunkedArray)) else texts
    spaced = pc.utf8_trim_whitespace(pc.replace_substring_regex(pc.utf8_lower(texts), NOT_WORD, " "))
    lists = pc.utf8_split_whitespace(spaced)  # no empty words: trimmed, since a trailing space would give one
    lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    flat = pc.dictionary_encode(lists.flatten())
    vocab = np.array([xxhash.xxh3_64_intdigest(w.encode()) for w in flat.dictionary.to_pylist()], np.uint64)
    ids = flat.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return vocab[ids] if len(ids) else np.zeros(0, np.uint64), \
        pc.list_parent_indices(lists).to_numpy().astype(np.int64)


def _windows(hashes: np.ndarray, text: np.ndarray, lengths: Sequence[int]):
    """Yield (length, starts, keys): for each length in `lengths` (ascending), the start of every window of that
    many words inside one text and its key; the key of a window extends the key of its one-word-shorter prefix."""
    starts = np.arange(len(hashes))
    key = np.zeros(len(hashes), np.uint64)
    with np.errstate(over="ignore"):
        for k in range(max(lengths, default=0)):
            inside = starts + k < len(hashes)
            inside[inside] &= text[starts[inside] + k] == text[starts[inside]]
            starts, key = starts[inside], key[inside]
            key = (key ^ hashes[starts + k]) * MIX
            key ^= key >> np.uint64(29)
            if k + 1 in lengths:
                yield k + 1, starts, key


@dataclass(frozen=True)
class DevGrams:
    """The n-gram keys of a set of examples: `keys` sorted, `example[i]` the example of `keys[i]`; `lengths` the
    window lengths to look for in a document (n, and the lengths of shorter examples counted whole)."""

    keys: np.ndarray
    example: np.ndarray
    lengths: tuple[int, ...]
    examples: int

    @classmethod
    def of(cls, examples: Sequence[Sequence[str]], n: int = NGRAM) -> "DevGrams":
        """Every example is its texts (a sentence pair, a question and its context): each text's n-grams, or the
        whole text when it has MIN_WORDS..n-1 words."""
        texts = [t for ex in examples for t in ex]
        owner = np.repeat(np.arange(len(examples)), [len(ex) for ex in examples])
        hashes, text = words(texts)
        size = np.bincount(text, minlength=len(texts))
        short = np.unique(size[(size >= min(MIN_WORDS, n)) & (size < n)])
        keys, example = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for length, starts, key in _windows(hashes, text, tuple(short) + (n,)):
            t = text[starts]
            keep = (size[t] >= n) if length == n else (size[t] == length)
            keys.append(key[keep])
            example.append(owner[t[keep]])
        keys, example = np.concatenate(keys), np.concatenate(example)
        order = np.argsort(keys, kind="stable")
        return cls(keys[order], example[order], tuple(int(x) for x in short) + (n,), len(examples))

    def matches(self, texts: pa.Array | Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(per text the number of its windows that are an example's n-gram, the distinct keys found)."""
        n_texts = len(texts)
        hashes, text = words(texts)
        count = np.zeros(n_texts, np.int64)
        found = [np.zeros(0, np.uint64)]
        if not len(self.keys):
            return count, found[0]
        for _, starts, key in _windows(hashes, text, self.lengths):
            at = np.minimum(np.searchsorted(self.keys, key), len(self.keys) - 1)
            hit = self.keys[at] == key
            count += np.bincount(text[starts[hit]], minlength=n_texts)
            found.append(key[hit])
        return count, np.unique(np.concatenate(found))

    def contaminated(self, found: np.ndarray) -> np.ndarray:
        """The examples (sorted indices) with at least one key in `found`."""
        return np.unique(self.example[np.isin(self.keys, found)])


def figure(contaminated: int, examples: int) -> str:
    """e.g. "12 of 1,409 (0.9%)"."""
    return f"{contaminated:,} of {examples:,} ({contaminated / max(examples, 1):.1%})"
