"""Corpus stage: ingest raw text, remove exact and near duplicates (MinHash LSH), shard 95/5.

Following DeBERTa A.2 and Megatron-LM: character 5-gram MinHash, LSH banding to candidate
pairs, each candidate confirmed by its true Jaccard similarity (>= corpus.threshold), connected
components of the confirmed pairs, one survivor per component (the smallest doc_id, so the choice
depends on neither worker count nor block order). The Ray steps, this module's orchestration:

    sources --map_batches(ingest.read_files, ingest.fingerprint_block)--> staged blocks
                  (the quality rules and language identification first, `quality`, so dedup never reads what they
                  remove; each block's documents and fingerprints written once to an Arrow file; one row per block back)
    staged  --stream(audit.audit_rows)--> rejected.parquet, filtered.parquet, the corpus's text bytes
    staged  --dedup: band rows, exchange 1 (buckets), driver--> candidate pairs
    staged  --dedup: exchange 2 (the candidates' text only; confirm)--> removals
    staged  --map_batches(shard.split_rows).write_parquet--> train/, validation/

Nothing per document stays in the object store: the staged files hold the documents and their fingerprints
(ids, text hash, band keys), the exchanges (`exchange`, a round at a time) move band rows and candidate
documents, and the text of the kept documents streams from the staged files to the output a block at a time.

Modules: `ingest` (listing and reading files, fingerprints), `quality` (the rules, vectorised over a batch),
`audit` (what was rejected or filtered, and why), `minhash` (the numpy kernels),
`dedup` (buckets, candidate graph, confirmation, components; its docstring says what bounds memory),
`exchange` (the all-to-all step on Ray tasks),
`shard` (split and Parquet outputs), `report` (report.json, examples.json, dedup.png).

The raw input is resolved exactly once: `list_sources(patterns)` lists the files (path, size,
mtime_ns), `RawCorpus(sources)` carries that tuple, and the stage reads exactly those files.

Named sources (`--corpus NAME=PATH[:weight=W|:epochs=E] ...`, `RawCorpus.of_blend`) are deduplicated together,
and of copies in several sources the one of the source listed first is kept: a named source's position is the
first byte of its documents' ids, so the survivor rule above decides it (`by_source`).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.errors import StageInputError
from stages.base import StageContext, StageResult
from stages.corpus import audit, by_source, dedup, exchange, ingest, report, shard
from stages.corpus import decontaminate as decontamination
from stages.corpus.decontaminate import prepare
from stages.corpus.ingest import doc_id, list_sources, read_file
from stages.corpus.listing import check_inputs, dry_run
from stages.corpus.minhash import MinHasher, lsh_params
from stages.corpus.quality import Filters
from stages.corpus.shard import is_validation

from core.corpus_filters import resolve as resolve_filters
from core.corpus_sources import CorpusSource

if TYPE_CHECKING:
    from core.config import CorpusConfig

__all__ = ["VERSION", "RawCorpus", "Source", "check_inputs", "dry_run", "list_sources", "read_file", "doc_id",
           "is_validation", "prepare", "run"]

VERSION = "5"

MAX_READ_TASKS = 4096
BLOCK_BYTES = 12 << 20
READ_TASK_BYTES = 256 << 20
# Of the object store, what one round of a shuffle may hold (map outputs + reduce inputs). The store's pages stay
# resident in the workers that once wrote them, so this share is also what the exchanges add to the stage's memory:
# at 1M documents 0.25 left the peak 0.12 GB higher than 0.125, for 4% less time.
EXCHANGE_SHARE = 0.125
STREAM_BYTES = 16 * BLOCK_BYTES  # object store a Ray Data pass may fill: reading runs ahead of fingerprinting
STAGED = ".staged"  # the documents, an Arrow file per fingerprinted block; removed before the artifact is complete
Source = tuple[str, int, int]
"""(path, size in bytes, mtime_ns) of one input file."""


@dataclass(frozen=True)
class RawCorpus:
    """The stage's input: the files `list_sources` resolved, sorted by path (the driver builds it once)."""

    sources: tuple[Source, ...]
    """Every input file as (path, size, mtime_ns): the stage reads exactly these, and never lists again."""
    patterns: tuple[str, ...] = ()
    """What was asked for (files, directories, globs, URIs), for display and lineage only."""
    blend: tuple[CorpusSource, ...] = ()
    """The named sources in the order listed; empty for one unnamed source (`--corpus PATH...`)."""
    ranks: tuple[int, ...] = ()
    """With `blend`: per file of `sources`, the index of its source in `blend` (its rank for dedup)."""
    id_paths: tuple[str, ...] = ()
    """Per file of `sources`, the name its documents' ids hash in place of its path (empty: the paths). The
    built-in corpus is named `builtin:news/...`, so its document ids, like its artifact id, are the same in every
    workdir (and so is its validation split)."""

    def __post_init__(self) -> None:
        if not self.sources:
            raise StageInputError("the raw corpus lists no files; pass --corpus PATH (a file, a directory or a glob)")

    @classmethod
    def of(cls, patterns: Sequence[str]) -> "RawCorpus":
        """List `patterns` (files, directories, globs, pyarrow.fs URIs) once."""
        return cls(tuple(list_sources(patterns)), tuple(patterns))

    @classmethod
    def of_blend(cls, blend: Sequence[CorpusSource]) -> "RawCorpus":
        """List each named source's files once; StageInputError naming the source when its path matches nothing
        or when a file falls in two sources (a document has one source)."""
        owner: dict[str, int] = {}
        found: dict[str, Source] = {}
        for rank, src in enumerate(blend):
            try:
                files = list_sources([src.path])
            except StageInputError as e:
                raise StageInputError(f"corpus source {src.name!r}: {e}") from None
            for f in files:
                if f[0] in owner:
                    raise StageInputError(
                        f"file {f[0]} is in corpus sources {blend[owner[f[0]]].name!r} and {src.name!r}; give each "
                        f"file to one source (narrow a directory or glob)")
                owner[f[0]], found[f[0]] = rank, f
        paths = sorted(found)
        return cls(tuple(found[p] for p in paths), tuple(s.spec() for s in blend), tuple(blend),
                   tuple(owner[p] for p in paths))

    def read_items(self) -> list[dict]:
        """One row per file for `ingest.read_files`: its path, and where set its source rank (named sources: the
        first byte of its documents' ids) and the name its ids hash (`id_paths`)."""
        items: list[dict] = [{"path": p} for p, _, _ in self.sources]
        for item, rank in zip(items, self.ranks):
            item["rank"] = rank
        for item, name in zip(items, self.id_paths):
            item["id_path"] = name
        return items

    def names(self) -> tuple[str, ...]:
        """The source names in rank order (empty for one unnamed source)."""
        return tuple(s.name for s in self.blend)


# ---------------------------------------------------------------- Ray steps


@contextlib.contextmanager
def _data_context():
    """Ray Data settings of this stage, restored afterwards (the driver's context is process-wide).

    - Blocks of BLOCK_BYTES instead of 128 MiB: Ray Data runs one task per block, so a 100 MB file read into one
      block would be fingerprinted by one core; 12 MiB keeps every core busy on a 100k-document corpus while the
      tasks stay few (each costs ~10-20 ms of scheduling, and every pass runs one per block or staged file).
    - At most STREAM_BYTES of the object store per pass: reading is several times faster than fingerprinting, and
      Ray Data's default budget (a share of the whole store) let read blocks queue up to 0.5 GB at 1M documents.
    """
    import ray

    ctx = ray.data.DataContext.get_current()
    saved = ctx.target_max_block_size, ctx.execution_options.resource_limits
    ctx.target_max_block_size = BLOCK_BYTES
    ctx.execution_options.resource_limits = saved[1].copy(object_store_memory=STREAM_BYTES)
    try:
        yield
    finally:
        ctx.target_max_block_size, ctx.execution_options.resource_limits = saved


def _ingest(raw: RawCorpus, cfg: CorpusConfig, fp: ingest.Fingerprinter, cpus: int,
            stage: Path) -> tuple[list[str], int]:
    """Read and fingerprint every file into staged Arrow files under `stage`, one per block: (their paths, sorted;
    the records read, rejections included)."""
    import ray

    # Files are grouped into read tasks (~READ_TASK_BYTES, at least two per CPU): a task per small
    # file costs more in scheduling than in reading. Reading (I/O, decompression, JSON) is a separate
    # operator from fingerprinting, so one big file's blocks fan out to every core; it reserves no CPU
    # (it is several times faster than fingerprinting and mostly waits on backpressure: with a quarter
    # CPU per read, two reads left room for one fingerprinting task on 2 CPUs, and the stage ran on one
    # core), and at most one read per CPU runs at a time, since each concurrent task needs a worker
    # process of its own (~1 CPU-second to start on this machine).
    sources = raw.sources
    total = sum(size for _, size, _ in sources)
    read_tasks = min(len(sources), MAX_READ_TASKS, max(2 * cpus, -(-total // READ_TASK_BYTES)))
    items = raw.read_items()
    blocks = (ray.data.from_items(items, override_num_blocks=read_tasks)
              .map_batches(ingest.read_files, batch_size=1, batch_format="pyarrow", num_cpus=0,
                           compute=ray.data.TaskPoolStrategy(size=min(cpus, read_tasks)),
                           fn_kwargs={"opts": cfg, "batch_rows": cfg.batch_size})
              .map_batches(ingest.fingerprint_block, batch_size=None, batch_format="pyarrow", num_cpus=1,
                           fn_kwargs={"fp": fp, "stage": str(stage), "batch_rows": cfg.batch_size})
              .take_all())  # one row per block
    rows = {b["path"]: b["rows"] for b in blocks}
    return sorted(rows), sum(rows.values())


def _staged(files: Sequence[str], columns: Sequence[str]):
    """The staged documents (`columns` of them) as a dataset read a file per task, never materialized."""
    import ray

    return (ray.data.from_items([{"path": f} for f in files], override_num_blocks=max(len(files), 1))
            .map_batches(ingest.read_staged, batch_size=1, batch_format="numpy", fn_kwargs={"columns": columns}))


def _band_map(path: str, bands: int, parts: int, first: int, last: int) -> list[dict[str, np.ndarray]]:
    """Exchange 1, map: a staged block's band rows of bands [first, last), one dict of columns per partition."""
    rows = dedup.band_rows(ingest.open_staged(path, ingest.FINGERPRINT_COLUMNS), bands, parts, first, last)
    order, cuts = exchange.by_part(rows.pop("part"), range(parts))
    return [{c: v[order[cuts[p]:cuts[p + 1]]] for c, v in rows.items()} for p in range(parts)]


def _bucket_reduce(*pieces: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dedup.buckets({c: np.concatenate([p[c] for p in pieces]) for c in pieces[0]})


def _route_map(path: str, table: tuple, group: tuple[int, int]) -> list[pa.Table]:
    """Exchange 2, map: a staged block's candidate documents (part, slot, text), one table per partition of
    [group[0], group[1])."""
    rows = dedup.route_rows(ingest.open_staged(path, ("id_hi", "id_lo", "text")), *table)
    order, cuts = exchange.by_part(rows.column("part").to_numpy(), range(*group))
    rows = rows.take(pa.array(order))
    return [rows.slice(cuts[k], cuts[k + 1] - cuts[k]) for k in range(group[1] - group[0])]


def _confirm_reduce(slots: tuple[np.ndarray, np.ndarray], params: dedup.Params, *pieces: pa.Table) -> pa.Table:
    if not len(slots[0]):  # a partition no pair was routed to
        return CONFIRM_SCHEMA.empty_table()
    return dedup.confirm(pa.concat_tables(pieces), *slots, params).cast(CONFIRM_SCHEMA)


@dataclass
class Found:
    """Every removal dedup decided, and what the report shows of it."""

    exact: pa.Table  # doc_id, kept_doc_id: removed exact copies and their group's survivor
    near: dedup.Near
    removed: tuple[np.ndarray, np.ndarray]  # (hi, lo) of every removed document, sorted
    picture: report.DedupPicture


CONFIRM_SCHEMA = pa.schema([("slot_a", pa.int64()), ("slot_b", pa.int64()), ("similarity", pa.float64())])
SNIPPET = 300  # characters of each text examples.json quotes


def _snippets(files: Sequence[str], doc_ids: Sequence[str]) -> dict[str, str]:
    """The first SNIPPET characters of a few documents' texts, read from the staged blocks (ids first, text only
    where one of them is)."""
    wanted, out = pa.array(sorted(set(doc_ids)), pa.string()), {}
    for path in files if len(wanted) else ():
        ids = ingest.open_staged(path, ("doc_id",)).column("doc_id")
        hits = pc.is_in(ids, value_set=wanted)
        if pc.any(hits).as_py():
            rows = ingest.open_staged(path, ("doc_id", "text")).filter(hits)
            out.update(zip(rows.column("doc_id").to_pylist(),
                           pc.utf8_slice_codeunits(rows.column("text"), 0, SNIPPET).to_pylist()))
    return out


def _rounds(nbytes: float) -> int:
    """Exchanges of `nbytes` in all are run in this many rounds, so that one round's map outputs and reduce
    inputs (twice its bytes) fit in EXCHANGE_SHARE of the object store: the store is never filled, nothing spills."""
    import ray

    store = ray.cluster_resources().get("object_store_memory", 2 << 30)
    return max(1, int(-(-2 * nbytes // (EXCHANGE_SHARE * store))))


def _buckets(files: Sequence[str], params: dedup.Params, readable: int, cpus: int) -> dict[str, np.ndarray]:
    """Exchange 1: every document's band rows, by partition; exact groups, candidates, bucket sizes, as
    {"exact": (kept_hi, kept_lo, removed_hi, removed_lo), "pair": (a_hi, a_lo, b_hi, b_lo), "size": sizes}.

    The bands are exchanged a group at a time (`_rounds`); bucket keys of different bands never meet, and exact
    groups come from band 0 alone, so the rounds' outputs just add up. Each partition's rows are split by kind as
    they arrive and dropped, so the driver never holds a second copy of them."""
    nbytes = readable * params.bands * dedup.BAND_ROW_BYTES
    rounds = min(_rounds(nbytes), params.bands)
    parts = dedup.partitions(nbytes / rounds, cpus)
    ids = ("a_hi", "a_lo", "b_hi", "b_lo")
    out: dict[str, list] = {"exact": [], "pair": [], "size": [np.zeros(0, np.int64)]}
    for r in range(rounds):
        first, last = r * params.bands // rounds, (r + 1) * params.bands // rounds
        results = exchange.shuffle(files, _band_map, _bucket_reduce, parts, (params.bands, parts, first, last))
        while results:
            rows = results.pop()
            for name, kind in (("exact", dedup.EXACT), ("pair", dedup.PAIR)):
                out[name].append(np.stack([rows[c][rows["kind"] == kind] for c in ids]))
            out["size"].append(rows["size"][rows["kind"] == dedup.BUCKET])
            del rows
    stacked = {k: np.concatenate(out.pop(k) or [np.zeros((4, 0), np.uint64)], axis=1) for k in ("exact", "pair")}
    return {**stacked, "size": np.concatenate(out["size"])}


def _confirm(files: Sequence[str], nodes: dedup.Nodes, a: np.ndarray, b: np.ndarray, params: dedup.Params,
             cpus: int, doc_bytes: float) -> dedup.Near:
    """Exchange 2: route candidate documents to their pairs' partitions, confirm every pair there."""
    import ray

    parts = min(dedup.partitions(len(nodes.hi) * doc_bytes, cpus, dedup.CONFIRM_BYTES), len(a))
    routes = dedup.route(nodes, a, b, parts, max_component=max(2, int(dedup.CONFIRM_BYTES // max(doc_bytes, 1))))
    first = np.searchsorted(routes.node, np.arange(len(nodes.hi)))
    count = np.bincount(routes.node, minlength=len(nodes.hi))
    table = ray.put((nodes.hi, nodes.lo, first, count, routes.part))
    pair_slots = [ray.put(slots) for slots in routes.pair_slots]
    rounds = min(_rounds(len(routes.node) * doc_bytes), parts)  # a group of partitions at a time
    found = [CONFIRM_SCHEMA.empty_table()]
    for r in range(rounds):
        group = (r * parts // rounds, (r + 1) * parts // rounds)
        found += exchange.shuffle(files, _route_map, _confirm_reduce, group[1] - group[0], (table, group),
                                  lambda k: (pair_slots[group[0] + k], params))
    near = dedup.resolve(nodes, pa.concat_tables(found), routes.node, params.threshold)
    exchange.release_memory()
    return near


def _find_duplicates(files: Sequence[str], params: dedup.Params, readable: int, text_bytes: int, cpus: int,
                     lap) -> Found:
    """Exchange 1 (buckets), the candidate graph, exchange 2 (confirm) and the components of confirmed pairs."""
    rows = _buckets(files, params, readable, cpus)
    kept_hi, kept_lo, exact_hi, exact_lo = rows.pop("exact")
    bucket_sizes = rows.pop("size")
    exact = pa.table({"doc_id": ingest.hex_ids(exact_hi, exact_lo), "kept_doc_id": ingest.hex_ids(kept_hi, kept_lo)})
    nodes, a, b = dedup.candidate_graph(rows.pop("pair"))  # a row per (bucket, band) pair: freed in there
    exchange.release_memory()
    lap("buckets_s")
    near = dedup.Near(dedup.EDGE_SCHEMA.empty_table(), dedup.NO_NEAR, (np.zeros(0, np.uint64),) * 2,
                      np.zeros(0), np.zeros(0, np.int64))
    if len(a):
        near = _confirm(files, nodes, a, b, params, cpus, text_bytes / max(readable, 1))
    hi = np.concatenate([exact_hi, near.removed_ids[0]])
    lo = np.concatenate([exact_lo, near.removed_ids[1]])
    order = np.lexsort((lo, hi))
    group_sizes = pc.value_counts(exact.column("kept_doc_id")).field("counts").to_numpy() + 1
    picture = report.DedupPicture(params.threshold, near.candidate_similarity, group_sizes, near.cluster_sizes,
                                  bucket_sizes)
    lap("confirm_s")
    return Found(exact, near, (hi[order], lo[order]), picture)


# ---------------------------------------------------------------- the stage


def run(cfg: CorpusConfig, *, inputs: dict, out: Path, ctx: StageContext) -> StageResult:
    """Build the corpus artifact in `out`:

        train/*.parquet, validation/*.parquet   doc_id, text (original), source (its file); with named sources
                                                also source_name
        duplicates.parquet                      doc_id, kept_doc_id, similarity, kind (exact|near);
                                                kept_doc_id is always a document of train/ or validation/
        near_pairs.parquet                      a, b, similarity: every confirmed near-duplicate pair
        rejected.parquet                        path, reason (unreadable files, undecodable or oversized records)
        filtered.parquet                        doc_id, path, source, rule, value, language: every document a
                                                quality rule, language identification or decontamination removed, and why
        report.json, examples.json, dedup.png   counts, bytes, timings, the dedup distributions; a few pairs
        filters.png                             documents removed by rule and source
        sources.json                            named sources only: per source its spec and documents (`by_source`)
    """
    with _data_context():
        return _run(cfg, inputs["raw"], Path(out), inputs)


def _run(cfg: CorpusConfig, raw: RawCorpus, out: Path, inputs: dict) -> StageResult:
    import ray

    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        timings[name], clock = round(time.perf_counter() - clock, 3), time.perf_counter()

    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    decontaminate = inputs.get(decontamination.INPUT)
    filters = Filters(tuple(resolve_filters(cfg.filters).items()), cfg.languages, cfg.language_threshold,
                      decontaminate.tasks if decontaminate else ())
    fp = ingest.Fingerprinter(MinHasher(cfg.num_perm, cfg.seed, cfg.shingle, cfg.shingle_size), bands, rows, filters)
    stage = out / STAGED
    stage.mkdir()
    sources = raw.sources
    files, n_docs = _ingest(raw, cfg, fp, cpus, stage)
    lap("ingest_s")
    audited = audit.write(_staged(files, audit.COLUMNS).map_batches(
        audit.audit_rows, batch_format="pyarrow", fn_kwargs={"names": raw.names()}), out)
    n_rejected, n_filtered, text_bytes = audited.rejected, audited.filtered, audited.text_bytes
    if n_rejected == n_docs:
        shard.raise_no_documents(out, len(sources))
    audit.check_left(audited)
    for line in audit.warnings(audited):
        print(f"[corpus] {line}", flush=True)
    lap("rejected_s")
    found = _find_duplicates(files, dedup.Params(bands, cfg.shingle, cfg.shingle_size, cfg.threshold),
                             n_docs - n_rejected - n_filtered, text_bytes, cpus, lap)
    if raw.blend:  # before the splits: a source dedup leaves empty stops the stage with nothing written there
        read = by_source.readable(files, len(raw.blend))
        kept = by_source.check_kept(raw.blend, read, found.removed[0])
    n_split = shard.write_splits(_staged(files, ingest.STAGED_COLUMNS), found.removed, cfg, out, raw.names())
    quoted = report.example_pairs(found.near.edges)
    snippets = _snippets(files, quoted.column("a").to_pylist() + quoted.column("b").to_pylist())
    shutil.rmtree(stage)
    shard.write_duplicates(out / "duplicates.parquet", found.exact, found.near.removed)
    shard.write_near_pairs(out / "near_pairs.parquet", found.near.edges)
    lap("write_s")
    counts = report.counts(len(sources), n_docs, n_rejected, n_split, found.exact.num_rows,
                           found.near.removed.num_rows, found.near.edges.num_rows, found.picture, n_filtered)
    timings["total_s"] = round(sum(timings.values()), 3)
    body = report.build(cfg, sources, counts, timings, text_bytes, bands, rows, dedup.MAX_BUCKET)
    body["filters"] = {"rules": resolve_filters(cfg.filters), **audited.summary()}
    if decontaminate:
        body["filters"]["decontaminate"] = decontaminate.source
    if raw.blend:
        body["sources"] = by_source.write(out, raw.blend, raw.ranks, read, kept,
                                          [audited.removed_from(s.name) for s in raw.blend])
    logged = report.write(out, body, found.picture, found.exact, found.near.edges, snippets)
    logged += (by_source.SOURCES,) if raw.blend else ()
    audit.plot(audited, out / audit.PLOT)
    logged += (audit.PLOT,)
    metrics = {
        "duplicate_fraction": (counts["exact_duplicates_removed"] + counts["near_duplicates_removed"]) / n_docs,
        "rejected_fraction": n_rejected / n_docs,
        "filtered_fraction": n_filtered / n_docs,
        **audited.metrics(),
        "documents_per_s": n_docs / max(timings["total_s"], 1e-9),
        **{f"time_{k}": v for k, v in timings.items()},
    }
    removed_by_filters = f"{n_filtered} removed by the filters, " if filters.on else ""
    summary = (f"{counts['documents_out']} of {n_docs} documents kept ({removed_by_filters}"
               f"{counts['exact_duplicates_removed']} exact and {counts['near_duplicates_removed']} near duplicates "
               f"removed, {n_rejected} rejected)")
    return StageResult(metrics=metrics, counts=counts, log_files=logged, summary={"corpus": summary})
