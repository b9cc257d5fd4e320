"""Named corpus sources on the command line and in the config: the `NAME=PATH[:weight=W|:epochs=E]` syntax, the
bad input each gets one `error:` line for (exit 2, before Ray), and what a source name does to ids."""

from __future__ import annotations

import re

import pytest

from core.config import ConfigError, CorpusConfig, PipelineConfig, with_corpus_arguments
from core.corpus_sources import CorpusSource
from pipeline.presets import PRESETS
from pipeline.run import main
from stages.corpus.ingest import doc_id, source_rank


@pytest.mark.parametrize("text, want", [
    ("news=data/news.jsonl", CorpusSource("news", "data/news.jsonl")),
    ("docs=s3://bucket/docs/:weight=0.5", CorpusSource("docs", "s3://bucket/docs/", weight=0.5)),
    ("web-2=/d/*.jsonl.gz:epochs=3", CorpusSource("web-2", "/d/*.jsonl.gz", epochs=3.0)),
])
def test_a_source_spec_parses_and_prints_back(text, want):
    assert CorpusSource.parse(text) == want and CorpusSource.parse(want.spec()) == want


@pytest.mark.parametrize("text", ["data/news.jsonl", "s3://bucket/year=2024/", "/abs/k=v.jsonl", "=x", "1a=x"])
def test_paths_are_not_source_names(text):
    assert not CorpusSource.is_named(text)


def test_an_existing_path_with_an_equals_sign_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "year=2024").mkdir()
    assert CorpusSource.is_named("year=2025") and not CorpusSource.is_named("year=2024")


@pytest.mark.parametrize("corpus, fragment", [
    (["a=X:weight=0", "b=X:weight=1"], "corpus source 'a': weight=0 must be > 0; give it a positive weight"),
    (["a=X:weight=-1"], "corpus source 'a': weight=-1 must be > 0"),
    (["a=X:epochs=0"], "corpus source 'a': epochs=0 must be > 0"),
    (["a=X:weight=1", "b=Y:weight=1e-5"], "corpus source 'b': weight=1e-05 is under 0.0001 of the weights' sum"),
    (["a=X:weight=0.5:epochs=2"], "corpus source 'a': weight=0.5 and epochs=2 both given; a source's share is set "
                                  "by one of them: keep :weight= or :epochs="),
    (["a=X:weight=1", "a=Y:weight=1"], "corpus source name 'a' is given twice; name each source once"),
    (["a=X:weight=1", "b=Y", "c=Z:epochs=2"], "corpus sources 'a' have a weight and 'b', 'c' none; give every "
                                              "source a :weight=, or none of them"),
    (["a=X", "Y"], "--corpus Y: name every source or none"),
    (["a=X:wieght=1"], "corpus source 'a': unknown option :wieght=;"),
    (["a=X:weight=half"], "corpus source 'a': :weight=half is not a number"),
], ids=["weight-0", "weight-negative", "epochs-0", "weight-tiny", "weight-and-epochs", "one-name-twice",
        "weights-on-some", "mixed", "typo", "nan"])
def test_bad_sources_are_one_error_line_before_ray(corpus, fragment, tmp_path, capsys):
    """Refused while the config is resolved: before the corpus is listed (X does not exist) and before Ray."""
    assert main(["--corpus", *corpus, "--workdir", str(tmp_path / "wd"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert not (tmp_path / "wd").exists()


def test_sources_in_the_config_are_checked_alike():
    with pytest.raises(ConfigError, match="corpus source 'b': weight=0 must be > 0"):
        CorpusConfig(sources=("a=X:weight=1", "b=Y:weight=0")).check()
    cfg = PRESETS["debug"]()
    with pytest.raises(ConfigError, match="both give the sources"):
        with_corpus_arguments(PipelineConfig(**{**vars(cfg), "corpus": CorpusConfig(sources=("a=X",))}), ["b=Y"])
    assert with_corpus_arguments(cfg, ["a", "b"]) == cfg  # unnamed paths: one unnamed source, as always
    named = with_corpus_arguments(cfg, ["a=X:weight=1", "b=s3://bucket/b/:weight=3"])
    assert [s.spec() for s in named.corpus.blend()] == ["a=X:weight=1", "b=s3://bucket/b/:weight=3"]


def test_source_rank_orders_ids_and_reads_back():
    """With named sources the first byte of a document's id is its source's rank: every id of the first source
    sorts before every id of the second (so dedup's smallest-id survivor is the first source's copy)."""
    first = [doc_id("/b/later.jsonl", i, rank=0) for i in range(200)]
    second = [doc_id("/a/earlier.jsonl", i, rank=1) for i in range(200)]
    assert max(first) < min(second)
    assert {int(i[:16], 16) >> 56 for i in first} == {0} and list(source_rank([int(second[0][:16], 16)])) == [1]
    assert doc_id("/a/x.jsonl", 7, rank=3)[2:] == doc_id("/a/x.jsonl", 7)[2:]  # unnamed: the whole hash, as before


def _corpus_id(corpus: list[str], workdir, capsys) -> str:
    capsys.readouterr()
    assert main(["--corpus", *corpus, "--workdir", str(workdir), "--until", "corpus", "--dry-run"]) == 0
    (row,) = re.findall(r"^  corpus\s+([0-9a-f]{16})  ", capsys.readouterr().out, re.M)
    return row


def test_names_and_weights_are_the_corpus_identity_and_one_unnamed_source_keeps_its_id(news_jsonl, tmp_path,
                                                                                         capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    assert "sources" not in CorpusConfig().what()  # an unnamed corpus's id is what it was before sources had names
    path = str(news_jsonl)
    ids = {key: _corpus_id(corpus, tmp_path / "wd", capsys) for key, corpus in {
        "unnamed": [path], "named": [f"news={path}"], "renamed": [f"articles={path}"],
        "weighted": [f"news={path}:weight=2"]}.items()}
    assert len(set(ids.values())) == 4, ids
    assert _corpus_id([f"news={path}"], tmp_path / "wd", capsys) == ids["named"]  # stable


def test_the_builtin_corpus_has_one_validation_split_in_every_workdir(tmp_path):
    """The built-in corpus's artifact id is its content's; its document ids (which decide the validation split)
    hash its `id_path`, not where a workdir put the file: two workdirs read the same ids."""
    import argparse

    import pyarrow as pa

    from pipeline.run import external_inputs
    from stages.corpus.ingest import read_files

    cfg, read = PRESETS["debug"](), {}
    for workdir in (tmp_path / "one", tmp_path / "two"):
        objects, ids = external_inputs(argparse.Namespace(corpus=None), cfg, workdir, {"corpus"})
        items = pa.Table.from_pylist(objects["raw"].read_items())
        read[workdir.name] = (ids["raw"], [t.column("doc_id") for t in read_files(items, cfg.corpus, 4096)])
    assert read["one"] == read["two"]
