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
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa


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


def batches_per_epoch(n: int, world: int, micro: int) -> int:
    """Micro-batches every rank yields in an epoch of `n` sequences."""
    return n // world // micro


def rank_order(n: int, seed: int, epoch: int, rank: int, world: int, micro: int) -> np.ndarray:
    """(batches_per_epoch * micro,) indices of the sequences this rank consumes in the epoch, in order."""
    return epoch_order(n, seed, epoch)[rank::world][:batches_per_epoch(n, world, micro) * micro]


def rank_batches(split: Sequences, seed: int, epoch: int, rank: int, world: int, micro: int,
                 start: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """This rank's micro-batches of epoch `epoch` from micro-batch `start` on (numpy columns of `split`)."""
    mine = rank_order(len(split), seed, epoch, rank, world, micro)
    for b in range(start, len(mine) // micro):
        yield split.take(mine[b * micro:(b + 1) * micro])
