"""The order pretraining reads the train split in: one seeded permutation of all sequences per epoch, dealt to the
ranks, each row read by index from the memory-mapped shards (Megatron-LM's shuffle by index).

The tokenize stage writes the packed sequences in corpus order, as Arrow IPC files of fixed-size rows
(`stages.tokenize`); sequence i is the i-th row of the files in name order. Epoch e:

1. draws a permutation of all N sequences with a generator seeded by (seed, e): a uniform order over the whole
   corpus, however it was assembled (source by source, file by file), and a new one every epoch;
2. deals it round-robin to the ranks (rank r takes positions r, r + world, ...), so the sequences that one
   optimizer step consumes on all ranks together are consecutive positions of the permutation;
3. cuts every rank's share into micro-batches; all ranks yield the same number, N // world // micro, so collective
   steps stay aligned, and the few sequences past it are left to another epoch's draw.

The order is a pure function of (N, seed, epoch, world, micro): a resumed worker redraws its epoch and starts at the
saved micro-batch by index arithmetic, reading nothing it skips. A micro-batch is `micro` random rows: one
contiguous read of `max_seq_len` x 4 bytes each from the page cache of a memory map (a file system's, on NFS).
Memory: the epoch's permutation, 4 bytes a sequence (uint32 below 2^32 sequences: 320 MB for 80M sequences of
512 tokens, the paper's 160 GB of text), and the maps' resident pages, which the kernel can drop at any time.
Written here rather than through Ray Data because its per-execution reseeding (`RandomSeedConfig`) counts
executions, not epochs (a restarted worker group would not replay the saved epoch's order), and its
`random_shuffle` moves every row through the object store each epoch. Each rank reads the shared workdir directly.

Named sources (shards with a `source` column, `Blend`): the order blends the sources to their shares as
Megatron-LM's blended dataset index does. Position x of the order belongs to a source chosen by a fixed
interleave of period PERIOD (the Sainte-Lague divisor sequence of the shares: source s's k-th position of a
period comes at time (k + 1/2) / share_s, so every stretch of the order holds each source within a position or
two of its share), and takes that source's next sequence from the source's own stream: its rows in a new
permutation per pass, seeded by (seed, source, pass). A source that runs out starts its next pass while the
others continue (its passes are counted: `Blend.delivered`); none is starved or stopped. "Epoch" stays a block
of N positions of the order (N: all train sequences), so steps 1 to 3 above, resume included, are unchanged: a
position's sequence is a pure function of (x, seed), found by index arithmetic. Memory: the epoch's order (4 bytes
a sequence), each source's row indices and its current pass's permutation (8 bytes a sequence in all), made
CHUNK positions at a time; at 20M sequences an epoch's order takes about twice one permutation's time.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from stages.tokenize import SOURCE_COLUMN, SOURCES_METADATA


class Sequences:
    """The rows of a split's Arrow IPC shards (in file order) as one indexable collection of `columns`, memory-
    mapped: nothing is read until `take` touches it. `input_ids` arrives as (n, max_seq_len) uint32, other columns
    as (n,) arrays."""

    def __init__(self, files: Sequence[str | Path], columns: Sequence[str]):
        self.columns = tuple(columns)
        self.chunks: list[dict[str, np.ndarray]] = []  # per record batch: column -> zero-copy numpy view
        sizes = []
        for path in files:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                missing = [name for name in self.columns if batch.schema.get_field_index(name) < 0]
                if missing:  # shards tokenized before a column existed (doc_index: tokenize version 7)
                    raise RuntimeError(f"{path} has no column {', '.join(missing)}; re-run the tokenize stage "
                                       "(--force tokenize) to write it")
                self.chunks.append({name: _numpy(batch.column(name)) for name in self.columns})
                sizes.append(batch.num_rows)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (chunks + 1,) first row of each
        self.files = [str(f) for f in files]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `index` (in that order) of every column: {name: (len(index), ...) array}."""
        index = np.asarray(index, dtype=np.int64)
        chunk = np.searchsorted(self.starts, index, side="right") - 1  # (B,) record batch of each row
        out = {}
        for name in self.columns:
            first = self.chunks[0][name]
            out[name] = np.empty((len(index), *first.shape[1:]), dtype=first.dtype)
        for c in np.unique(chunk):
            at = np.flatnonzero(chunk == c)
            rows = index[at] - self.starts[c]
            for name in self.columns:
                out[name][at] = self.chunks[c][name][rows]
        return out

    @functools.cached_property
    def blend(self) -> "Blend | None":
        """The named sources' blend of the shards (their `source` column and `sources` metadata), or None."""
        return Blend.of_files(self.files) if self.files else None

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """(n,) the rows of blend epoch `epoch` in order: one permutation of all rows, or the sources' blend."""
        blend = self.blend
        return epoch_order(len(self), seed, epoch) if blend is None else blend.epoch_order(seed, epoch)


def _numpy(column: pa.Array) -> np.ndarray:
    """A record batch's column as a numpy view of the mapped file: fixed-size lists as (n, width)."""
    if pa.types.is_fixed_size_list(column.type):
        return column.flatten().to_numpy(zero_copy_only=True).reshape(len(column), column.type.list_size)
    return column.to_numpy(zero_copy_only=not pa.types.is_string(column.type))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """(n,) a permutation of all sequence indices, seeded by (seed, epoch); uint32 while it fits (half the memory)."""
    order = np.arange(n, dtype=np.uint32 if n < 1 << 32 else np.int64)
    np.random.default_rng([seed, epoch]).shuffle(order)
    return order


def source_pass_order(n: int, seed: int, source: int, p: int) -> np.ndarray:
    """(n,) a permutation of a named source's n rows for its pass `p`, seeded by (seed, source, pass)."""
    order = np.arange(n, dtype=np.uint32 if n < 1 << 32 else np.int64)
    np.random.default_rng([seed, source, p]).shuffle(order)
    return order


def batches_per_epoch(n: int, world: int, micro: int) -> int:
    """Micro-batches every rank yields in an epoch of `n` sequences."""
    return n // world // micro


def deal(order: np.ndarray, rank: int, world: int, micro: int) -> np.ndarray:
    """(batches_per_epoch * micro,) the positions of an epoch's order this rank consumes, in order (step 2)."""
    return order[rank::world][:batches_per_epoch(len(order), world, micro) * micro]


def rank_order(n: int, seed: int, epoch: int, rank: int, world: int, micro: int) -> np.ndarray:
    """(batches_per_epoch * micro,) indices of the sequences this rank consumes in the epoch, in order."""
    return deal(epoch_order(n, seed, epoch), rank, world, micro)


def rank_batches(split: Sequences, seed: int, epoch: int, rank: int, world: int, micro: int,
                 start: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """This rank's micro-batches of epoch `epoch` from micro-batch `start` on (numpy columns of `split`)."""
    mine = deal(split.epoch_order(seed, epoch), rank, world, micro)
    for b in range(start, len(mine) // micro):
        yield split.take(mine[b * micro:(b + 1) * micro])


# ---------------------------------------------------------------- named sources


def source_columns(files: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[dict]] | None:
    """(each row's source rank, its length, the sources' specs) of token shards of named sources, else None."""
    schema = pa.ipc.open_file(pa.memory_map(str(files[0]))).schema
    if SOURCE_COLUMN not in schema.names or not schema.metadata or SOURCES_METADATA not in schema.metadata:
        return None
    chunks = Sequences(files, [SOURCE_COLUMN, "length"]).chunks
    return (np.concatenate([c[SOURCE_COLUMN] for c in chunks]), np.concatenate([c["length"] for c in chunks]),
            json.loads(schema.metadata[SOURCES_METADATA]))


def source_samples(files: Sequence[str], want: int, world: int, micro: int, seed: int) -> dict[str, np.ndarray]:
    """Per named source of a (validation) split, a fixed sample of up to `want` of its rows as (world, per rank)
    indices, whole micro-batches per rank, drawn uniformly (seeded by `seed`); sources with fewer than
    world x micro rows are left out. Empty for one unnamed source."""
    found = source_columns(files) if files else None
    if found is None:
        return {}
    source, _, specs = found
    out = {}
    for s, spec in enumerate(specs):
        rows = np.flatnonzero(source == s)
        per_rank = min(len(rows), want) // world // micro * micro
        if per_rank:
            picked = np.sort(np.random.default_rng([seed, s]).choice(rows, size=per_rank * world, replace=False))
            out[spec["name"]] = picked.reshape(world, per_rank)
    return out


PERIOD = 1 << 20
"""Positions of one period of the interleave: shares are kept to 1 / PERIOD."""
CHUNK = 1 << 22
"""Positions of the order made at a time."""


def shares(specs: Sequence[dict], tokens: np.ndarray) -> np.ndarray:
    """Each source's share of the training tokens: the weights normalised when every source has one, else
    epochs (1 when not given) x its tokens, normalised (`core.corpus_sources.CorpusSource`)."""
    if all(s.get("weight") is not None for s in specs):
        raw = np.array([s["weight"] for s in specs], dtype=np.float64)
    else:
        raw = np.array([s.get("epochs") or 1.0 for s in specs], dtype=np.float64) * tokens
    return raw / raw.sum()


def interleave(row_shares: np.ndarray, period: int = PERIOD) -> np.ndarray:
    """(period,) uint8: the source of each position of one period, the Sainte-Lague divisor sequence of
    `row_shares` (as Megatron-LM's blend, each position goes to the source furthest behind its share; ties to the
    source listed first). A source whose share rounds to no position of the period is refused."""
    times, owners = [], []
    for s, w in enumerate(row_shares):
        k = np.arange(int(np.ceil(w * period)) + len(row_shares) + 1)
        times.append((k + 0.5) / w)
        owners.append(np.full(len(k), s, dtype=np.int64))
    t, o = np.concatenate(times), np.concatenate(owners)
    pattern = o[np.lexsort((o, t))[:period]].astype(np.uint8)
    counts = np.bincount(pattern, minlength=len(row_shares))
    if not counts.all():
        raise ValueError(f"source {int(np.argmin(counts))}'s share {row_shares[np.argmin(counts)]:.2e} is below "
                         f"1/{period} of the order; raise its weight")
    return pattern


@dataclass
class Blend:
    """The blended order of the train split's rows over its named sources (the module docstring, named sources)."""

    names: tuple[str, ...]
    rows: list[np.ndarray]
    """Per source, its rows' indices in the split (corpus order)."""
    tokens: np.ndarray
    """(S,) tokens per source (unpadded lengths summed)."""
    token_shares: np.ndarray
    """(S,) what each source should be of the tokens read."""
    pattern: np.ndarray
    """(PERIOD,) uint8 source of each position of one period."""
    _passes: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, source: np.ndarray, length: np.ndarray, specs: Sequence[dict], period: int = PERIOD) -> "Blend":
        """From each row's source rank and length, and the sources' specs (sources.json: name, weight, epochs)."""
        index = np.uint32 if len(source) < 1 << 32 else np.int64
        rows = [np.flatnonzero(source == s).astype(index) for s in range(len(specs))]
        empty = [spec["name"] for spec, r in zip(specs, rows) if not len(r)]
        if empty:
            raise ValueError(f"source {empty[0]!r} has no sequences in the split to blend")
        tokens = np.array([length[r].sum() for r in rows], dtype=np.float64)
        token_shares = shares(specs, tokens)
        per_row = tokens / np.maximum([len(r) for r in rows], 1)  # a source's mean tokens per sequence
        row_shares = token_shares / per_row
        return cls(tuple(s["name"] for s in specs), rows, tokens, token_shares,
                   interleave(row_shares / row_shares.sum(), period))

    @classmethod
    def of_files(cls, files: Sequence[str]) -> "Blend | None":
        """The blend of token shards with a `source` column (None without: one unnamed source)."""
        found = source_columns(files)
        return None if found is None else cls.of(*found)

    @functools.cached_property
    def positions(self) -> list[np.ndarray]:
        """Per source, its positions within a period."""
        return [np.flatnonzero(self.pattern == s) for s in range(len(self.names))]

    def drawn(self, x: int) -> np.ndarray:
        """(S,) how many sequences each source has given to positions [0, x) of the order."""
        whole, part = divmod(int(x), len(self.pattern))
        return np.array([whole * len(p) + np.searchsorted(p, part) for p in self.positions], dtype=np.int64)

    def sequence(self, s: int, k: np.ndarray, seed: int) -> np.ndarray:
        """The rows of source s's k-th draws: pass k // n in a permutation seeded by (seed, s, pass)."""
        n = len(self.rows[s])
        passes, at = np.divmod(k, n)
        out = np.empty(len(k), dtype=self.rows[s].dtype)
        for p in np.unique(passes):
            mine = passes == p
            out[mine] = self.rows[s][self._pass(seed, s, int(p))[at[mine]]]
        return out

    def _pass(self, seed: int, s: int, p: int) -> np.ndarray:
        """Source s's permutation for pass p; the latest one per source is kept, since consecutive chunks of the
        order mostly read the same pass (4 bytes a row: all sources' together, one epoch permutation's worth)."""
        kept = self._passes.get(s)
        if kept is None or kept[0] != (seed, p):
            kept = self._passes[s] = ((seed, p), source_pass_order(len(self.rows[s]), seed, s, p))
        return kept[1]

    def order(self, start: int, stop: int, seed: int) -> np.ndarray:
        """(stop - start,) the split rows at positions [start, stop) of the order, made CHUNK positions at a time
        (the temporaries stay a few MB however long the epoch)."""
        n = sum(len(r) for r in self.rows)
        out = np.empty(stop - start, dtype=np.uint32 if n < 1 << 32 else np.int64)
        drawn = self.drawn(start)
        for lo in range(start, stop, CHUNK):
            hi = min(lo + CHUNK, stop)
            owner = np.resize(np.roll(self.pattern, -(lo % len(self.pattern))), hi - lo)  # (hi - lo,) sources
            for s in range(len(self.names)):
                at = np.flatnonzero(owner == s)
                out[lo - start + at] = self.sequence(s, drawn[s] + np.arange(len(at)), seed)
                drawn[s] += len(at)
        return out

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        n = sum(len(r) for r in self.rows)
        return self.order(epoch * n, (epoch + 1) * n, seed)

    def delivered(self, steps: int, accumulation: int, world: int, micro: int) -> list[dict]:
        """Per source what `steps` optimizer steps read (each rank `accumulation` micro-batches a step, epochs of
        the order dealt as `deal` does): sequences, passes over the source (sequences / its sequences) and tokens
        (sequences x its mean tokens per sequence); with its documents' share of tokens and the target share."""
        n = sum(len(r) for r in self.rows)
        per_epoch = batches_per_epoch(n, world, micro)
        full, rest = divmod(steps * accumulation, per_epoch)
        drawn = np.zeros(len(self.names), dtype=np.int64)
        for e, used in [(e, per_epoch) for e in range(full)] + [(full, rest)]:
            drawn += self.drawn(e * n + used * world * micro) - self.drawn(e * n)
        sizes = np.array([len(r) for r in self.rows])
        seen = drawn * self.tokens / sizes
        return [{"name": name, "sequences": int(sizes[s]), "tokens": int(self.tokens[s]),
                 "weight": float(self.token_shares[s]), "sequences_seen": int(drawn[s]),
                 "tokens_seen": int(round(seen[s])), "epochs": float(drawn[s] / sizes[s])}
                for s, name in enumerate(self.names)]


def report_lines(report: Sequence[dict]) -> str:
    """`Blend.delivered` as a table: what each source holds and what the run reads of it."""
    lines = ["  source        sequences        tokens  weight   tokens seen   epochs"]
    lines += [f"  {r['name']:<12} {r['sequences']:>10,} {r['tokens']:>13,}  {r['weight']:>6.3f} "
              f"{r['tokens_seen']:>13,}  {r['epochs']:>7.3f}" for r in report]
    return "\n".join(lines)


def lineage_params(report: Sequence[dict]) -> dict[str, object]:
    """`Blend.delivered` as flat MLflow params, source.NAME.FIELD."""
    return {f"source.{r['name']}.{k}": v for r in report for k, v in r.items() if k != "name"}
