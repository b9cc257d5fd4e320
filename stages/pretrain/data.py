"""The order pretraining reads the train split in: seeded blocks per epoch, dealt to the ranks, shuffled locally.

The tokenize stage already wrote the train split as one seeded global permutation of its sequences, so any
stretch of it mixes the whole corpus. On top of that, every epoch reads it in a different order:

1. the split is cut into blocks of at most BLOCK_ROWS consecutive sequences (Parquet row groups, sliced);
2. epoch e permutes the blocks with a generator seeded by (seed, e) and deals them round-robin to the ranks;
3. each rank reads its blocks in that order and shuffles windows of `shuffle_buffer` sequences, seeded by
   (seed, e, rank, window);
4. every rank yields the same number of micro-batches in an epoch (the smallest rank's count), so collective
   steps stay aligned; the few sequences past it wait for another epoch's deal.

The order is a pure function of (files, seed, epoch, world, micro-batch size, buffer): a resumed worker re-opens
its epoch and skips to the saved micro-batch. Written here rather than through Ray Data because its per-execution
reseeding (`RandomSeedConfig`) counts executions, not epochs: a restarted worker group would not replay the saved
epoch's order. Each rank reads the shared workdir directly, like the validation sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BLOCK_ROWS = 256
"""Sequences per block: small enough that a few thousand sequences still give every rank several blocks."""


@dataclass(frozen=True)
class Block:
    path: str
    row_group: int
    start: int
    """First row of the block within its row group."""
    rows: int
    offset: int
    """Index of the block's first sequence in the whole split (file order): a sequence's identity."""


def blocks(files: Sequence[str]) -> list[Block]:
    """The train split cut into blocks of at most BLOCK_ROWS sequences, in file order (from Parquet metadata)."""
    split, offset = [], 0
    for path in files:
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            for s in range(0, n, BLOCK_ROWS):
                split.append(Block(path, g, s, min(BLOCK_ROWS, n - s), offset))
                offset += split[-1].rows
    return split


def deal(n_blocks: int, seed: int, epoch: int, world: int) -> list[np.ndarray]:
    """Block indices of each rank in epoch `epoch`: one seeded permutation of all blocks, dealt round-robin."""
    order = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    return [order[rank::world] for rank in range(world)]


def batches_per_epoch(split: Sequence[Block], seed: int, epoch: int, world: int, micro: int) -> int:
    """Micro-batches every rank yields in this epoch: the least any rank's blocks can fill."""
    rows = np.array([b.rows for b in split])
    return min(int(rows[mine].sum()) // micro for mine in deal(len(split), seed, epoch, world))


def windows(split: Sequence[Block], seed: int, epoch: int, rank: int, world: int,
            buffer: int) -> Iterator[tuple[list[Block], np.ndarray]]:
    """(blocks, order): consecutive blocks of this rank holding >= `buffer` sequences (one block when
    buffer <= 1), and the order in which their concatenated rows are consumed (seeded by (seed, epoch, rank,
    window))."""
    mine = [split[i] for i in deal(len(split), seed, epoch, world)[rank]]
    window: list[Block] = []
    for k, block in enumerate(mine):
        window.append(block)
        rows = sum(b.rows for b in window)
        if rows >= max(buffer, 1) or k == len(mine) - 1:
            order = (np.random.default_rng([seed, epoch, rank, k]).permutation(rows) if buffer > 1
                     else np.arange(rows))
            yield window, order
            window = []


def rank_batches(split: Sequence[Block], seed: int, epoch: int, rank: int, world: int, micro: int, buffer: int,
                 columns: Sequence[str]) -> Iterator[pa.Table]:
    """This rank's micro-batches of epoch `epoch` (exactly `batches_per_epoch` of them) with `columns`.
    Memory: one window (`shuffle_buffer` sequences plus a block) and one micro-batch."""
    want = batches_per_epoch(split, seed, epoch, world, micro)
    given, carry = 0, None
    for window, order in windows(split, seed, epoch, rank, world, buffer):
        parts = [pq.ParquetFile(b.path).read_row_group(b.row_group, columns=list(columns)).slice(b.start, b.rows)
                 for b in window]
        table = pa.concat_tables(parts).take(pa.array(order))
        if carry is not None:
            table = pa.concat_tables([carry, table])
        while len(table) >= micro and given < want:
            yield table.slice(0, micro)
            table, given = table.slice(micro), given + 1
        if given == want:
            return
        carry = table

