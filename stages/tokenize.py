"""Tokenize stage: corpus shards -> packed, fixed-length uint32 token sequences, on Ray tasks.

One pass, fully parallel, and no token passes through Ray's object store (`run_tasks`): both splits go through
`pack_units` tasks over the corpus's row groups. Each task (one CPU each, at most `TokenizeConfig.num_workers` at a
time, never more than there are row groups: with fewer row groups each task takes the CPUs of the missing ones and
encodes with as many SentencePiece threads) builds a `PackDocuments` - the SentencePiece model loads from bytes
shipped with it in milliseconds, while an actor would need a worker process of its own, seconds to start, where
tasks run on the workers the earlier stages left warm - encodes up to READ_DOCS documents per SentencePiece call,
packs them `batch_size` at a time on numpy buffers and writes its shards itself; only shard names and counts come
back.

The sequences are written in corpus order. The global shuffle is pretraining's, by index (as Megatron-LM does):
the shards are Arrow IPC files of fixed-size rows, memory-mapped by every rank, and each epoch draws one seeded
permutation of all sequences and reads its rows by index (`stages.pretrain.data`). So consecutive sequences come
from anywhere in the corpus however it was ordered (a corpus assembled source by source would otherwise be trained
on source by source), every epoch in a different order, and this stage reads and writes the data once. The
alternative, a file-based two-pass shuffle here (an external sort by seeded random key), writes every train byte a
second time and fixes one order for all epochs. What shuffle by index asks of storage: a random read of one row
(`max_seq_len` x 4 bytes) per sequence, through the page cache of the node's memory map - local disk, or a
network file system with client-side caching, as for Megatron-LM's indexed datasets.
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

Output: train/ and validation/ Arrow IPC files, uncompressed (a memory map reads them without decoding), in
record batches of at most BATCH_ROWS sequences, with columns
  input_ids: fixed_size_list<uint32>[max_seq_len]  (uint32: 128K ids do not fit uint16)
  length:    int32, tokens before the padding ([CLS] and [SEP] included), so attention masks need no scan
  doc_id:    string, the corpus document the sequence's first token comes from (provenance)
  sop_label: int8, with segment_pairs only (1 swapped, 0 in order, -100 no pair)
  doc_index: fixed_size_list<uint16>[max_seq_len], the document of each token within its row (0 = the row's first;
             [CLS] goes with the first, a [SEP] with the document before it, padding with the last; all 0 for
             segment pairs), so pretraining can keep attention inside documents (`pretrain.document_mask`). Always
             recorded, whatever pretraining asks: one token artifact serves both settings, and the pretrain option
             does not reach into this stage's config (and id). uint16: a document takes at least 2 tokens (its
             [SEP]), so a row holds at most max_seq_len / 2 of them. Shards written before it lack the column.
  source:    uint8, with named corpus sources only: the row's source, its position in the list (the first byte of
             its documents' ids). Documents of different sources are never packed into one row (each read's
             documents are packed source by source), so a row belongs to one source, and the shards' schema
             metadata `sources` holds the corpus's sources.json (names, weights, epochs) for pretraining's blend.
Shard i of corpus row group u is <split>/part-<u>-<i>.arrow (at most `rows_per_shard` sequences): the files in
name order are the split in corpus order, and a sequence's index (what a pretraining permutation draws) is its
position there. The same inputs give the same files. tokens.json (per split: documents, sequences, tokens,
padding, files; with named sources also `sources`, per source its sequences and tokens) holds the counts the
manifest records.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.tokenizer import Tokenizer
from stages.base import StageContext, StageResult
from stages.corpus import by_source
from stages.segment_pairs import SOP_COLUMN, SentenceEnds, document_rng, segment_pairs
from stages.vocab import SPLITS, split_files

if TYPE_CHECKING:
    from core.artifacts import Artifact
    from core.config import TokenizeConfig

VERSION = "7"
DOC_INDEX_COLUMN = "doc_index"
SOURCE_COLUMN = "source"
SOURCES_METADATA = b"sources"

SUMMARY_FILE = "tokens.json"
BATCH_ROWS = 1024  # sequences per Arrow record batch: 2 MiB of ids at 512 tokens
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


def row_documents(docs: Sequence[Sequence[int]], max_seq_len: int) -> np.ndarray:
    """(n, max_seq_len) uint16: for the rows `pack` makes of `docs`, each token's document counted from the row's
    first (the `doc_index` column; see the module docstring)."""
    sizes = np.array([len(d) for d in docs], dtype=np.int64)
    kept = sizes[sizes > 0]
    if not len(kept):
        return np.empty((0, max_seq_len), dtype=np.uint16)
    width = max_seq_len - 2
    stream = np.repeat(np.arange(len(kept)), kept + 1)[:-1]  # (T,) document of each stream token, [SEP]s included
    n = -(-len(stream) // width)
    content = np.full(n * width, stream[-1])  # the last window's padding goes with the last document
    content[:len(stream)] = stream
    content = content.reshape(n, width)
    out = np.concatenate([content[:, :1], content, content[:, -1:]], axis=1)  # [CLS] and [SEP] frame each window
    return (out - out[:, :1]).astype(np.uint16)


def source_of(doc_ids: pa.Array) -> np.ndarray:
    """The source rank of documents of named sources: the first byte of their ids (`stages.corpus.ingest`)."""
    return np.array([int(d[:2], 16) for d in doc_ids.to_pylist()], dtype=np.uint8)


def to_table(rows: np.ndarray, lengths: np.ndarray, doc_ids: Sequence[str],
             sop_labels: np.ndarray | None = None, doc_index: np.ndarray | None = None,
             sources: bytes = b"") -> pa.Table:
    """(n, L) uint32 rows -> the output schema: input_ids fixed_size_list<uint32>[L], length int32, doc_id string
    (and with segment pairs sop_label int8; with doc_index (n, L) the doc_index column; with `sources`, the
    corpus's sources.json, the source column and the schema metadata)."""
    ids = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), type=pa.uint32()), rows.shape[1])
    columns = {"input_ids": ids, "length": pa.array(lengths, type=pa.int32()),
               "doc_id": pa.array(doc_ids, type=pa.string())}
    if sop_labels is not None:
        columns[SOP_COLUMN] = pa.array(sop_labels, type=pa.int8())
    if doc_index is not None:
        columns[DOC_INDEX_COLUMN] = pa.FixedSizeListArray.from_arrays(
            pa.array(doc_index.reshape(-1), type=pa.uint16()), rows.shape[1])
    if sources:
        columns[SOURCE_COLUMN] = pa.array(source_of(columns["doc_id"]), type=pa.uint8())
        return pa.table(columns).replace_schema_metadata({SOURCES_METADATA: sources})
    return pa.table(columns)


class PackDocuments:
    """Reads, tokenizes, packs and writes the work units of one task (`pack_units`).

    Each input row names one Parquet row group of the corpus (a work unit); it is read (`reads`), encoded, packed
    (`packed`) and written (`write_unit`) into Arrow shards of at most `rows_per_shard` sequences named after the
    unit, and returns one small row per shard (split, file, sequences, tokens, CPU seconds spent on it). Writing
    here rather than through Ray Data's writers keeps token data out of the object store, needs no extra write
    processes, and gives names that depend only on the input (Ray's carry a random write uuid), so a retried unit
    rewrites the same files and the name order is the corpus order.
    """

    def __init__(self, tokenizer: Tokenizer, max_seq_len: int, batch_size: int, rows_per_shard: int, out: str,
                 threads: int = 1, segment_pairs: bool = False, seed: int = 0, sources: bytes = b""):
        self.tok = tokenizer  # unpickled from its model bytes
        self.max_seq_len, self.batch_size, self.rows_per_shard = max_seq_len, batch_size, rows_per_shard
        self.out = Path(out)
        self.threads = threads
        self.segment_pairs, self.seed = segment_pairs, seed
        self.sources = sources  # the corpus's sources.json with named sources, else empty
        self.by_source: dict[str, np.ndarray] = {}  # per shard written: (2, S) sequences and tokens per source
        # ALBERT's segments are whole sentences: where this tokenizer's pieces end one
        self.sentence_ends = SentenceEnds.of(tokenizer.pieces()) if segment_pairs else None

    def __call__(self, units: dict[str, np.ndarray]) -> dict[str, list]:
        shards: dict[str, list] = {"split": [], "file": [], "sequences": [], "tokens": [], "cpu_seconds": [],
                                   "source_sequences": [], "source_tokens": []}
        for split, path, row_group, unit in zip(units["split"], units["path"], units["row_group"], units["unit"]):
            for shard in self.tokenize_unit(str(split), str(path), int(row_group), int(unit)):
                per_source = self.by_source[shard[0]]
                for key, value in zip(shards, (str(split), *shard, *per_source.tolist())):
                    shards[key].append(value)
        return shards

    def packed_batches(self, path: str, row_group: int) -> Iterator[pa.Table]:
        """The row group's packed sequences, a table per read (`reads`): reading, encoding and building a table
        per read keeps the per-call costs of Arrow and SentencePiece off every packing batch."""
        for doc_ids, texts in self.reads(path, row_group):
            ids = self.tok.encode_arrays(texts, num_threads=self.threads)  # SentencePiece's own thread pool
            if ids:
                yield self.packed(doc_ids, ids)

    def reads(self, path: str, row_group: int) -> Iterator[tuple[pa.Array, list[str]]]:
        """(doc_id, text) of the row group, several packing batches at a time: at most READ_DOCS documents and
        about READ_BYTES of text, so memory stays bounded by one read however long the documents are."""
        reader = pq.ParquetFile(path)
        size = self.batch_size
        meta = reader.metadata.row_group(row_group)
        per_doc = meta.total_byte_size / max(meta.num_rows, 1)  # uncompressed bytes of a row
        batches = max(1, min(READ_DOCS // size, int(READ_BYTES / (per_doc * size))))
        for batch in reader.iter_batches(batch_size=size * batches, row_groups=[row_group],
                                         columns=["doc_id", "text"]):
            texts = batch.column("text")
            yield batch.column("doc_id"), (pc.fill_null(texts, "") if texts.null_count else texts).to_pylist()

    def packed(self, doc_ids: pa.Array, ids: list[np.ndarray]) -> pa.Table:
        """One read's encoded documents packed `batch_size` at a time (the packing boundary), as one table; with
        named sources, source by source (in the order of their ranks), so that no row mixes two."""
        if self.segment_pairs:  # pairs are made document by document: no packing batch
            return self.pair_table(doc_ids.to_pylist(), ids)
        if self.sources:
            ranks = source_of(doc_ids)
            groups = [np.flatnonzero(ranks == r) for r in np.unique(ranks)]
            return pa.concat_tables([self.packed_one(doc_ids.take(pa.array(g)), [ids[i] for i in g])
                                     for g in groups])
        return self.packed_one(doc_ids, ids)

    def packed_one(self, doc_ids: pa.Array, ids: list[np.ndarray]) -> pa.Table:
        size = self.batch_size
        packed = [pack(ids[s:s + size], self.max_seq_len, self.tok.cls_id, self.tok.sep_id, self.tok.pad_id)
                  for s in range(0, len(ids), size)]
        first = np.concatenate([p[2] + s for p, s in zip(packed, range(0, len(ids), size))])
        doc_index = np.concatenate([row_documents(ids[s:s + size], self.max_seq_len) for s in range(0, len(ids), size)])
        return to_table(np.concatenate([p[0] for p in packed]), np.concatenate([p[1] for p in packed]),
                        doc_ids.take(pa.array(first)), doc_index=doc_index, sources=self.sources)

    def pair_table(self, doc_ids: list[str], ids: list[np.ndarray]) -> pa.Table:
        """tokenize.segment_pairs: every document's sentence-order pairs (`stages.segment_pairs`), one per row."""
        parts = [segment_pairs(d, self.max_seq_len, self.tok.cls_id, self.tok.sep_id, self.tok.pad_id,
                               document_rng(self.seed, doc_id), self.sentence_ends)
                 for doc_id, d in zip(doc_ids, ids)]
        rows, lengths, labels = (np.concatenate([p[i] for p in parts]) for i in range(3))
        owners = [doc_id for doc_id, p in zip(doc_ids, parts) for _ in range(len(p[1]))]
        rows = rows.reshape(-1, self.max_seq_len)
        return to_table(rows, lengths, owners, labels, doc_index=np.zeros(rows.shape, dtype=np.uint16),
                        sources=self.sources)

    def tokenize_unit(self, split: str, path: str, row_group: int,
                      unit: int) -> Iterator[tuple[str, int, int, float]]:
        """Write the unit's sequences as <split>/part-<unit>-<k>.arrow; yields (file, sequences, tokens, cpu s)."""
        return self.write_unit(split, unit, self.packed_batches(path, row_group))

    def write_unit(self, split: str, unit: int, tables: Iterator[pa.Table]) -> Iterator[tuple[str, int, int, float]]:
        """`tables` (a unit's packed sequences) cut into shards of at most `rows_per_shard`; yields what
        `tokenize_unit` does."""
        shard: ShardWriter | None = None
        k, cpu = 0, time.process_time()  # a shard's CPU time includes encoding its first batch
        for table in tables:
            while len(table):
                if shard is None:
                    shard = ShardWriter(self.out, f"{split}/part-{unit:05d}-{k:03d}.arrow", table.schema, cpu)
                take = min(len(table), self.rows_per_shard - shard.rows)
                shard.add(table.slice(0, take))
                table = table.slice(take)
                if shard.rows == self.rows_per_shard:
                    self.by_source[shard.name] = shard.by_source
                    yield shard.close()
                    shard, k, cpu = None, k + 1, time.process_time()
        if shard is not None:
            self.by_source[shard.name] = shard.by_source
            yield shard.close()


class ShardWriter:
    """One output shard being written: an Arrow IPC file of whole record batches of BATCH_ROWS sequences (packed
    batches are buffered up to that: a record batch per packed batch would cost the reader an index entry per ~80
    sequences), its counts and CPU time. Memory: one record batch plus one packed batch, whatever
    `rows_per_shard` is."""

    def __init__(self, out: Path, name: str, schema: pa.Schema, cpu_start: float):
        self.name, self.rows, self.tokens, self.cpu = name, 0, 0, cpu_start
        self.by_source = np.zeros((2, 0), np.int64)  # sequences and tokens per source rank (named sources)
        self.writer = pa.ipc.new_file(str(out / name), schema)  # uncompressed: memory-mapped without decoding
        self.pending: list[pa.Table] = []

    def add(self, part: pa.Table) -> None:
        self.pending.append(part)
        self.rows += len(part)
        self.tokens += int(pc.sum(part.column("length")).as_py())
        if SOURCE_COLUMN in part.column_names:
            rank = part.column(SOURCE_COLUMN).to_numpy().astype(np.int64)
            n = max(self.by_source.shape[1], int(rank.max(initial=0)) + 1)
            add = np.stack([np.bincount(rank, minlength=n),
                            np.bincount(rank, weights=part.column("length").to_numpy(), minlength=n).astype(np.int64)])
            add[:, :self.by_source.shape[1]] += self.by_source
            self.by_source = add
        if sum(len(t) for t in self.pending) >= BATCH_ROWS:
            table = pa.concat_tables(self.pending)
            whole = len(table) // BATCH_ROWS * BATCH_ROWS
            # one record batch per chunk: the packed batches' chunks are combined first
            self.writer.write_table(table.slice(0, whole).combine_chunks(), max_chunksize=BATCH_ROWS)
            self.pending = [table.slice(whole)]

    def close(self) -> tuple[str, int, int, float]:
        if sum(len(t) for t in self.pending):
            self.writer.write_table(pa.concat_tables(self.pending).combine_chunks(), max_chunksize=BATCH_ROWS)
        self.writer.close()
        return self.name, self.rows, self.tokens, time.process_time() - self.cpu


def read_split(folder: Path, columns: Sequence[str] | None = None) -> pa.Table:
    """A split of the artifact (its folder) as one table in corpus order, memory-mapped: for inspection and
    benchmarks; pretraining reads rows by index (`stages.pretrain.data`)."""
    import pyarrow.dataset as pads

    files = sorted(str(p) for p in Path(folder).glob("*.arrow"))
    return pads.dataset(files, format="arrow").to_table(columns=None if columns is None else list(columns))


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

    Ray tasks rather than a Ray Data pipeline: the stage moves no data through Ray (every task reads and writes
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
                    out: Path, sources: bytes = b"") -> list[dict]:
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
                       segment_pairs=cfg.segment_pairs, seed=cfg.seed, sources=sources)
    return sorted(shards, key=lambda shard: shard["file"])  # names sort in input order


def summarize(files: Sequence[Path], shards: list[dict], max_seq_len: int, names: Sequence[str] = ()) -> dict:
    sequences = sum(int(s["sequences"]) for s in shards)
    tokens = sum(int(s["tokens"]) for s in shards)
    out = {
        "documents": sum(pq.ParquetFile(f).metadata.num_rows for f in files),
        "sequences": sequences,
        "tokens": tokens,
        "padding": sequences * max_seq_len - tokens,
        "files": [str(s["file"]) for s in shards],
    }
    if names:
        per = np.zeros((2, len(names)), np.int64)
        for shard in shards:
            for row, key in enumerate(("source_sequences", "source_tokens")):
                per[row, :len(shard[key])] += shard[key]
        out["sources"] = [{"name": n, "sequences": int(per[0, r]), "tokens": int(per[1, r])}
                          for r, n in enumerate(names)]
    return out


def run(cfg: TokenizeConfig, *, inputs: dict[str, Artifact], out: Path, ctx: StageContext) -> StageResult:
    tok = Tokenizer.load(inputs["vocab"].path)
    corpus_files = {split: split_files(inputs["corpus"], split, ["text"]) for split in SPLITS}  # fail before work
    named = by_source.load(inputs["corpus"].path)  # the named sources, or None for one unnamed source
    names = [s["name"] for s in named or ()]
    workers = num_workers(cfg)
    summary = {"max_seq_len": cfg.max_seq_len, "dtype": "uint32", "vocab_size": tok.vocab_size,
               "tokenizer_length": len(tok), "splits": {}}  # nothing machine-dependent: same inputs, same bytes
    clock = time.perf_counter()
    shards = tokenize_splits(corpus_files, tok, cfg, workers, out, json.dumps(named).encode() if named else b"")
    pack_s = time.perf_counter() - clock
    for split in SPLITS:
        mine = [s for s in shards if s["split"] == split]
        summary["splits"][split] = summarize(corpus_files[split], mine, cfg.max_seq_len, names)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")

    splits = summary["splits"]
    counts = {f"{split}_{k}": splits[split][k] for split in SPLITS for k in ("documents", "sequences", "tokens",
                                                                             "padding")}
    for src in splits["train"].get("sources", ()):  # per named source: in the manifest and the lineage
        counts[f"train_sequences.{src['name']}"] = src["sequences"]
        counts[f"train_tokens.{src['name']}"] = src["tokens"]
    train = splits["train"]
    return StageResult(
        metrics={"train_padding_share": train["padding"] / max(train["sequences"] * cfg.max_seq_len, 1),
                 "train_tokens_per_document": train["tokens"] / max(train["documents"], 1),
                 "num_workers": workers, "time_pack_s": round(pack_s, 3),
                 # CPU time stays out of tokens.json (it would change the artifact's bytes from run to run)
                 "tokens_per_actor_cpu_second": sum(int(s["tokens"]) for s in shards)
                 / max(sum(float(s["cpu_seconds"]) for s in shards), 1e-9)},
        counts=counts,
        log_files=(SUMMARY_FILE,),
        summary={"tokens": f"{train['sequences']:,} train sequences x {cfg.max_seq_len} "
                           f"({train['tokens']:,} tokens), {splits['validation']['sequences']:,} validation"},
    )
