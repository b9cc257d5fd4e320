"""MinHash/LSH kernels on real news text: normalisation, shingles, sets, exact Jaccard, signatures, banding.

The batch kernels are checked against the one-text definitions (and those against plain Python sets),
so vectorising them cannot change what a duplicate is.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from stages.corpus.minhash import (NOT_SPACE_RE, SPACE_RE, MinHasher, band_keys, batch_shingles, candidate_pairs,
                                   jaccard_pairs, lsh_params, normalize, run_pairs, shingle_hashes, shingle_sets,
                                   unique_sets)
from tests.shingles import jaccard, shingle_set


@pytest.fixture(scope="module")
def articles(news_jsonl) -> list[str]:
    docs = [json.loads(line)["text"] for line in open(news_jsonl)]
    return [d for d in docs if len(d) > 1500][:200]


def replace_words(text: str, fraction: float, rng: np.random.Generator) -> str:
    """Replace a fraction of the words of a real text by other words (a planted near-duplicate)."""
    words = text.split(" ")
    for k in rng.choice(len(words), int(fraction * len(words)), replace=False):
        words[k] = f"w{rng.integers(10**6)}"
    return " ".join(words)


def test_normalize_unifies_unicode_forms_controls_and_whitespace():
    text = "Caf\u00e9  menu\t\u0000list\r\n\u200bnext  "
    assert normalize(text) == "Caf\u00e9 menu list next"
    assert normalize(unicodedata.normalize("NFD", text)) == normalize(text)
    assert normalize(" \n\t\x01 ") == ""
    assert normalize("plain ascii\x7f\x1c text") == "plain ascii text"  # the bytes fast path
    assert normalize(" a" + " " * 37 + "b\t\t\n ") == "a b"  # runs of any length
    assert normalize("caf\u00e9\u00a0\u3000bar") == "caf\u00e9 bar"  # the str.split fast path


def test_normalize_fast_paths_agree_with_the_regex_on_every_code_point(articles):
    """A character splits a text in the fast paths iff the regex collapses it: checked for all of Unicode."""
    for c in map(chr, range(0x110000)):
        assert bool(SPACE_RE.fullmatch(c)) == (c.isspace() or bool(NOT_SPACE_RE.fullmatch(c))), hex(ord(c))
    rng = np.random.default_rng(0)
    for text in articles[:50]:
        noisy = text.replace(" ", rng.choice([" ", "\u00a0 ", "\u200b", "\t\n"]), 40)
        assert normalize(noisy) == SPACE_RE.sub(" ", unicodedata.normalize("NFC", noisy)).strip()


def test_shingle_jaccard_equals_exact_string_jaccard(articles):
    """The kernel's hashed sets and pair Jaccard against Python sets of the n-gram strings (no hash collisions)."""
    rng = np.random.default_rng(0)
    for text in articles[:20]:
        a = normalize(text)
        b = normalize(replace_words(text, 0.1, rng))
        for mixed in (True, False):  # the confirm step's sets skip the final mix: the same sets up to a bijection
            values, offsets = shingle_sets([a, b], mixed=mixed)
            got = jaccard_pairs(values, offsets, np.array([0]), np.array([1]))[0]
            assert got == pytest.approx(jaccard(shingle_set(a), shingle_set(b)), abs=1e-12)
            assert np.diff(offsets).tolist() == [len(shingle_set(a)), len(shingle_set(b))]
    assert len(shingle_hashes("abc")) == 1 == len(shingle_set("abc"))  # shorter than n: one shingle
    values, offsets = shingle_sets(["one two three four"], kind="word", size=2)
    assert len(values) == len(shingle_set("one two three four", kind="word", size=2)) == 3


def test_batch_kernels_equal_the_one_text_definitions(articles):
    """Concatenated shingling drops grams across texts; sets and signatures match text by text."""
    texts = [normalize(t) for t in articles[:40]] + ["", "abc", "abcde", "x", "h\u00e9llo w\u00f6rld \U0001d11e", ""]
    hasher = MinHasher(seed=2)
    for kind, size in (("char", 5), ("char", 3), ("word", 2)):
        hashes, offsets = batch_shingles(texts, kind, size)
        values, set_offsets = shingle_sets(texts, kind, size)
        for i, t in enumerate(texts):
            one = hashes[offsets[i]:offsets[i + 1]]
            if kind == "char":
                assert len(one) == (len(t) - size + 1 if len(t) >= size else min(len(t), 1))
            assert np.array_equal(values[set_offsets[i]:set_offsets[i + 1]], np.unique(one))
        sigs = MinHasher(seed=2, shingle=kind, shingle_size=size).signatures(texts)
        assert np.array_equal(sigs[5], MinHasher(seed=2, shingle=kind, shingle_size=size).signature(texts[5]))
    assert np.array_equal(hasher.signatures(texts)[[0, 3]], np.stack([hasher.signature(texts[0]),
                                                                       hasher.signature(texts[3])]))
    assert (hasher.signatures([""]) == 0xFFFFFFFF).all()  # an empty text: no shingle lowers any minimum


def test_unique_sets_and_pair_jaccard_match_python_sets_for_short_and_long_segments():
    rng = np.random.default_rng(3)
    lengths = [0, 1, 2, 7, 100, 511, 512, 600, 3000]
    segments = [rng.integers(0, 50 + n // 2, n).astype(np.uint64) for n in lengths]  # repeats on purpose
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values, set_offsets = unique_sets(np.concatenate(segments), offsets)
    sets = [set(s.tolist()) for s in segments]
    for i, s in enumerate(sets):
        assert values[set_offsets[i]:set_offsets[i + 1]].tolist() == sorted(s)
    a, b = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 2]), np.array([0, 1, 3, 4, 5, 6, 7, 8, 4, 8, 6])
    expected = [len(sets[i] & sets[j]) / len(sets[i] | sets[j]) if sets[i] | sets[j] else 1.0 for i, j in zip(a, b)]
    assert jaccard_pairs(values, set_offsets, a, b).tolist() == pytest.approx(expected, abs=1e-12)


def test_signature_estimates_jaccard_without_bias(articles):
    """P(sig_a[i] == sig_b[i]) = J: mean error ~0 and spread near the binomial sqrt(J(1-J)/P)."""
    hasher = MinHasher(num_perm=128, seed=1)
    rng = np.random.default_rng(1)
    a_texts = [normalize(t) for t in articles[:120]]
    b_texts = [normalize(replace_words(t, rng.uniform(0.02, 0.3), rng)) for t in articles[:120]]
    sa, sb = hasher.signatures(a_texts), hasher.signatures(b_texts)
    j = np.array([jaccard(shingle_set(a), shingle_set(b)) for a, b in zip(a_texts, b_texts)])
    errors = (sa == sb).mean(axis=1) - j
    assert abs(errors.mean()) < 0.015
    assert np.sqrt((errors ** 2).mean()) < 1.3 * np.sqrt(np.mean(j * (1 - j) / 128))


def test_signature_is_seeded_and_order_free(articles):
    text = normalize(articles[0])
    h = shingle_hashes(text)
    sig = MinHasher(seed=3).signature_of_hashes(h)
    assert np.array_equal(sig, MinHasher(seed=3).signature_of_hashes(h[::-1]))
    assert np.array_equal(sig, MinHasher(seed=3).signature(text))
    assert not np.array_equal(sig, MinHasher(seed=4).signature(text))
    assert sig.dtype == np.uint32 and sig.shape == (128,)


def test_lsh_params_favour_recall_above_threshold():
    bands, rows = lsh_params(0.7, 128)
    assert bands * rows <= 128

    def p(s: float) -> float:
        return 1 - (1 - s ** rows) ** bands

    assert p(0.8) > 0.99 and p(0.7) > 0.85
    assert p(0.2) < 0.01  # unrelated documents rarely meet
    b9, r9 = lsh_params(0.9, 128)
    assert r9 > rows  # a stricter threshold means longer bands


def test_run_pairs_lists_every_pair_inside_each_run():
    i, j = run_pairs(np.array([0, 5, 9]), np.array([3, 1, 4]))
    assert sorted(zip(i.tolist(), j.tolist())) == [(0, 1), (0, 2), (1, 2), (9, 10), (9, 11), (9, 12),
                                                    (10, 11), (10, 12), (11, 12)]


def test_banding_finds_planted_near_duplicates_and_not_unrelated(articles):
    hasher = MinHasher(seed=0)
    bands, rows = lsh_params(0.7, 128)
    rng = np.random.default_rng(2)
    base = [normalize(t) for t in articles[:60]]
    edited = [normalize(replace_words(t, 0.04, rng)) for t in articles[:20]]  # Jaccard ~0.8-0.9
    texts = base + edited
    keys = band_keys(hasher.signatures(texts), bands, rows)
    pairs = candidate_pairs(keys)
    planted = {(i, 60 + i) for i in range(20)}
    for i, j in planted:
        assert jaccard(shingle_set(texts[i]), shingle_set(texts[j])) >= 0.75
    assert len(planted & pairs) >= 19
    unrelated = {(i, j) for i, j in pairs if j < 60 and jaccard(shingle_set(texts[i]), shingle_set(texts[j])) < 0.3}
    assert len(unrelated) <= 2
