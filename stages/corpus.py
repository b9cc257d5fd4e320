"""Corpus stage: ingest raw text, remove exact and near duplicates (MinHash LSH), shard 95/5.

Following the paper (A.2) and Megatron-LM: character 5-gram MinHash, LSH banding to candidate
pairs, each candidate confirmed by its true Jaccard similarity (>= corpus.threshold), connected
components, one survivor per component (the smallest doc_id, so the choice does not depend on
worker count or block order). Every step is a Ray Data operation over batches:

    files --map_batches(read, fingerprint)--> docs (doc_id, text, source, reason, hash, sig)  [materialized]
    exact:  docs.groupby(hash).aggregate(count, list doc_id), count >= 2  -> duplicate groups (driver)
    LSH:    survivors.map_batches(band keys).groupby(key).count() >= 2   -> colliding keys (driver)
            survivors.map_batches(rows of colliding buckets only, with text)
                     .groupby(bucket).map_groups(verify Jaccard)          -> confirmed edges (driver)
    connected components of the edge list (driver)
    docs.map_batches(survivors of `split`).write_parquet                  -> train/, validation/

What reaches the driver is only duplicate-shaped: the members of duplicate hash groups, the
colliding band keys and the confirmed edges, each bounded by the number of duplicate (or
candidate) pairs, never by the corpus; the sets broadcast back to workers are the same size.
Output layout: see `run`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from pipeline.config import CorpusConfig
from stages.base import StageContext, StageInputError, StageResult
from stages.corpus_io import list_sources as _list_sources, read_file
from stages.minhash import MinHasher, band_keys, jaccard, lsh_params, normalize, shingle_set

NAME = "corpus"
VERSION = "1"

MAX_READ_TASKS = 4096
READ_TASK_BYTES = 256 << 20
BATCH_BYTES = 64 << 20
MAX_BUCKET = 64
"""Largest group whose pairs are verified together; a bigger LSH bucket is split into chunks by
a per-band hash of doc_id, so pairs separated in one band meet in another (memory and pair
count stay bounded; a huge cluster is still connected through the other bands)."""
SPLIT_SEED = 0x5EED
PARTITION_BYTES = 64 << 20
MAX_PARTITIONS = 1000
EXAMPLES = 5
SNIPPET = 300

DOC_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.large_string()), ("source", pa.string()),
                        ("reason", pa.string())])
DUP_SCHEMA = pa.schema([("doc_id", pa.string()), ("kept_doc_id", pa.string()), ("similarity", pa.float64()),
                        ("kind", pa.string())])
EDGE_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("similarity", pa.float64()),
                         ("text_a", pa.large_string()), ("text_b", pa.large_string())])
OUT_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.large_string()), ("source", pa.string())])
REJECT_SCHEMA = pa.schema([("path", pa.string()), ("reason", pa.string())])


@dataclass(frozen=True)
class RawCorpus:
    """The stage's input: file paths, directories, globs or pyarrow.fs URIs (the runner builds it)."""

    patterns: tuple[str, ...]


def list_sources(patterns: Sequence[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of every input file, sorted; raises StageInputError for a pattern matching nothing."""
    return _list_sources(patterns)


def doc_id(source: str, index: int) -> str:
    """Stable id of the index-th record of a file: independent of workers, batches and run."""
    return xxhash.xxh3_128_hexdigest(f"{source}\x00{index}".encode())


def is_validation(ids: Sequence[str], fraction: float) -> np.ndarray:
    """The deterministic split: a doc is held out when a seeded hash of its id falls below `fraction`."""
    cut = int(fraction * 2.0 ** 64)
    return np.array([xxhash.xxh3_64_intdigest(i.encode(), seed=SPLIT_SEED) < cut for i in ids], dtype=bool)


# ---------------------------------------------------------------- Ray Data batch functions


def _read_files(batch: pa.Table, opts: CorpusConfig, batch_rows: int) -> Iterator[pa.Table]:
    """Files -> documents and rejections, yielded in batches of <= batch_rows rows / BATCH_BYTES."""
    cols: dict[str, list] = {name: [] for name in DOC_SCHEMA.names}
    size = 0
    for path in batch.column("path").to_pylist():
        for rec in read_file(path, opts):
            cols["doc_id"].append(doc_id(rec.source, rec.index))
            cols["text"].append(rec.text)
            cols["source"].append(rec.source)
            cols["reason"].append(rec.reason)
            size += len(rec.text) if rec.text else 0
            if len(cols["doc_id"]) >= batch_rows or size >= BATCH_BYTES:
                yield pa.table(cols, schema=DOC_SCHEMA)
                cols = {name: [] for name in DOC_SCHEMA.names}
                size = 0
    if cols["doc_id"]:
        yield pa.table(cols, schema=DOC_SCHEMA)


def _fingerprint(batch: pa.Table, hasher: MinHasher) -> pa.Table:
    """Add hash (of the normalised text), sig (MinHash, uint32 bytes) and nbytes."""
    texts = batch.column("text").to_pylist()
    reasons = batch.column("reason").to_pylist()
    hashes, sigs = [None] * len(texts), [None] * len(texts)
    for i, (text, reason) in enumerate(zip(texts, reasons)):
        if reason is not None:
            continue
        norm = normalize(text)
        if not norm:  # only control/format characters: nothing to keep or compare
            reasons[i] = "empty document after normalisation (control or format characters only)"
            continue
        hashes[i] = xxhash.xxh3_128_hexdigest(norm.encode())
        sigs[i] = hasher.signature(norm).tobytes()
    nbytes = pa.compute.fill_null(pa.compute.binary_length(batch.column("text")), 0).cast(pa.int64())
    return (batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string()))
            .append_column("hash", pa.array(hashes, pa.string()))
            .append_column("sig", pa.array(sigs, pa.binary()))
            .append_column("nbytes", nbytes))


def _readable(batch: pa.Table, columns: list[str]) -> pa.Table:
    return batch.filter(pa.compute.is_null(batch.column("reason"))).select(columns)


def _survivors(batch: pa.Table, removed: set[str]) -> pa.Table:
    """Readable documents that are not in `removed` (exact duplicates of a smaller doc_id)."""
    ids = batch.column("doc_id").to_pylist()
    reasons = batch.column("reason").to_pylist()
    return batch.filter(pa.array([r is None and i not in removed for i, r in zip(ids, reasons)], pa.bool_()))


def _sig_matrix(batch: pa.Table, num_perm: int) -> np.ndarray:
    sig = b"".join(batch.column("sig").to_pylist())
    return np.frombuffer(sig, dtype=np.uint32).reshape(-1, num_perm)  # (N, P)


def _band_key_rows(batch: pa.Table, removed: set[str], num_perm: int, bands: int, rows: int) -> pa.Table:
    """One row per (survivor, band): its LSH bucket key."""
    keys = band_keys(_sig_matrix(_survivors(batch, removed), num_perm), bands, rows)  # (N, B)
    return pa.table({"band_key": keys.ravel()})


def _chunk(doc: str, band: int, nchunks: int) -> int:
    return xxhash.xxh3_64_intdigest(doc.encode(), seed=band) % nchunks


def _bucket_rows(batch: pa.Table, removed: set[str], colliding: np.ndarray, oversized: dict[int, int],
                 num_perm: int, bands: int, rows: int) -> pa.Table:
    """For survivors in a colliding bucket: (bucket, band, doc_id, text, sig), one row per such bucket."""
    kept = _survivors(batch, removed)
    keys = band_keys(_sig_matrix(kept, num_perm), bands, rows)  # (N, B)
    doc_idx, band_idx = np.nonzero(np.isin(keys, colliding))
    bucket = keys[doc_idx, band_idx].copy()
    ids = kept.column("doc_id").to_pylist()
    for n, (d, b) in enumerate(zip(doc_idx, band_idx)):
        nchunks = oversized.get(int(bucket[n]))
        if nchunks:  # split an oversized bucket: fold the chunk index into the key
            bucket[n] ^= np.uint64(_chunk(ids[d], int(b), nchunks) + 1) * np.uint64(0x9E3779B97F4A7C15)
    take = pa.array(doc_idx, pa.int64())
    return pa.table({"bucket": bucket, "band": band_idx.astype(np.int32),
                     "doc_id": kept.column("doc_id").take(take), "text": kept.column("text").take(take),
                     "sig": kept.column("sig").take(take)})


def _verify_bucket(group: pa.Table, oversized: dict[int, int], cfg: CorpusConfig, bands: int,
                   rows: int) -> pa.Table:
    """Confirm the pairs of one bucket by exact Jaccard of their shingle sets.

    A pair colliding in several bands is verified only in the first band where it shares a group
    (its bucket, or the same chunk of an oversized one), so each pair is checked once.
    """
    group = group.sort_by("doc_id")
    ids = group.column("doc_id").to_pylist()
    if len(ids) < 2:
        return EDGE_SCHEMA.empty_table()
    band = group.column("band")[0].as_py()
    keys = band_keys(_sig_matrix(group, cfg.num_perm), bands, rows)  # (n, B)
    texts = group.column("text").to_pylist()
    sets: dict[int, np.ndarray] = {}  # lazily: a cluster meeting in every band is shingled in its first only

    def shingles(k: int) -> np.ndarray:
        if k not in sets:
            sets[k] = shingle_set(normalize(texts[k]), cfg.shingle, cfg.shingle_size)
        return sets[k]

    out: dict[str, list] = {name: [] for name in EDGE_SCHEMA.names}
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            if _first_shared_band(ids[i], ids[j], keys[i], keys[j], oversized) != band:
                continue
            sim = jaccard(shingles(i), shingles(j))
            if sim >= cfg.threshold:
                for name, value in zip(EDGE_SCHEMA.names, (ids[i], ids[j], sim, texts[i][:SNIPPET], texts[j][:SNIPPET])):
                    out[name].append(value)
    return pa.table(out, schema=EDGE_SCHEMA)


def _first_shared_band(a: str, b: str, ka: np.ndarray, kb: np.ndarray, oversized: dict[int, int]) -> int:
    for band in np.flatnonzero(ka == kb):
        nchunks = oversized.get(int(ka[band]))
        if not nchunks or _chunk(a, int(band), nchunks) == _chunk(b, int(band), nchunks):
            return int(band)
    return -1


def _split_rows(batch: pa.Table, removed: set[str], fraction: float, split: str) -> pa.Table:
    """Survivors of dedup that belong to `split` (train | validation), as output rows."""
    kept = _survivors(batch, removed)
    held_out = is_validation(kept.column("doc_id").to_pylist(), fraction)
    return kept.filter(pa.array(held_out if split == "validation" else ~held_out)).select(["doc_id", "text", "source"])


def _rejected_rows(batch: pa.Table) -> pa.Table:
    bad = batch.filter(pa.compute.is_valid(batch.column("reason")))
    return pa.table({"path": bad.column("source"), "reason": bad.column("reason")}, schema=REJECT_SCHEMA)


def _at_least(batch: pa.Table, column: str, minimum: int) -> pa.Table:
    return batch.filter(pa.compute.greater_equal(batch.column(column), minimum))


# ---------------------------------------------------------------- driver-side steps


def _gather(ds) -> pa.Table | None:
    """All rows of a small dataset (duplicate-sized by construction) as one table on the driver."""
    tables = [pa.table(b) for b in ds.iter_batches(batch_format="pyarrow", batch_size=None)]
    tables = [t for t in tables if t.num_rows]
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def components(edges: pa.Table) -> dict[str, tuple[str, float]]:
    """Connected components of the confirmed-pair graph -> {removed doc: (survivor, similarity)}.

    Runs on the driver over the edge list only (size = confirmed near-duplicate pairs). The
    survivor is the component's smallest doc_id; the similarity recorded for a removed doc is
    its edge to the survivor when there is one, else its most similar confirmed neighbour.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    a, b, s = (edges.column(c).to_pylist() for c in ("a", "b", "similarity"))
    for x, y in zip(a, b):
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)  # the root is always the component's smallest id
    best: dict[str, float] = {}
    direct: dict[str, float] = {}
    for x, y, sim in zip(a, b, s):
        for d, other in ((x, y), (y, x)):
            best[d] = max(best.get(d, 0.0), sim)
            if other == find(d):
                direct[d] = sim
    return {d: (find(d), direct.get(d, best[d])) for d in sorted(best) if find(d) != d}


def _exact_groups(docs, n_docs: int) -> dict[str, list[str]]:
    """{survivor (smallest doc_id): [removed exact duplicates]} for every hash shared by >= 2 documents."""
    from ray.data.aggregate import AsList, Count

    groups = (docs.map_batches(_readable, batch_format="pyarrow", fn_kwargs={"columns": ["doc_id", "hash"]})
              .groupby("hash", num_partitions=_partitions(n_docs * 80)).aggregate(Count(), AsList("doc_id"))
              .map_batches(_at_least, batch_format="pyarrow", fn_kwargs={"column": "count()", "minimum": 2}))
    table = _gather(groups)
    out = {}
    for members in (table.column("list(doc_id)").to_pylist() if table else []):
        members = sorted(members)
        out[members[0]] = members[1:]
    return out


def _write_single(ds, path: Path, schema: pa.Schema) -> None:
    """Write a dataset as one Parquet file at `path` (Ray writes a directory of parts)."""
    tmp = path.with_name(f".{path.stem}-parts")
    ds.repartition(1).write_parquet(str(tmp))
    parts = sorted(tmp.glob("*.parquet"))
    table = pq.read_table(parts[0], schema=schema) if parts else schema.empty_table()
    pq.write_table(table, path)
    shutil.rmtree(tmp, ignore_errors=True)  # Ray writes no directory for an empty dataset


def _write_split(ds, split_dir: Path, rows_per_shard: int) -> int:
    """Write one split's shards; a split with no documents still gets one empty shard (readers see the schema)."""
    ds.write_parquet(str(split_dir), min_rows_per_file=rows_per_shard, max_rows_per_file=rows_per_shard)
    split_dir.mkdir(parents=True, exist_ok=True)
    if not any(split_dir.glob("*.parquet")):
        pq.write_table(OUT_SCHEMA.empty_table(), split_dir / "empty.parquet")
    return _parquet_rows(split_dir)


def _parquet_rows(path: Path) -> int:
    files = [path] if path.is_file() else sorted(path.glob("*.parquet"))
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _partitions(nbytes: float) -> int:
    """Shuffle partitions of ~PARTITION_BYTES: Ray's default (200) costs minutes of overhead on small corpora."""
    return int(min(MAX_PARTITIONS, max(1, -(-nbytes // PARTITION_BYTES))))


def _examples(exact: dict[str, list[str]], edges: pa.Table) -> list[dict]:
    """A few duplicate pairs for report readers and MLflow: near pairs spanning the similarity range."""
    out = [{"kind": "exact", "similarity": 1.0, "doc_a": kept, "doc_b": removed[0]}
           for kept, removed in sorted(exact.items())[:2]]
    if edges.num_rows:
        order = np.argsort(edges.column("similarity").to_numpy(), kind="stable")
        picks = sorted(set(order[np.linspace(0, len(order) - 1, min(EXAMPLES, len(order))).astype(int)].tolist()))
        for k in picks:
            row = {name: edges.column(name)[k].as_py() for name in EDGE_SCHEMA.names}
            out.append({"kind": "near", "similarity": round(row["similarity"], 4), "doc_a": row["a"],
                        "doc_b": row["b"], "text_a": row["text_a"], "text_b": row["text_b"]})
    return out


def _raise_no_documents(out: Path, num_files: int) -> None:
    sample = pq.read_table(out / "rejected.parquet").slice(0, 3).to_pylist()
    why = "; ".join(f"{r['path']}: {r['reason']}" for r in sample) or "no records"
    raise StageInputError(
        f"corpus has no readable documents ({num_files} files; e.g. {why}); point --corpus at UTF-8 "
        f".txt/.jsonl/.parquet files (optionally .gz/.bz2/.zst) and check corpus.jsonl_field / corpus.parquet_column")


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class _Plan:
    """What every Ray step of one run shares."""

    cfg: CorpusConfig
    hasher: MinHasher
    bands: int
    rows: int

    @classmethod
    def of(cls, cfg: CorpusConfig) -> "_Plan":
        bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
        return cls(cfg, MinHasher(cfg.num_perm, cfg.seed, cfg.shingle, cfg.shingle_size), bands, rows)

    @property
    def batch(self) -> dict:
        return {"batch_size": self.cfg.batch_size, "batch_format": "pyarrow"}

    @property
    def lsh(self) -> dict:
        return {"num_perm": self.cfg.num_perm, "bands": self.bands, "rows": self.rows}


def _ingest(files: list[tuple[str, int, int]], plan: _Plan):
    """Read and fingerprint every file into a materialized dataset of documents and rejections."""
    import ray

    cfg = plan.cfg
    # Files are grouped into read tasks (~READ_TASK_BYTES, at least two per CPU): a task per small
    # file costs more in scheduling than in reading. Reading is I/O (a fraction of a CPU) and a
    # separate operator from hashing, so one big file's batches fan out to every core.
    cpus = int(ray.cluster_resources().get("CPU", 1))
    read_tasks = min(len(files), MAX_READ_TASKS, max(2 * cpus, -(-sum(s for _, s, _ in files) // READ_TASK_BYTES)))
    return (ray.data.from_items([{"path": p} for p, _, _ in files], override_num_blocks=read_tasks)
            .map_batches(_read_files, batch_size=1, batch_format="pyarrow", num_cpus=0.25,
                         fn_kwargs={"opts": cfg, "batch_rows": cfg.batch_size})
            .map_batches(_fingerprint, num_cpus=1, fn_kwargs={"hasher": plan.hasher}, **plan.batch)
            .materialize())


def _near_edges(docs, plan: _Plan, exact_removed: set[str], n_docs: int, text_bytes: int) -> tuple[pa.Table, int]:
    """Confirmed near-duplicate pairs among exact survivors (sorted), and the number of colliding buckets."""
    common = {"removed": exact_removed, **plan.lsh}
    key_counts = (docs.map_batches(_band_key_rows, fn_kwargs=common, **plan.batch)
                  .groupby("band_key", num_partitions=_partitions(n_docs * plan.bands * 16)).count()
                  .map_batches(_at_least, batch_format="pyarrow", fn_kwargs={"column": "count()", "minimum": 2}))
    hot = _gather(key_counts)
    if hot is None:
        return EDGE_SCHEMA.empty_table(), 0
    hot = hot.sort_by("band_key")
    colliding, sizes = hot["band_key"].to_numpy(), hot["count()"].to_numpy()
    oversized = {int(k): -(-int(c) // MAX_BUCKET) for k, c in zip(colliding, sizes) if c > MAX_BUCKET}
    candidate_bytes = int(sizes.sum()) * (text_bytes / max(n_docs, 1) + 4 * plan.cfg.num_perm + 100)
    confirmed = (docs.map_batches(_bucket_rows, fn_kwargs={**common, "colliding": colliding, "oversized": oversized},
                                  **plan.batch)
                 .groupby("bucket", num_partitions=_partitions(candidate_bytes))
                 .map_groups(_verify_bucket, batch_format="pyarrow",
                             fn_kwargs={"oversized": oversized, "cfg": plan.cfg, "bands": plan.bands, "rows": plan.rows}))
    edges = _gather(confirmed) or EDGE_SCHEMA.empty_table()
    return edges.cast(EDGE_SCHEMA).sort_by([("a", "ascending"), ("b", "ascending")]), len(colliding)


def _write_outputs(docs, plan: _Plan, out: Path, exact: dict[str, list[str]], near: dict[str, tuple[str, float]],
                   edges: pa.Table) -> dict[str, int]:
    """train/ and validation/ shards (Ray), duplicates and confirmed pairs (duplicate-sized, from the driver)."""
    removed = {d for ds in exact.values() for d in ds} | set(near)
    n_split = {}
    for split in ("train", "validation"):
        rows = docs.map_batches(_split_rows, fn_kwargs={"removed": removed, "fraction": plan.cfg.validation_fraction,
                                                        "split": split}, **plan.batch)
        n_split[split] = _write_split(rows, out / split, plan.cfg.rows_per_shard)
    # an exact group's survivor may itself be a near duplicate: point its copies at the final survivor
    dup_rows = [(d, *near.get(kept, (kept, 1.0)), "exact") for kept, ds in exact.items() for d in ds]
    dup_rows += [(d, kept, sim, "near") for d, (kept, sim) in near.items()]
    pq.write_table(pa.table(list(zip(*dup_rows)) or [[]] * 4, schema=DUP_SCHEMA), out / "duplicates.parquet")
    pq.write_table(edges.select(["a", "b", "similarity"]), out / "near_pairs.parquet")
    return n_split


def run(cfg: CorpusConfig, *, inputs: dict, out: Path, ctx: StageContext) -> StageResult:
    """Build the corpus artifact in `out`:

        train/*.parquet, validation/*.parquet   doc_id, text (original), source
        duplicates.parquet                      doc_id, kept_doc_id, similarity, kind (exact|near);
                                                kept_doc_id is always a document of train/ or validation/
        near_pairs.parquet                      a, b, similarity: every confirmed near-duplicate pair
        rejected.parquet                        path, reason (unreadable files, undecodable or oversized records)
        report.json, examples.json              counts, bytes, timings; a few duplicate pairs with text
    """
    out = Path(out)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        timings[name], clock = round(time.perf_counter() - clock, 3), time.perf_counter()

    files = list_sources(inputs["raw"].patterns)
    plan = _Plan.of(cfg)
    docs = _ingest(files, plan)
    n_docs, text_bytes = docs.count(), int(docs.sum("nbytes") or 0)
    _write_single(docs.map_batches(_rejected_rows, batch_format="pyarrow"), out / "rejected.parquet", REJECT_SCHEMA)
    n_rejected = _parquet_rows(out / "rejected.parquet")
    if n_rejected == n_docs:
        _raise_no_documents(out, len(files))
    lap("ingest_s")
    exact = _exact_groups(docs, n_docs)
    exact_removed = {d for ds in exact.values() for d in ds}
    lap("exact_s")
    edges, n_buckets = _near_edges(docs, plan, exact_removed, n_docs, text_bytes)
    near = components(edges)
    lap("near_s")
    n_split = _write_outputs(docs, plan, out, exact, near, edges)
    lap("write_s")

    counts = {
        "files_in": len(files), "documents_in": n_docs, "documents_out": n_split["train"] + n_split["validation"],
        "train_documents": n_split["train"], "validation_documents": n_split["validation"],
        "exact_duplicates_removed": len(exact_removed), "near_duplicates_removed": len(near), "rejected": n_rejected,
        "exact_clusters": len(exact), "near_clusters": len({kept for kept, _ in near.values()}),
        "candidate_buckets": n_buckets, "near_pairs_confirmed": edges.num_rows,
    }
    accounted = counts["documents_out"] + len(exact_removed) + len(near) + n_rejected
    if accounted != n_docs:  # every document is kept, removed or rejected exactly once
        raise RuntimeError(f"corpus stage lost documents: {n_docs} in, {accounted} accounted for")
    timings["total_s"] = round(sum(timings.values()), 3)
    _write_report(out, plan, files, counts, timings, text_bytes, exact, edges)
    metrics = {
        "duplicate_fraction": (len(exact_removed) + len(near)) / n_docs,
        "rejected_fraction": n_rejected / n_docs,
        "documents_per_s": n_docs / max(timings["total_s"], 1e-9),
        **{f"time_{k}": v for k, v in timings.items()},
    }
    summary = (f"{counts['documents_out']} of {n_docs} documents kept ({len(exact_removed)} exact and {len(near)} "
               f"near duplicates removed, {n_rejected} rejected)")
    return StageResult(metrics=metrics, counts=counts, log_files=("report.json", "examples.json"),
                       summary={"corpus": summary})


def _write_report(out: Path, plan: _Plan, files: list[tuple[str, int, int]], counts: dict[str, int],
                  timings: dict[str, float], text_bytes: int, exact: dict[str, list[str]], edges: pa.Table) -> None:
    split_bytes = {f"parquet_{s}": sum(f.stat().st_size for f in (out / s).glob("*.parquet"))
                   for s in ("train", "validation")}
    cfg = plan.cfg
    report = {
        "counts": counts,
        "bytes": {"files_in": sum(s for _, s, _ in files), "text_in": text_bytes, **split_bytes},
        "timings": timings,
        "lsh": {**plan.lsh, "threshold": cfg.threshold, "shingle": cfg.shingle, "shingle_size": cfg.shingle_size},
        "config": dataclasses.asdict(cfg),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (out / "examples.json").write_text(json.dumps(_examples(exact, edges), indent=2, ensure_ascii=False))
