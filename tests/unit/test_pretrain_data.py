"""The pretraining data order (`stages.pretrain.data`) on real Parquet files whose rows carry their own index."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import stages.pretrain.data as data
from stages.pretrain.loop import numpy_columns
from tests.data_order import mixing_deviation, sequence_order

MICRO, BUFFER, WORLD = 8, 300, 2


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> list[data.Block]:
    """3 shards of 700, 1100 and 90 rows (row groups of 512): input_ids row i = [i, i, i, i]."""
    root, start, files = tmp_path_factory.mktemp("train"), 0, []
    for k, n in enumerate((700, 1100, 90)):
        ids = np.repeat(np.arange(start, start + n, dtype=np.uint32), 4)
        table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 4)})
        pq.write_table(table, root / f"part-{k:05d}.parquet", row_group_size=512)
        files.append(str(root / f"part-{k:05d}.parquet"))
        start += n
    return data.blocks(files)


def test_blocks_cover_every_sequence_once(split):
    assert all(b.rows <= data.BLOCK_ROWS for b in split)
    covered = np.concatenate([b.offset + np.arange(b.rows) for b in split])
    assert covered.tolist() == list(range(1890))


def test_ranks_read_what_the_order_says_disjoint_and_equal(split):
    orders = [sequence_order(split, 7, 0, r, WORLD, MICRO, BUFFER) for r in range(WORLD)]
    want = data.batches_per_epoch(split, 7, 0, WORLD, MICRO)
    assert want > 0 and all(len(o) == want * MICRO for o in orders)
    assert len(np.intersect1d(*orders)) == 0  # no sequence twice in an epoch
    for rank, order in enumerate(orders):
        read = [numpy_columns(t)["input_ids"] for t in
                data.rank_batches(split, 7, 0, rank, WORLD, MICRO, BUFFER, ["input_ids"])]
        assert len(read) == want and all(b.shape == (MICRO, 4) for b in read)
        assert np.concatenate(read)[:, 0].tolist() == order.tolist()


def test_epochs_differ_and_the_order_is_a_pure_function(split):
    first = sequence_order(split, 7, 0, 0, WORLD, MICRO, BUFFER)
    again = sequence_order(split, 7, 0, 0, WORLD, MICRO, BUFFER)
    second = sequence_order(split, 7, 1, 0, WORLD, MICRO, BUFFER)
    assert first.tolist() == again.tolist()
    assert (first[:len(second)] != second[:len(first)]).mean() > 0.9
    # Within a window, the local shuffle mixes blocks: the first micro-batch spans several blocks.
    assert len({int(i) // data.BLOCK_ROWS for i in first[:MICRO]}) > 1


def test_mixing_deviation_tells_sorted_from_shuffled():
    labels = np.r_[np.zeros(3000, int), np.ones(1000, int)]  # sorted by source: 75% / 25%
    assert mixing_deviation(labels) == pytest.approx(75.0)
    shuffled = np.random.default_rng(0).permutation(labels)
    assert mixing_deviation(shuffled) < 10
