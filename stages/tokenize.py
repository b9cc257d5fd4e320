"""Tokenize stage: corpus shards -> packed, fixed-length uint32 token sequences, on Ray tasks.

Two passes, both fully parallel, and no token passes through Ray's object store (`run_tasks`). Pack: both splits
go through one pass of `pack_units` tasks over the corpus's row groups. Each task (one CPU each, at most
`TokenizeConfig.num_workers` at a time, never more than there are row groups: with fewer row groups each task takes
the CPUs of the missing ones and encodes with as many SentencePiece threads) builds a `PackDocuments` - the
SentencePiece model loads from bytes shipped with it in milliseconds, while an actor would need a worker process of
its own, seconds to start, where tasks run on the workers the earlier stages left warm - encodes up to READ_DOCS
documents per SentencePiece call, packs them `batch_size` at a time on numpy buffers and writes its shards itself
(to a staging folder); only shard names and counts come back. Shuffle: the train split is
rewritten as one seeded, uniform permutation of all its packed sequences, so that consecutive sequences come from
anywhere in the corpus, however it was ordered (a corpus assembled source by source would otherwise be trained on
source by source). Validation keeps corpus order (pretraining draws a seeded sample of it).

The shuffle is a file-based two-pass shuffle (an external sort by random key), chosen over Megatron's shuffle by
index: it keeps the artifact what pretraining already reads - Parquet shards whose every stretch mixes the whole
corpus, read block by block with one sequential read per block (`stages.pretrain.data`), resumable from the step -
whereas reading by index needs a memory-mappable fixed-row format and a random read per sequence, which on an
object store or NFS costs far more than one sequential rewrite here. Pass 1 (in the packing tasks): every staged
train sequence gets a uniform random 64-bit key, drawn by a generator seeded by (seed, unit, shard), and each
staged shard is written sorted by key. Pass 2 (`write_bucket`, a task per few output shards): output shard p holds the
keys in [p, p + 1) * 2^64 / P, a contiguous slice of every staged shard (found by binary search in its memory-mapped
key column), merged and sorted by key. Sorting by independent uniform keys is a uniform permutation, the keys
depend only on the input and seed, so the same input and seed give the same order; every byte is read and written
once per pass, and a task holds one output shard (about `rows_per_shard` sequences; the shards' sizes vary by
about the square root of that).
Like any Ray write to a path, the workdir must be reachable from every node (local disk on one node, NFS, ...).

Boundary policy (RoBERTa's FULL-SENTENCES packing, [SEP] between documents): within one batch of `batch_size`
documents, the documents' ids are concatenated with one [SEP] between consecutive documents, and that stream is
cut into windows of `max_seq_len - 2` tokens; each window becomes `[CLS] window [SEP]`. A document longer than a
window continues in the next one (nothing is truncated), empty documents are skipped, and the last window of a
batch is shorter: it is framed the same way and then padded with [PAD]=0 to `max_seq_len`. Packing never crosses
batch boundaries, so there is at most one padded sequence per batch of documents (for 256 news articles: under
0.5% padding), and memory stays bounded by one batch.

With `segment_pairs` (ALBERT's sentence-order prediction) rows are instead `[CLS] A [SEP] B [SEP]` pairs of one
document each (`stages.segment_pairs`: whole sentences, cut between two of them), padded to `max_seq_len`, with a
`sop_label` column (1: swapped, 0: in order, -100: a row of one sentence, no pair).

Output: train/ and validation/ Parquet shards with columns
  input_ids: fixed_size_list<uint32>[max_seq_len]  (uint32: 128K ids do not fit uint16)
  length:    int32, tokens before the padding ([CLS] and [SEP] included), so attention masks need no scan
  doc_id:    string, the corpus document the sequence's first token comes from (provenance)
  sop_label: int8, with segment_pairs only (1 swapped, 0 in order, -100 no pair)
train/part-<p>.parquet holds the p-th of P = ceil(sequences / rows_per_shard) stretches of the permutation;
validation shard i of corpus row group u is validation/part-<u>-<i>.parquet (at most `rows_per_shard` sequences).
The same inputs and seed give the same files. tokens.json (per split: documents, sequences, tokens, padding,
files) holds the counts the manifest records.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.tokenizer import Tokenizer
from stages.base import StageContext, StageResult
from stages.segment_pairs import SOP_COLUMN, SentenceEnds, document_rng, segment_pairs
from stages.vocab import SPLITS, split_files

if TYPE_CHECKING:
    from core.artifacts import Artifact
    from core.config import TokenizeConfig

VERSION = "5"

SUMMARY_FILE = "tokens.json"
STAGING = ".packed"  # the packed, not yet shuffled shards; removed before the artifact is complete
KEY = "key"  # the staged train shards' random sort key (uint64), dropped by the shuffle
ROW_GROUP_ROWS = 1024  # sequences per Parquet row group: 2 MiB of ids at 512 tokens
READ_DOCS = 1024  # documents read and encoded per call at most (rounded to whole packing batches) ...
READ_BYTES = 16 << 20  # ... and about this much text: long documents (books) are read a packing batch at a time
PROGRESS_S = 10.0  # seconds between a pass's progress lines


def pack(docs: Sequence[Sequence[int]], max_seq_len: int, cls_id: int, sep_id: int,
         pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack documents' ids into (n, max_seq_len) uint32 rows, their unpadded lengths, and for each row the index
    (into `docs`) of the document its first content token belongs to (see module docstring)."""
    width = max_seq_len - 2  # content tokens per sequence, between [CLS] and [SEP]
    sep = np.array([sep_id], dtype=np.int32)  # the dtype of sentencepiece's arrays: one cast at the end
    parts = [part for d in docs if len(d) for part in (d, sep)]
    if not parts:
        return np.empty((0, max_seq_len), dtype=np.uint32), np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
    stream = np.concatenate(parts[:-1]).astype(np.uint32, copy=False)  # (T,) documents joined by [SEP]
    n = -(-len(stream) // width)
    sizes = np.array([len(d) for d in docs])
    kept = np.flatnonzero(sizes)  # documents in the stream; a [SEP] counts as part of the document before it
    starts = np.cumsum(sizes[kept] + 1) - (sizes[kept] + 1)  # (D,) stream offset of each one's first token
    first_doc = kept[np.searchsorted(starts, np.arange(n) * width, side="right") - 1]  # (n,)
    rest = len(stream) - (n - 1) * width  # content tokens of the last, possibly short, window
    rows = np.full((n, max_seq_len), pad_id, dtype=np.uint32)  # (n, L)
    rows[:, 0] = cls_id
    rows[:n - 1, 1:-1] = stream[:(n - 1) * width].reshape(n - 1, width)  # (n-1, L-2)
    rows[:n - 1, -1] = sep_id
    rows[n - 1, 1:rest + 1] = stream[(n - 1) * width:]
    rows[n - 1, rest + 1] = sep_id
    lengths = np.full(n, max_seq_len, dtype=np.int32)
    lengths[-1] = rest + 2
    return rows, lengths, first_doc


def to_table(rows: np.ndarray, lengths: np.ndarray, doc_ids: Sequence[str],
             sop_labels: np.ndarray | None = None) -> pa.Table:
    """(n, L) uint32 rows -> the output schema: input_ids fixed_size_list<uint32>[L], length int32, doc_id string
    (and with segment pairs sop_label int8)."""
    ids = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), type=pa.uint32()), rows.shape[1])
    columns = {"input_ids": ids, "length": pa.array(lengths, type=pa.int32()),
               "doc_id": pa.array(doc_ids, type=pa.string())}
    if sop_labels is not None:
        columns[SOP_COLUMN] = pa.array(sop_labels, type=pa.int8())
    return pa.table(columns)


def take_rows(table: pa.Table, order: np.ndarray) -> pa.Table:
    """`table.take(order)` with the fixed-size `input_ids` gathered as a numpy (n, L) array: Arrow's take of a
    fixed-size list goes element by element: ~18x slower on 128-token rows, ~5% of the stage's CPU at 1M documents."""
    ids = table.column("input_ids")
    width = ids.type.list_size
    rows = ids.combine_chunks().flatten().to_numpy().reshape(-1, width)[order]
    index = pa.array(order)
    return pa.table({name: pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), width)
                     if name == "input_ids" else table.column(name).take(index) for name in table.column_names})


class PackDocuments:
    """Reads, tokenizes, packs and writes the work units of one task (`pack_units`).

    Each input row names one Parquet row group (a work unit); it is streamed in `batch_size`-document
    batches into Parquet shards of at most `rows_per_shard` sequences named after the unit, and returns one
    small row per shard (split, file, sequences, tokens, CPU seconds spent on it). Writing here rather than
    through `write_parquet` keeps token data out of the object store, needs no extra write processes, and gives
    names that depend only on the input (Ray's carry a random write uuid); a retried unit rewrites the same files.
    """

    def __init__(self, tokenizer: Tokenizer, max_seq_len: int, batch_size: int, rows_per_shard: int, out: str,
                 threads: int = 1, segment_pairs: bool = False, seed: int = 0):
        self.tok = tokenizer  # unpickled from its model bytes
        self.max_seq_len, self.batch_size, self.rows_per_shard = max_seq_len, batch_size, rows_per_shard
        self.out = Path(out)
        self.threads = threads
        self.segment_pairs, self.seed = segment_pairs, seed
        # ALBERT's segments are whole sentences: where this tokenizer's pieces end one
        self.sentence_ends = SentenceEnds.of(tokenizer.pieces()) if segment_pairs else None

    def __call__(self, units: dict[str, np.ndarray]) -> dict[str, list]:
        shards: dict[str, list] = {"split": [], "file": [], "sequences": [], "tokens": [], "cpu_seconds": []}
        for split, path, row_group, unit in zip(units["split"], units["path"], units["row_group"], units["unit"]):
            for shard in self.tokenize_unit(str(split), str(path), int(row_group), int(unit)):
                for key, value in zip(shards, (str(split), *shard)):
                    shards[key].append(value)
        return shards

    def packed_batches(self, path: str, row_group: int) -> Iterator[pa.Table]:
        """The row group's packed sequences, read and encoded several packing batches at a time (at most
        READ_DOCS documents and about READ_BYTES of text) and packed `batch_size` documents at a time (the packing
        boundary): reading, encoding and building a table per read keeps the per-call costs of Arrow and
        SentencePiece off every packing batch, and memory stays bounded by one read."""
        reader = pq.ParquetFile(path)
        size = self.batch_size
        meta = reader.metadata.row_group(row_group)
        per_doc = meta.total_byte_size / max(meta.num_rows, 1)  # uncompressed bytes of a row
        batches = max(1, min(READ_DOCS // size, int(READ_BYTES / (per_doc * size))))
        for batch in reader.iter_batches(batch_size=size * batches, row_groups=[row_group],
                                         columns=["doc_id", "text"]):
            texts = batch.column("text")
            texts = (pc.fill_null(texts, "") if texts.null_count else texts).to_pylist()  # fill_null copies
            ids = self.tok.encode_arrays(texts, num_threads=self.threads)  # SentencePiece's own thread pool
            if not ids:
                continue
            if self.segment_pairs:  # pairs are made document by document: no packing batch
                yield self.pair_table(batch.column("doc_id").to_pylist(), ids)
                continue
            packed = [pack(ids[s:s + size], self.max_seq_len, self.tok.cls_id, self.tok.sep_id, self.tok.pad_id)
                      for s in range(0, len(ids), size)]
            first = np.concatenate([p[2] + s for p, s in zip(packed, range(0, len(ids), size))])
            yield to_table(np.concatenate([p[0] for p in packed]), np.concatenate([p[1] for p in packed]),
                           batch.column("doc_id").take(pa.array(first)))

    def pair_table(self, doc_ids: list[str], ids: list[np.ndarray]) -> pa.Table:
        """tokenize.segment_pairs: every document's sentence-order pairs (`stages.segment_pairs`), one per row."""
        parts = [segment_pairs(d, self.max_seq_len, self.tok.cls_id, self.tok.sep_id, self.tok.pad_id,
                               document_rng(self.seed, doc_id), self.sentence_ends)
                 for doc_id, d in zip(doc_ids, ids)]
        rows, lengths, labels = (np.concatenate([p[i] for p in parts]) for i in range(3))
        owners = [doc_id for doc_id, p in zip(doc_ids, parts) for _ in range(len(p[1]))]
        return to_table(rows.reshape(-1, self.max_seq_len), lengths, owners, labels)

    def tokenize_unit(self, split: str, path: str, row_group: int,
                      unit: int) -> Iterator[tuple[str, int, int, float]]:
        """Write the unit's sequences as <split>/part-<unit>-<k>.parquet (train: .arrow, staged); yields (file,
        sequences, tokens, cpu s).

        Packed batches are buffered up to ROW_GROUP_ROWS sequences per Parquet row group (one row group per
        batch would repeat the vocabulary's dictionary page every ~80 sequences), so memory stays at one
        row group plus one batch whatever `rows_per_shard` is.
        """
        shard: ShardWriter | None = None
        k, cpu = 0, time.process_time()  # a shard's CPU time includes encoding its first batch
        for table in self.packed_batches(path, row_group):
            while len(table):
                if shard is None and split == "train":  # staged for the shuffle, sorted by a seeded random key
                    shard = StagedWriter(self.out, f"train/part-{unit:05d}-{k:03d}.arrow", (self.seed, unit, k), cpu)
                elif shard is None:
                    shard = ShardWriter(self.out, f"{split}/part-{unit:05d}-{k:03d}.parquet", table.schema, cpu)
                take = min(len(table), self.rows_per_shard - shard.rows)
                shard.add(table.slice(0, take))
                table = table.slice(take)
                if shard.rows == self.rows_per_shard:
                    yield shard.close()
                    shard, k, cpu = None, k + 1, time.process_time()
        if shard is not None:
            yield shard.close()


class ShardWriter:
    """One output Parquet file being written: whole row groups of ROW_GROUP_ROWS sequences, its counts and CPU time."""

    def __init__(self, out: Path, name: str, schema: pa.Schema, cpu_start: float):
        self.name, self.rows, self.tokens, self.cpu = name, 0, 0, cpu_start
        # Dictionary encoding alone already packs ids to ~log2(vocab) bits; snappy on top saved no
        # bytes on news text but doubled the write's CPU time (~10% of the encode's).
        self.writer = pq.ParquetWriter(out / name, schema, compression="none")
        self.pending: list[pa.Table] = []

    def add(self, part: pa.Table) -> None:
        self.pending.append(part)
        self.rows += len(part)
        self.tokens += int(pc.sum(part.column("length")).as_py())
        if sum(len(t) for t in self.pending) >= ROW_GROUP_ROWS:
            table = pa.concat_tables(self.pending)
            whole = len(table) // ROW_GROUP_ROWS * ROW_GROUP_ROWS
            self.writer.write_table(table.slice(0, whole), row_group_size=ROW_GROUP_ROWS)
            self.pending = [table.slice(whole)]

    def close(self) -> tuple[str, int, int, float]:
        if sum(len(t) for t in self.pending):
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=ROW_GROUP_ROWS)
        self.writer.close()
        return self.name, self.rows, self.tokens, time.process_time() - self.cpu


class StagedWriter:
    """One staged train shard (pass 1 of the shuffle): its sequences, each with a uniform random uint64 KEY drawn
    by a generator seeded by `seed` (the stage's seed, the unit, the shard), written sorted by key as one Arrow IPC
    record batch - memory-mapped back by the shuffle without decoding, the key column zero-copy. Memory: the shard
    (at most `rows_per_shard` sequences)."""

    def __init__(self, out: Path, name: str, seed: tuple[int, int, int], cpu_start: float):
        self.path, self.name, self.seed = out / name, name, seed
        self.rows, self.tokens, self.cpu = 0, 0, cpu_start
        self.pending: list[pa.Table] = []

    def add(self, part: pa.Table) -> None:
        self.pending.append(part)
        self.rows += len(part)
        self.tokens += int(pc.sum(part.column("length")).as_py())

    def close(self) -> tuple[str, int, int, float]:
        table = pa.concat_tables(self.pending)
        keys = np.random.default_rng(list(self.seed)).bit_generator.random_raw(len(table)).astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        table = take_rows(table, order).append_column(KEY, pa.array(keys[order])).combine_chunks()
        with pa.ipc.new_file(str(self.path), table.schema) as writer:
            writer.write_table(table, max_chunksize=max(len(table), 1))
        return self.name, self.rows, self.tokens, time.process_time() - self.cpu


def read_staged(path: str) -> pa.Table:
    """A staged (.arrow) train shard, memory-mapped (its buffers keep the mapping open)."""
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def pack_units(units: dict[str, Sequence], **kwargs) -> dict[str, list]:
    """One pack task: `PackDocuments(**kwargs)` over its work units (columns split, path, row_group, unit)."""
    return PackDocuments(**kwargs)(units)


def num_workers(cfg: TokenizeConfig) -> int:
    import ray

    if cfg.num_workers is not None:
        return cfg.num_workers
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def largest_node_cpus() -> int:
    """CPUs of the biggest live node: the most one task can reserve."""
    import ray

    return max([int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")] or [1])


def row_groups(files: dict[str, Sequence[Path]]) -> list[dict]:
    """One work unit per Parquet row group, split by split in file order, numbered."""
    units = [{"split": split, "path": str(f), "row_group": i}
             for split, paths in files.items() for f in paths for i in range(pq.ParquetFile(f).num_row_groups)]
    return [dict(u, unit=n) for n, u in enumerate(units)]


def run_tasks(fn, calls: list[list[dict]], num_cpus: int, concurrency: int, what: str, **kwargs) -> list[dict]:
    """`fn(items as columns, **kwargs)` as one Ray task per call, `num_cpus` each and at most `concurrency` at a
    time; their returned columns joined into rows; a line of progress every PROGRESS_S seconds.

    Ray tasks rather than a Ray Data pipeline: both passes move no data through Ray (every task reads and writes
    files itself and returns a few counts), so a Dataset would add only its streaming executor's start and polling
    (bench.scale measures the stage both ways)."""
    import ray

    remote = ray.remote(fn).options(num_cpus=num_cpus)
    shared = {k: ray.put(v) for k, v in kwargs.items()}  # shipped once, not once per task
    queue = iter(calls)

    def submit(items: list[dict]):
        return remote.remote({k: [c[k] for c in items] for k in items[0]}, **shared)

    pending = [submit(items) for _, items in zip(range(concurrency), queue)]
    rows, done, said = [], 0, time.monotonic()
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        pending += [submit(items) for _, items in zip(ready, queue)]
        for columns in ray.get(ready):
            rows += [dict(zip(columns, values)) for values in zip(*columns.values())]
        done += len(ready)
        if pending and time.monotonic() - said >= PROGRESS_S:
            print(f"[tokenize] {what}: {done}/{len(calls)} tasks done", flush=True)
            said = time.monotonic()
    return rows


def tokenize_splits(files: dict[str, Sequence[Path]], tok: Tokenizer, cfg: TokenizeConfig, workers: int,
                    out: Path) -> list[dict]:
    """Row groups -> tasks (read, tokenize, pack, write out/<split>/) -> one row per shard, in input order.

    The tasks read their row groups themselves instead of behind `read_parquet`, which would add a pass (and a
    file listing task) in front of them. One pass for both splits.
    """
    for split in files:
        (out / split).mkdir()
    units = row_groups(files)
    # Workers sized to cores: a task per unit at most, and when units are fewer than workers each task
    # encodes with the threads (and CPUs) of the ones not started. Several units per task (about four
    # tasks per worker) keep Ray's per-task scheduling out of the way; units are dealt out in turn, so the
    # tasks get alike shares of big and small row groups.
    tasks = min(workers, len(units))
    threads = max(1, min(workers // tasks, largest_node_cpus()))
    calls = min(len(units), 4 * tasks)
    shards = run_tasks(pack_units, [units[k::calls] for k in range(calls)], threads, tasks, "packed",
                       tokenizer=tok, max_seq_len=cfg.max_seq_len, batch_size=cfg.batch_size,
                       rows_per_shard=cfg.rows_per_shard, out=str(out), threads=threads,
                       segment_pairs=cfg.segment_pairs, seed=cfg.seed)
    return sorted(shards, key=lambda shard: shard["file"])  # names sort in input order


def bucket_bounds(bucket: int, buckets: int) -> tuple[int, int]:
    """[lo, hi) of output shard `bucket`'s keys: the bucket-th of `buckets` equal parts of [0, 2^64)."""
    return (bucket << 64) // buckets, ((bucket + 1) << 64) // buckets


def write_bucket(items: dict[str, Sequence], staged: list[str], buckets: int, out: str) -> dict[str, list]:
    """Pass 2 of the shuffle, one output shard per item: its key range's slice of every staged shard (each sorted by
    key, so the slice is contiguous), merged and sorted by key -> train/part-<bucket>.parquet. The staged shards
    are opened (memory-mapped) once per call, not once per output shard: a call takes several consecutive ones."""
    shards: dict[str, list] = {"split": [], "file": [], "sequences": [], "tokens": [], "cpu_seconds": []}
    tables = [read_staged(path) for path in staged]
    keyed = [(t, t.column(KEY).chunk(0).to_numpy() if t.num_rows else np.zeros(0, np.uint64)) for t in tables]
    for bucket in map(int, items["bucket"]):
        cpu = time.process_time()
        lo, hi = bucket_bounds(bucket, buckets)
        parts = []
        for table, keys in keyed:
            a = int(np.searchsorted(keys, np.uint64(lo), "left"))
            b = len(keys) if hi >= 1 << 64 else int(np.searchsorted(keys, np.uint64(hi), "left"))
            if b > a:
                parts.append(table.slice(a, b - a))
        if not parts:
            continue
        rows = pa.concat_tables(parts)
        rows = take_rows(rows.drop_columns([KEY]), np.argsort(rows.column(KEY).to_numpy(), kind="stable"))
        writer = ShardWriter(Path(out), f"train/part-{bucket:05d}.parquet", rows.schema, cpu)
        writer.add(rows)
        for key, value in zip(shards, ("train", *writer.close())):
            shards[key].append(value)
    return shards


def shuffle_train(shards: list[dict], staged: Path, out: Path, cfg: TokenizeConfig) -> list[dict]:
    """Write the staged train shards (each sorted by its random keys) to out/train/ as P = ceil(sequences /
    rows_per_shard) shards of consecutive key ranges: together, all sequences sorted by key (module docstring).

    A Ray task per few consecutive output shards, reading the staged shards from the shared staging folder;
    nothing but shard names and counts goes through the object store, and the driver holds nothing per sequence."""
    (out / "train").mkdir()
    paths = [str(staged / s["file"]) for s in shards if int(s["sequences"])]
    total = sum(int(s["sequences"]) for s in shards)
    if not total:
        return []
    buckets = -(-total // cfg.rows_per_shard)
    calls = min(buckets, 4 * num_workers(cfg))  # about four per worker: each opens every staged shard once
    per = -(-buckets // calls)
    groups = [[{"bucket": p} for p in range(k, min(k + per, buckets))] for k in range(0, buckets, per)]
    rows = run_tasks(write_bucket, groups, 1, num_workers(cfg), "shuffled", staged=paths, buckets=buckets,
                     out=str(out))
    return sorted(rows, key=lambda shard: shard["file"])


def summarize(files: Sequence[Path], shards: list[dict], max_seq_len: int) -> dict:
    sequences = sum(int(s["sequences"]) for s in shards)
    tokens = sum(int(s["tokens"]) for s in shards)
    return {
        "documents": sum(pq.ParquetFile(f).metadata.num_rows for f in files),
        "sequences": sequences,
        "tokens": tokens,
        "padding": sequences * max_seq_len - tokens,
        "files": [str(s["file"]) for s in shards],
    }


def run(cfg: TokenizeConfig, *, inputs: dict[str, Artifact], out: Path, ctx: StageContext) -> StageResult:
    tok = Tokenizer.load(inputs["vocab"].path)
    corpus_files = {split: split_files(inputs["corpus"], split, ["text"]) for split in SPLITS}  # fail before work
    workers = num_workers(cfg)
    summary = {"max_seq_len": cfg.max_seq_len, "dtype": "uint32", "vocab_size": tok.vocab_size,
               "tokenizer_length": len(tok), "splits": {}}  # nothing machine-dependent: same inputs, same bytes
    staged = out / STAGING
    staged.mkdir()
    clock = time.perf_counter()
    packed = tokenize_splits(corpus_files, tok, cfg, workers, staged)
    (staged / "validation").rename(out / "validation")
    pack_s, clock = time.perf_counter() - clock, time.perf_counter()
    train = shuffle_train([s for s in packed if s["split"] == "train"], staged, out, cfg)
    shutil.rmtree(staged)
    shuffle_s = time.perf_counter() - clock
    shards = train + [s for s in packed if s["split"] == "validation"]
    for split in SPLITS:
        mine = [s for s in shards if s["split"] == split]
        summary["splits"][split] = summarize(corpus_files[split], mine, cfg.max_seq_len)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")

    splits = summary["splits"]
    counts = {f"{split}_{k}": splits[split][k] for split in SPLITS for k in ("documents", "sequences", "tokens",
                                                                             "padding")}
    train = splits["train"]
    return StageResult(
        metrics={"train_padding_share": train["padding"] / max(train["sequences"] * cfg.max_seq_len, 1),
                 "train_tokens_per_document": train["tokens"] / max(train["documents"], 1),
                 "num_workers": workers, "time_pack_s": round(pack_s, 3), "time_shuffle_s": round(shuffle_s, 3),
                 # CPU time stays out of tokens.json (it would change the artifact's bytes from run to run)
                 "tokens_per_actor_cpu_second": sum(int(s["tokens"]) for s in packed)
                 / max(sum(float(s["cpu_seconds"]) for s in packed), 1e-9)},
        counts=counts,
        log_files=(SUMMARY_FILE,),
        summary={"tokens": f"{train['sequences']:,} train sequences x {cfg.max_seq_len} "
                           f"({train['tokens']:,} tokens), {splits['validation']['sequences']:,} validation"},
    )
