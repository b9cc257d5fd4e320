"""Named corpus sources through the corpus stage, on real news articles: each document's source is recorded, dedup
runs across sources and keeps the copy of the source listed first, and a source that dedup leaves empty stops the
stage with one error naming it and nothing written to the splits."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config import CorpusConfig
from core.corpus_sources import CorpusSource
from core.errors import StageInputError
from stages import corpus
from stages.base import StageContext
from stages.corpus.by_source import COLUMN, SOURCES

pytestmark = [pytest.mark.ray]


def _write(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _run(blend: list[CorpusSource], out: Path, **cfg):
    out.mkdir(parents=True)
    ctx = StageContext(artifact_id="t", workdir=out.parent, scratch=out.parent / "s", storage_path=str(out.parent),
                       tracker=None)
    return corpus.run(CorpusConfig(rows_per_shard=50, **cfg), inputs={"raw": corpus.RawCorpus.of_blend(blend)},
                      out=out, ctx=ctx)


@pytest.fixture(scope="module")
def articles(news_jsonl) -> list[str]:
    texts = [json.loads(line)["text"] for line in news_jsonl.read_text().splitlines()]
    return list(dict.fromkeys(t for t in texts if len(t) > 1000))[:100]  # distinct long articles


def test_dedup_across_sources_keeps_the_first_source_listed(articles, ray_local, tmp_path, capsys):
    """`second` holds 40 articles of its own and 12 copies of `first`'s: the copies go, `first`'s stay (a survivor
    chosen by the plain smallest id would be `second`'s about half the time). `code`, pyarrow's first 8 source
    files, loses the 6 with a curly brace to C4's rule before dedup, each listed with its reason, and one warning
    names the setting."""
    first = _write(tmp_path / "first.jsonl", articles[:60])
    second = _write(tmp_path / "second.jsonl", articles[60:] + articles[:12])
    code = _write(tmp_path / "code.jsonl", [Path(f).read_text() for f in
                                            sorted(Path(pa.__file__).parent.glob("*.py"))[:8]])
    out = tmp_path / "out"
    result = _run([CorpusSource("first", first, weight=0.4), CorpusSource("second", second, weight=0.4),
                   CorpusSource("code", code, weight=0.2)], out, filters=("c4_curly_brace",))
    gone = pq.read_table(out / "filtered.parquet").to_pylist()
    assert len(gone) == 6 and {(g["source"], g["path"], g["rule"]) for g in gone} == {("code", code, "c4_curly_brace")}
    assert all(g["value"] >= 1 for g in gone) and result.metrics["filtered.c4_curly_brace.code"] == 6
    report = json.loads((out / "report.json").read_text())["filters"]
    assert report["removed_by_rule_and_source"] == {"c4_curly_brace": {"code": 6}}
    assert report["read_by_source"] == {"first": 60, "second": 52, "code": 8}
    warned = [line for line in capsys.readouterr().out.splitlines() if "warning:" in line]
    assert len(warned) == 1 and "c4_curly_brace removed 6 of the 8 documents of source 'code'" in warned[0]
    assert "corpus.filters" in warned[0] and (out / "filters.png").read_bytes()[:4] == b"\x89PNG"
    kept = pq.read_table(out / "train").to_pylist() + pq.read_table(out / "validation").to_pylist()
    kept = [r for r in kept if r[COLUMN] != "code"]
    by_text = {}
    for row in kept:
        assert row["text"] not in by_text  # one copy of each article across both sources
        by_text[row["text"]] = row
    assert len(kept) == 100 and result.counts["exact_duplicates_removed"] == 12
    assert all(by_text[t][COLUMN] == "first" and by_text[t]["source"] == first for t in articles[:12])
    assert {r[COLUMN] for r in kept if r["source"] == second} == {"second"}
    dups = pq.read_table(out / "duplicates.parquet").to_pylist()
    kept_ids = {r["doc_id"]: r for r in kept}
    assert all(kept_ids[d["kept_doc_id"]][COLUMN] == "first" for d in dups)
    report = json.loads((out / SOURCES).read_text())
    assert [(s["name"], s["weight"], s["documents_read"], s["filtered"], s["duplicates_removed"]) for s in report] == [
        ("first", 0.4, 60, 0, 0), ("second", 0.4, 52, 0, 12), ("code", 0.2, 8, 6, 0)]
    assert [s["train_documents"] + s["validation_documents"] for s in report] == [60, 40, 2]


def test_a_source_empty_after_dedup_is_one_error_and_no_splits(articles, ray_local, tmp_path):
    first = _write(tmp_path / "first.jsonl", articles[:20])
    copies = _write(tmp_path / "copies.jsonl", articles[3:8])
    out = tmp_path / "out"
    with pytest.raises(StageInputError, match=r"corpus source 'copies' is empty after dedup: each of its 5 documents "
                                              r"is a copy of one of 'first'.*drop 'copies' from --corpus"):
        _run([CorpusSource("first", first), CorpusSource("copies", copies)], out)
    assert not (out / "train").exists() and not (out / "validation").exists()


def test_a_source_with_no_train_document_is_one_error(articles, ray_local, tmp_path):
    """Pretraining blends the train split, so a source whose documents all fall in validation (here one article,
    in a file whose name puts its one id there) is refused, naming it."""
    from stages.corpus.ingest import doc_id
    from stages.corpus.shard import is_validation

    name = next(f"solo{i}.jsonl" for i in range(1000) if is_validation([doc_id(str(tmp_path / f"solo{i}.jsonl"), 0, 1)],
                                                                       CorpusConfig().validation_fraction)[0])
    first = _write(tmp_path / "first.jsonl", articles[:20])
    solo = _write(tmp_path / name, articles[50:51])
    with pytest.raises(StageInputError, match=r"corpus source 'solo' has no train documents: its 1 documents left "
                                              r"after dedup all fell in the validation split"):
        _run([CorpusSource("first", first), CorpusSource("solo", solo)], tmp_path / "out")
