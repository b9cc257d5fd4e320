"""vocab + tokenize stages on real news text: special ids, round trip, packing, counts, determinism, bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.artifacts import ArtifactStore
from core.config import TokenizeConfig, VocabConfig
from core.tokenizer import Tokenizer
from stages import tokenize as tokenize_stage
from stages import vocab as vocab_stage
from core.errors import StageInputError
from stages.base import StageContext

TRAIN_DOCS, VALIDATION_DOCS = 360, 40
VOCAB = VocabConfig(vocab_size=1_000, sample_documents=300, num_threads=2)
TOKENIZE = TokenizeConfig(max_seq_len=128, batch_size=64, rows_per_shard=500, num_workers=2)
CORPUS_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("source", pa.string())])


def _write_corpus(root: Path, docs: list[dict], splits: dict[str, slice]) -> None:
    for split, part in splits.items():
        (root / split).mkdir(parents=True)
        rows = docs[part]
        for i in range(0, max(len(rows), 1), 200):  # several shards, like the corpus stage writes
            chunk = rows[i:i + 200]
            table = pa.table({"doc_id": [r["doc_id"] for r in chunk], "text": [r["text"] for r in chunk],
                              "source": ["news.jsonl"] * len(chunk)}, schema=CORPUS_SCHEMA)
            pq.write_table(table, root / split / f"{split}-{i // 200:05d}.parquet")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wd")


@pytest.fixture(scope="module")
def store(workdir) -> ArtifactStore:
    return ArtifactStore(workdir)


@pytest.fixture(scope="module")
def module_tracker(workdir):
    from core.lineage import Lineage

    return Lineage(workdir).start("test", {"preset": "test"}, ["vocab", "tokenize"])


def make_ctx(store: ArtifactStore, workdir: Path, tracker, stage: str, art_id: str) -> StageContext:
    return StageContext(artifact_id=art_id, workdir=workdir, scratch=store.scratch(stage, art_id),
                        storage_path=str(workdir / "ray"), tracker=tracker)


def build(store, workdir, tracker, module, cfg, inputs, art_id):
    """Run a stage the way the executor does: into a temp dir that becomes the artifact with a manifest."""
    name = module.__name__.rsplit(".", 1)[-1]  # the stage's name is its module's
    with store.building(name, art_id, {"stage": name}) as out:
        result = module.run(cfg, inputs=inputs, out=out, ctx=make_ctx(store, workdir, tracker, name, art_id))
    return store.find(name, art_id), result


@pytest.fixture(scope="module")
def news_docs(news_jsonl) -> list[dict]:
    docs = []
    with open(news_jsonl) as f:
        for line in f:
            rec = json.loads(line)
            docs.append({"doc_id": f"news-{rec['id']}-{len(docs)}", "text": rec["text"]})
            if len(docs) == TRAIN_DOCS + VALIDATION_DOCS:
                break
    return docs


@pytest.fixture(scope="module")
def corpus(store, news_docs):
    with store.building("corpus", "news-test", {"stage": "corpus"}) as out:
        _write_corpus(out, news_docs, {"train": slice(0, TRAIN_DOCS), "validation": slice(TRAIN_DOCS, None)})
    return store.find("corpus", "news-test")


@pytest.fixture(scope="module")
def vocab(store, workdir, module_tracker, corpus):
    return build(store, workdir, module_tracker, vocab_stage, VOCAB, {"corpus": corpus}, "vocab-a")


@pytest.fixture(scope="module")
def tokens(store, workdir, module_tracker, corpus, vocab, ray_local):
    return build(store, workdir, module_tracker, tokenize_stage, TOKENIZE,
                 {"corpus": corpus, "vocab": vocab[0]}, "tokens-a")


def one_clear_line(err: pytest.ExceptionInfo, *fragments: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


# ----------------------------------------------------------------------------------------------- vocab

def test_special_token_ids_are_fixed(vocab):
    art, result = vocab
    tok = Tokenizer.load(art.path)
    assert json.loads((art.path / "special_tokens.json").read_text()) == {
        "[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3, "[MASK]": VOCAB.vocab_size}
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, VOCAB.vocab_size)
    assert tok.vocab_size == VOCAB.vocab_size and len(tok) == VOCAB.vocab_size + 1
    pieces = tok.pieces()
    assert pieces[:4] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]"] and pieces[-1] == "[MASK]" and len(pieces) == len(tok)
    assert tok.byte_mask().sum() == 256 and tok.word_start_mask()[[0, 1, 2, 3, tok.mask_id]].all()
    # Special strings in text are plain text, never the control ids.
    assert not set(tok.encode(["[CLS] [MASK] [SEP] [PAD]"])[0]) & {0, 1, 2, 3, tok.mask_id}
    stats = json.loads((art.path / "stats.json").read_text())
    assert stats["pieces"] == VOCAB.vocab_size and stats["sample_documents"] == VOCAB.sample_documents
    assert 1.0 < stats["pieces_per_word"] < 3.0 and stats["unk_share"] == 0.0
    assert result.counts["tokenizer_length"] == VOCAB.vocab_size + 1
    assert {"spm.model", "spm.vocab", "special_tokens.json", "stats.json"} <= set(art.manifest["files"])


def test_roundtrip_on_validation_equals_normalised_text(vocab, corpus):
    tok = Tokenizer.load(vocab[0].path)
    texts = pq.read_table(corpus.path / "validation", columns=["text"]).column("text").to_pylist()
    ids = tok.encode(texts)
    assert all(max(row) < tok.vocab_size and tok.unk_id not in row for row in ids)
    assert tok.decode(ids) == [tok.normalize(t) for t in texts]
    assert json.loads((vocab[0].path / "stats.json").read_text())["roundtrip_exact_share"] == 1.0


def test_vocab_is_deterministic(vocab, store, workdir, module_tracker, corpus):
    again, _ = build(store, workdir, module_tracker, vocab_stage, VOCAB, {"corpus": corpus}, "vocab-b")
    for name in ("spm.model", "spm.vocab", "special_tokens.json", "stats.json"):
        assert (again.path / name).read_bytes() == (vocab[0].path / name).read_bytes(), name


def test_tokenizer_pickles_for_ray_workers(vocab):
    import pickle

    tok = Tokenizer.load(vocab[0].path)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(["Ray workers get the model bytes."]) == tok.encode(["Ray workers get the model bytes."])


# ----------------------------------------------------------------------------------------------- tokenize

def _read_split(art, split):
    table = tokenize_stage.read_split(art.path / split)
    rows = np.asarray(table.column("input_ids").combine_chunks().flatten().to_numpy()).reshape(len(table), -1)
    return table, rows, table.column("length").to_numpy()


@pytest.mark.ray
def test_packed_sequences_are_framed_and_in_range(tokens, vocab, corpus):
    art, _ = tokens
    tok = Tokenizer.load(vocab[0].path)
    for split in ("train", "validation"):
        table, rows, lengths = _read_split(art, split)
        assert table.column_names == ["input_ids", "length", "doc_id", "doc_index"]
        assert table.schema.field("input_ids").type == pa.list_(pa.uint32(), TOKENIZE.max_seq_len)
        assert rows.shape[1] == TOKENIZE.max_seq_len and rows.dtype == np.uint32
        assert rows.max() < tok.vocab_size  # [MASK] and beyond never stored
        assert (rows[:, 0] == tok.cls_id).all()
        assert (rows[np.arange(len(rows)), lengths - 1] == tok.sep_id).all()
        positions = np.arange(TOKENIZE.max_seq_len)[None, :]
        assert ((rows == tok.pad_id) == (positions >= lengths[:, None])).all()  # padding only after the frame
        # Every document token is there exactly once: content = document ids + one [SEP] between neighbours.
        texts = pq.read_table(corpus.path / split, columns=["text"]).column("text").to_pylist()
        doc_ids = tok.encode(texts)
        content = rows[:, 1:][positions[:, 1:] < (lengths[:, None] - 1)]
        assert (content != tok.sep_id).sum() == sum(len(d) for d in doc_ids)
        # Provenance: a sequence's tokens up to its first [SEP] are a piece of the document its doc_id names.
        by_id = dict(zip(pq.read_table(corpus.path / split, columns=["doc_id"]).column(0).to_pylist(), doc_ids))
        for row, n, owner in zip(rows, lengths, table.column("doc_id").to_pylist()):
            content = row[1:n - 1].tolist()
            head = content[:content.index(tok.sep_id)] if tok.sep_id in content else content
            assert head == [] or _contains(by_id[owner], head), owner
        if split == "validation":  # corpus order: the first sequence starts with the first document
            first = doc_ids[0][:TOKENIZE.max_seq_len - 2]
            assert rows[0, 1:1 + len(first)].tolist() == first


def _contains(ids: list[int], piece: list[int]) -> bool:
    text, part = "," + ",".join(map(str, ids)) + ",", "," + ",".join(map(str, piece)) + ","
    return part in text


def test_two_sources_in_sorted_order_are_mixed_in_every_window(store, workdir, module_tracker, vocab, news_jsonl,
                                                                ray_local):
    """A corpus given source by source (news articles, then movie-review snippets) is consumed by pretraining
    (2 workers, its epoch order) with each source's share within 5 points of its overall share in every window
    of 5% of the sequences, while the tokenize artifact holds it in corpus order, sorted by source. Epoch 2
    differs."""
    from stages.finetune.kinds.sequence import rotten_tomatoes
    from stages.pretrain.data import batches_per_epoch, rank_order
    from tests.data_order import mixing_deviation

    news = [json.loads(line)["text"] for line in open(news_jsonl)][:1200]
    reviews = rotten_tomatoes().train.text_a[:6000]
    docs = [{"doc_id": f"news-{i}", "text": t} for i, t in enumerate(news)]
    docs += [{"doc_id": f"review-{i}", "text": t} for i, t in enumerate(reviews)]
    with store.building("corpus", "two-sources", {"stage": "corpus"}) as out:
        _write_corpus(out, docs, {"train": slice(0, None), "validation": slice(0, 40)})
    corpus = store.find("corpus", "two-sources")
    cfg = dataclasses.replace(TOKENIZE, max_seq_len=32, rows_per_shard=4_000)
    art, _ = build(store, workdir, module_tracker, tokenize_stage, cfg, {"corpus": corpus, "vocab": vocab[0]},
                   "tokens-two-sources")
    owners = np.array(tokenize_stage.read_split(art.path / "train", ["doc_id"]).column(0).to_pylist())
    assert set(owners) <= {d["doc_id"] for d in docs}  # provenance: every sequence names a corpus document
    source = np.char.startswith(owners.astype(str), "review").astype(int)  # (N,) in file order
    assert 0.1 < source.mean() < 0.5 and len(source) > 20_000

    n, world, micro = len(source), 2, 16
    def consumed(epoch: int) -> np.ndarray:  # step by step, rank 0's micro-batch then rank 1's
        per_rank = [rank_order(n, 0, epoch, r, world, micro).reshape(-1, micro) for r in range(world)]
        return np.stack(per_rank, axis=1).reshape(-1)
    order = consumed(0)
    assert len(order) == batches_per_epoch(n, world, micro) * world * micro
    assert mixing_deviation(source[order]) < 5
    packed = source  # the files hold the corpus order: sorted by source
    assert mixing_deviation(packed) > 40
    print(f"largest source-share gap in a 5% window: {mixing_deviation(packed):.1f} points in corpus order, "
          f"{mixing_deviation(source[order]):.2f} as pretraining consumes it ({len(order):,} sequences)")
    assert (consumed(1)[:len(order)] != order).mean() > 0.9


@pytest.mark.ray
def test_counts_match_the_data(tokens, corpus):
    art, result = tokens
    summary = json.loads((art.path / "tokens.json").read_text())
    for split, n_docs in (("train", TRAIN_DOCS), ("validation", VALIDATION_DOCS)):
        table, rows, lengths = _read_split(art, split)
        assert result.counts[f"{split}_documents"] == n_docs == summary["splits"][split]["documents"]
        assert result.counts[f"{split}_sequences"] == len(rows) == summary["splits"][split]["sequences"]
        assert result.counts[f"{split}_tokens"] == int((rows != 0).sum()) == summary["splits"][split]["tokens"]
        assert result.counts[f"{split}_padding"] == int((rows == 0).sum())
        for rel in summary["splits"][split]["files"]:
            assert rel in art.manifest["files"]
    # Bounded padding: at most one padded sequence per batch of documents.
    assert result.counts["train_sequences"] > 0 and result.metrics["train_padding_share"] < 0.2


@pytest.mark.ray
def test_tokenize_is_deterministic(tokens, store, workdir, module_tracker, corpus, vocab):
    again, _ = build(store, workdir, module_tracker, tokenize_stage, TOKENIZE,
                     {"corpus": corpus, "vocab": vocab[0]}, "tokens-b")
    first, second = tokens[0].manifest["files"], again.manifest["files"]
    assert first == second


def test_encoder_threads_do_not_change_the_shards(vocab, corpus, tmp_path):
    """An actor given several CPUs (fewer row groups than workers) encodes with several threads: same bytes."""
    tok = Tokenizer.load(vocab[0].path)
    shard = sorted((corpus.path / "train").glob("*.parquet"))[0]
    tables = []
    for threads in (1, 2):
        out = tmp_path / f"t{threads}"
        (out / "train").mkdir(parents=True)
        packer = tokenize_stage.PackDocuments(tok, TOKENIZE.max_seq_len, TOKENIZE.batch_size, 100, str(out), threads)
        files = [name for name, *_ in packer.tokenize_unit("train", str(shard), 0, 7)]
        assert files and all(name.startswith("train/part-00007-") for name in files)
        tables.append(pa.concat_tables([pa.ipc.open_file(str(out / name)).read_all() for name in files]))
    assert tables[0].equals(tables[1]) and tables[0].num_rows > 100  # rows_per_shard=100: several shards


def test_segment_pairs_for_sentence_order(store, workdir, module_tracker, corpus, vocab, ray_local):
    """tokenize.segment_pairs: a row is [CLS] A [SEP] B [SEP] of one document with a sop_label (about half
    swapped), or [CLS] sentence [SEP] with -100 when a window holds one sentence; same inputs, same bytes."""
    cfg = dataclasses.replace(TOKENIZE, segment_pairs=True)
    art, _ = build(store, workdir, module_tracker, tokenize_stage, cfg, {"corpus": corpus, "vocab": vocab[0]},
                   "tokens-sop")
    tok = Tokenizer.load(vocab[0].path)
    table = tokenize_stage.read_split(art.path / "train")
    ids = np.stack(table.column("input_ids").to_numpy(zero_copy_only=False))
    labels = table.column("sop_label").to_numpy()
    pairs = labels != -100
    assert set(np.unique(labels)) == {-100, 0, 1} and pairs.sum() > 100 and 0.4 < labels[pairs].mean() < 0.6
    assert (ids[:, 0] == tok.cls_id).all() and ((ids == tok.sep_id).sum(1) == np.where(pairs, 2, 1)).all()
    lengths = table.column("length").to_numpy()
    assert all(row[n - 1] == tok.sep_id and not row[n:].any() for row, n in zip(ids, lengths))
    again, _ = build(store, workdir, module_tracker, tokenize_stage, cfg, {"corpus": corpus, "vocab": vocab[0]},
                     "tokens-sop-2")
    assert tokenize_stage.read_split(again.path / "train").equals(table)


# ----------------------------------------------------------------------------------------------- bad input

def test_empty_train_split_is_one_clear_message(store, workdir, module_tracker, news_docs):
    with store.building("corpus", "empty-train", {}) as out:
        _write_corpus(out, news_docs, {"train": slice(0, 0), "validation": slice(0, 10)})
    empty = store.find("corpus", "empty-train")
    with pytest.raises(StageInputError) as err:
        build(store, workdir, module_tracker, vocab_stage, VOCAB, {"corpus": empty}, "vocab-empty")
    one_clear_line(err, "'train'", "no documents")
    assert store.find("vocab", "vocab-empty") is None


def test_too_large_vocab_is_one_clear_message(store, workdir, module_tracker, corpus):
    cfg = dataclasses.replace(VOCAB, vocab_size=60_000, sample_documents=20)
    with pytest.raises(StageInputError) as err:
        build(store, workdir, module_tracker, vocab_stage, cfg, {"corpus": corpus}, "vocab-too-big")
    one_clear_line(err, "vocab.vocab_size=60000", "at most", "lower vocab.vocab_size")


def test_corrupted_model_is_one_clear_message(vocab, tmp_path):
    broken = tmp_path / "vocab"
    shutil.copytree(vocab[0].path, broken)
    model = broken / "spm.model"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # still parses, perhaps: the manifest digest catches it
    model.write_bytes(bytes(data))
    with pytest.raises(StageInputError) as err:
        Tokenizer.load(broken)
    one_clear_line(err, "spm.model", "corrupt", "retrains")
    (broken / "manifest.json").unlink()  # without a manifest: a truncated file does not parse
    model.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(StageInputError) as err:
        Tokenizer.load(broken)
    one_clear_line(err, "spm.model", "corrupt")


def test_tokenize_rejects_corrupt_vocab_before_any_work(store, workdir, module_tracker, corpus, vocab, tmp_path):
    from core.artifacts import Artifact

    broken = tmp_path / "vocab"
    shutil.copytree(vocab[0].path, broken)
    (broken / "spm.model").write_bytes(b"not a model")
    with pytest.raises(StageInputError) as err:
        build(store, workdir, module_tracker, tokenize_stage, TOKENIZE,
              {"corpus": corpus, "vocab": Artifact("vocab", "broken", broken)}, "tokens-broken")
    one_clear_line(err, "corrupt")
