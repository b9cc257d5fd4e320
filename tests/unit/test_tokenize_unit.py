"""Packing and sampling logic of the vocab/tokenize stages, without Ray or SentencePiece training."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stages.tokenize import pack, to_table
from stages.vocab import doc_hashes, sample_threshold

CLS, SEP, PAD = 1, 2, 0


def test_pack_joins_documents_with_sep_and_frames_every_window():
    rows, lengths, first = pack([[10, 11, 12], [20, 21], [30]], max_seq_len=6, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    # stream: 10 11 12 SEP 20 21 SEP 30 (8 tokens) -> windows of 4
    assert rows.tolist() == [[CLS, 10, 11, 12, SEP, SEP],
                             [CLS, 20, 21, SEP, 30, SEP]]
    assert lengths.tolist() == [6, 6] and rows.dtype == np.uint32
    assert first.tolist() == [0, 1]  # the document each row's first content token belongs to


def test_pack_pads_only_the_last_window_after_its_sep():
    rows, lengths, first = pack([[5] * 7, [], [6]], max_seq_len=6, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    # stream: 5x7 SEP 6 (9 tokens); the empty document adds nothing
    assert rows.tolist() == [[CLS, 5, 5, 5, 5, SEP], [CLS, 5, 5, 5, SEP, SEP], [CLS, 6, SEP, PAD, PAD, PAD]]
    assert lengths.tolist() == [6, 6, 3]
    assert first.tolist() == [0, 0, 2]  # a window opening on the [SEP] after a document belongs to it


def test_pack_long_document_continues_and_nothing_is_lost():
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 1000, size=n).tolist() for n in (0, 1, 509, 510, 511, 2000, 3)]
    rows, lengths, first = pack(docs, max_seq_len=512, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert rows.shape[1] == 512 and (rows[:, 0] == CLS).all()
    for row, owner in zip(rows, first):  # a row's tokens up to its first [SEP] are a piece of its document
        head = row[1:][: list(row[1:]).index(SEP)]
        doc = "," + ",".join(map(str, docs[owner])) + ","
        assert "," + ",".join(map(str, head.tolist())) + "," in doc or len(head) == 0
    assert (rows[np.arange(len(rows)), lengths - 1] == SEP).all()
    content = np.concatenate([r[1:n - 1] for r, n in zip(rows, lengths)])
    expected = np.concatenate([np.r_[d, SEP] for d in docs if d])[:-1]
    assert content.tolist() == expected.tolist()
    assert (lengths[:-1] == 512).all()


def test_pack_empty_batch():
    rows, lengths, _ = pack([[], []], max_seq_len=8, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert rows.shape == (0, 8) and lengths.shape == (0,)


def test_to_table_schema_is_fixed_size_uint32():
    rows, lengths, _ = pack([[7, 8, 9]], max_seq_len=4, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    table = to_table(rows, lengths, ["doc-a", "doc-a"])
    assert table.schema.field("input_ids").type == pa.list_(pa.uint32(), 4)
    assert table.column("doc_id").to_pylist() == ["doc-a", "doc-a"]
    assert table.column("input_ids").to_pylist() == [[CLS, 7, 8, SEP], [CLS, 9, SEP, PAD]]
    assert table.column("length").to_pylist() == [4, 3]


def test_sample_is_independent_of_sharding_and_order(tmp_path):
    ids = [f"doc-{i}" for i in range(1000)]
    for name, part in (("a", ids[:300]), ("b", ids[300:])):
        pq.write_table(pa.table({"doc_id": part}), tmp_path / f"{name}.parquet")
    pq.write_table(pa.table({"doc_id": ids[::-1]}), tmp_path / "one.parquet")
    two_files = sample_threshold([tmp_path / "a.parquet", tmp_path / "b.parquet"], k=100, seed=3)
    one_file = sample_threshold([tmp_path / "one.parquet"], k=100, seed=3)
    assert two_files == one_file
    assert (doc_hashes(ids, seed=3) <= np.uint64(two_files)).sum() == 100
    assert sample_threshold([tmp_path / "one.parquet"], k=100, seed=4) != one_file
    assert sample_threshold([tmp_path / "one.parquet"], k=5000, seed=3) == int(doc_hashes(ids, 3).max())


def test_shard_writes_whole_record_batches_whatever_the_batches(tmp_path):
    from stages.tokenize import BATCH_ROWS, ShardWriter

    rng = np.random.default_rng(1)
    shard = None
    for _ in range(40):  # batches of 60-70 sequences, as the packer emits them
        rows, lengths, _ = pack([rng.integers(4, 100, size=int(n)).tolist() for n in rng.integers(50, 600, 80)],
                             max_seq_len=8, cls_id=CLS, sep_id=SEP, pad_id=PAD)
        table = to_table(rows[:65], lengths[:65], ["d"] * 65)
        shard = shard or ShardWriter(tmp_path, "part.arrow", table.schema, 0.0)
        shard.add(table)
    name, sequences, tokens, _ = shard.close()
    reader = pa.ipc.open_file(pa.memory_map(str(tmp_path / name)))
    sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    assert sequences == 40 * 65 == sum(sizes) and sizes[:-1] == [BATCH_ROWS] * (len(sizes) - 1)
    assert tokens == int(reader.read_all().column("length").to_numpy().sum())


def test_documents_are_packed_batch_size_at_a_time_however_many_are_read_at_once(tmp_path, monkeypatch):
    """PackDocuments reads and encodes many documents per call but packs `batch_size` at a time: its rows are
    `pack` of every batch_size documents in turn (a window never spans two batches), owners included - whether a
    read holds many packing batches or, under a small READ_BYTES (long documents), one."""
    import stages.tokenize as tokenize
    from core.tokenizer import Tokenizer
    from tests.released import lee_text, spm_model

    tok = Tokenizer.load(spm_model(tmp_path / "spm"))
    texts = [line for line in lee_text().splitlines() if line.strip()] * 4  # real text: the Lee corpus
    batch = 7
    assert len(texts) > tokenize.READ_DOCS // batch * batch  # more than one read, and reads that are not whole windows
    pq.write_table(pa.table({"doc_id": [f"d{i}" for i in range(len(texts))], "text": texts}), tmp_path / "c.parquet")
    rows, owners = [], []
    for start in range(0, len(texts), batch):
        r, _, first = pack(tok.encode_arrays(texts[start:start + batch]), 32, tok.cls_id, tok.sep_id, tok.pad_id)
        rows += r.tolist()
        owners += [f"d{start + i}" for i in first]
    for read_bytes in (tokenize.READ_BYTES, 1):
        monkeypatch.setattr(tokenize, "READ_BYTES", read_bytes)
        out = tmp_path / f"out-{read_bytes}"
        (out / "validation").mkdir(parents=True)
        packer = tokenize.PackDocuments(tok, max_seq_len=32, batch_size=batch, rows_per_shard=10**6, out=str(out))
        [(name, sequences, _, _)] = list(packer.tokenize_unit("validation", str(tmp_path / "c.parquet"), 0, 0))
        got = pa.ipc.open_file(str(out / name)).read_all()
        assert sequences == len(rows) and got.column("input_ids").to_pylist() == rows
        assert got.column("doc_id").to_pylist() == owners
