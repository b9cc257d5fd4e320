"""Corpus output: the deterministic train/validation split and the artifact's Parquet files.

train/ and validation/ are written by Ray Data (`write_parquet`) from the documents that survive dedup, so
document text never passes through the driver: a task per staged block writes that block's survivors as files
of at most `corpus.rows_per_shard` rows, one row group each, then named after their first doc_id (a split's
last file of a block is shorter; with `min_rows_per_file` Ray Data bundled every block into one task, a one-core
write whose memory grew with the corpus, and batches smaller than a block became row groups of a few hundred
rows, each a tokenize work unit).
rejected.parquet and filtered.parquet are `audit`'s; duplicates.parquet and near_pairs.parquet are
duplicate-shaped and written from the driver.

The split: a document is held out for validation when a seeded 64-bit hash of its doc_id falls
below `validation_fraction`, so it depends on nothing but the id (not on workers, batches or order).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from core.errors import StageInputError
from stages.corpus.by_source import COLUMN, name_column
from stages.corpus.dedup import find
from stages.corpus.exchange import release_memory

if TYPE_CHECKING:
    from core.config import CorpusConfig

SPLITS = ("train", "validation")
SPLIT_SEED = 0x5EED
OUT_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.large_string()), ("source", pa.string())])
DUP_SCHEMA = pa.schema([("doc_id", pa.string()), ("kept_doc_id", pa.string()), ("similarity", pa.float64()),
                        ("kind", pa.string())])
PAIR_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("similarity", pa.float64())])


def is_validation(ids: Sequence[str], fraction: float) -> np.ndarray:
    """The deterministic split: a doc is held out when a seeded hash of its id falls below `fraction`."""
    cut = int(fraction * 2.0 ** 64)
    hashes = np.fromiter((xxhash.xxh3_64_intdigest(i.encode(), seed=SPLIT_SEED) for i in ids), dtype=np.uint64,
                         count=len(ids))
    return hashes < np.uint64(min(cut, 2 ** 64 - 1)) if cut < 2 ** 64 else np.ones(len(ids), dtype=bool)


# ---------------------------------------------------------------- Ray Data batch functions


def out_schema(names: Sequence[str] = ()) -> pa.Schema:
    """The split files' schema: OUT_SCHEMA, and `source_name` when the sources are named."""
    return OUT_SCHEMA.append(pa.field(COLUMN, pa.string())) if names else OUT_SCHEMA


def split_rows(batch: pa.Table, removed: tuple[np.ndarray, np.ndarray], fraction: float, split: str,
               names: Sequence[str] = ()) -> pa.Table:
    """Readable documents that dedup keeps and that belong to `split`, as output rows (`out_schema(names)`)."""
    readable = pc.is_null(batch.column("reason")).to_numpy(zero_copy_only=False)
    gone = find(removed[0], removed[1], batch.column("id_hi").to_numpy(), batch.column("id_lo").to_numpy()) >= 0
    kept = batch.filter(pa.array(readable & ~gone))
    held_out = is_validation(kept.column("doc_id").to_pylist(), fraction)
    kept = kept.filter(pa.array(held_out if split == "validation" else ~held_out))
    rows = kept.select(OUT_SCHEMA.names)
    if names:
        rows = rows.append_column(COLUMN, name_column(kept.column("id_hi").to_numpy(), names))
    return rows


# ---------------------------------------------------------------- writing


def _kept(batch: pa.Table, removed: list, fraction: float, split: str, names: Sequence[str]) -> pa.Table:
    import ray

    release_memory()  # what the worker's previous tasks freed: a worker runs many of these, each holding a block
    return split_rows(batch, ray.get(removed[0]), fraction, split, names).combine_chunks()  # a row group per file


def write_splits(docs, removed: tuple[np.ndarray, np.ndarray], cfg: CorpusConfig, out: Path,
                 names: Sequence[str] = ()) -> dict[str, int]:
    """train/ and validation/ from the documents dedup keeps (the removed ids are broadcast once); row counts.
    `names`: the named sources in rank order, for the `source_name` column."""
    import ray

    ref = [ray.put(removed)]  # in a list: a task gets the reference, and fetches the arrays zero-copy
    rows = {}
    for split in SPLITS:
        kept = docs.map_batches(_kept, batch_format="pyarrow", batch_size=None,
                                fn_kwargs={"removed": ref, "fraction": cfg.validation_fraction, "split": split,
                                           "names": tuple(names)})
        rows[split] = write_split(kept, out / split, cfg.rows_per_shard, out_schema(names))
    return rows


def write_split(ds, split_dir: Path, rows_per_shard: int, schema: pa.Schema = OUT_SCHEMA) -> int:
    """Write one split's shards; a split with no documents still gets one empty shard (readers see the schema)."""
    ds.write_parquet(str(split_dir), max_rows_per_file=rows_per_shard)
    split_dir.mkdir(parents=True, exist_ok=True)
    name_by_content(split_dir)
    if not any(split_dir.glob("*.parquet")):
        pq.write_table(schema.empty_table(), split_dir / "empty.parquet")
    return parquet_rows(split_dir)


def name_by_content(split_dir: Path) -> None:
    """Rename each shard after its first doc_id. Ray Data names what it writes after the write (a uuid) and the
    task's place in it, so the same documents had other names in every run, and the artifact other digests; named
    by content, the same input gives the same files whichever run, machine or workdir (a bucket's) built it, and
    readers that take the shards in name order (vocab) read them in the same order."""
    for f in list(split_dir.glob("*.parquet")):
        meta = pq.ParquetFile(f)
        if not meta.metadata.num_rows:
            f.unlink()  # nothing in it; an empty split gets its one empty shard below
            continue
        first = meta.read_row_group(0, columns=["doc_id"]).column(0)[0].as_py()
        target = split_dir / f"{first}.parquet"
        if target.exists():  # doc_ids are unique: two shards starting with one document is a bug, not data
            raise RuntimeError(f"two corpus shards in {split_dir} start with document {first}")
        f.rename(target)


def write_duplicates(path: Path, exact: pa.Table, near: pa.Table) -> int:
    """duplicates.parquet from exact (doc_id, kept_doc_id) and near (doc_id, kept_doc_id, similarity) removals.

    An exact group's survivor may itself be a near duplicate: its copies then point at the final survivor,
    so every kept_doc_id is a document of train/ or validation/.
    """
    kept, similarity = exact.column("kept_doc_id"), pa.array(np.ones(exact.num_rows))
    if near.num_rows and exact.num_rows:
        at = pc.index_in(kept, near.column("doc_id"))  # null where the exact survivor is kept
        moved = pc.is_valid(at)
        at = pc.fill_null(at, 0)
        kept = pc.if_else(moved, near.column("kept_doc_id").take(at), kept)
        similarity = pc.if_else(moved, near.column("similarity").take(at), similarity)
    table = pa.concat_tables([
        pa.table({"doc_id": exact.column("doc_id"), "kept_doc_id": kept, "similarity": similarity,
                  "kind": pa.array(["exact"] * exact.num_rows, pa.string())}, schema=DUP_SCHEMA),
        pa.table({"doc_id": near.column("doc_id"), "kept_doc_id": near.column("kept_doc_id"),
                  "similarity": near.column("similarity"), "kind": pa.array(["near"] * near.num_rows, pa.string())},
                 schema=DUP_SCHEMA)])
    pq.write_table(table, path)
    return table.num_rows


def write_near_pairs(path: Path, edges: pa.Table) -> None:
    pq.write_table(edges.select(PAIR_SCHEMA.names).cast(PAIR_SCHEMA), path)


def raise_no_documents(out: Path, num_files: int) -> None:
    """One clear error when every record was rejected, quoting a few of the reasons."""
    sample = pq.read_table(out / "rejected.parquet").slice(0, 3).to_pylist()
    why = "; ".join(f"{r['path']}: {r['reason']}" for r in sample) or "no records"
    raise StageInputError(
        f"corpus has no readable documents ({num_files} files; e.g. {why}); point --corpus at UTF-8 "
        f".txt/.jsonl/.parquet files (optionally .gz/.bz2/.zst) and check corpus.jsonl_field / corpus.parquet_column")


def parquet_rows(path: Path) -> int:
    files = [path] if path.is_file() else sorted(path.glob("*.parquet"))
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
