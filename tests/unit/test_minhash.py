"""MinHash/LSH on real news text: shingles, exact Jaccard, estimator error, banding, components."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pyarrow as pa
import pytest

from stages.minhash import (MinHasher, band_keys, candidate_pairs, jaccard, lsh_params, normalize, shingle_hashes,
                            shingle_set)


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


def test_shingle_jaccard_equals_exact_string_jaccard(articles):
    def exact(a: str, b: str) -> float:
        sa = {a[i:i + 5] for i in range(len(a) - 4)}
        sb = {b[i:i + 5] for i in range(len(b) - 4)}
        return len(sa & sb) / len(sa | sb)

    rng = np.random.default_rng(0)
    for text in articles[:20]:
        a = normalize(text)
        b = normalize(replace_words(text, 0.1, rng))
        assert jaccard(shingle_set(a), shingle_set(b)) == pytest.approx(exact(a, b), abs=1e-9)
        assert len(shingle_set(a)) == len({a[i:i + 5] for i in range(len(a) - 4)})  # no hash collisions
    assert len(shingle_hashes("abc")) == 1  # shorter than n: one shingle
    assert len(shingle_set("one two three four", kind="word", size=2)) == 3


def test_signature_estimates_jaccard_without_bias(articles):
    """P(sig_a[i] == sig_b[i]) = J: mean error ~0 and spread near the binomial sqrt(J(1-J)/P)."""
    hasher = MinHasher(num_perm=128, seed=1)
    rng = np.random.default_rng(1)
    errors, expected = [], []
    for text in articles[:120]:
        a = normalize(text)
        b = normalize(replace_words(text, rng.uniform(0.02, 0.3), rng))
        j = jaccard(shingle_set(a), shingle_set(b))
        errors.append(np.mean(hasher.signature(a) == hasher.signature(b)) - j)
        expected.append(j * (1 - j) / 128)
    errors = np.array(errors)
    assert abs(errors.mean()) < 0.015
    assert np.sqrt((errors ** 2).mean()) < 1.3 * np.sqrt(np.mean(expected))


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


def test_components_pick_smallest_id_whatever_the_edge_order():
    from stages.corpus import EDGE_SCHEMA, components

    edges = [("b", "c", 0.8), ("c", "d", 0.9), ("a", "d", 0.75), ("x", "y", 0.95)]
    results = []
    for perm in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        rows = [edges[k] for k in perm]
        table = pa.table({"a": [r[0] for r in rows], "b": [r[1] for r in rows], "similarity": [r[2] for r in rows],
                          "text_a": [""] * 4, "text_b": [""] * 4}, schema=EDGE_SCHEMA)
        results.append(components(table))
    assert results[0] == results[1] == results[2]
    assert results[0] == {"b": ("a", 0.8), "c": ("a", 0.9), "d": ("a", 0.75), "y": ("x", 0.95)}
