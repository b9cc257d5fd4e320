"""The pretraining data order (`stages.pretrain.data`) on real Arrow IPC shards whose rows carry their own index."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import stages.pretrain.data as data
from tests.data_order import mixing_deviation

MICRO, WORLD, N = 8, 2, 1890


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> data.Sequences:
    """3 shards of 700, 1100 and 90 rows (record batches of at most 512): input_ids row i = [i, i, i, i],
    length i % 7."""
    root, start, files = tmp_path_factory.mktemp("train"), 0, []
    for k, n in enumerate((700, 1100, 90)):
        ids = np.repeat(np.arange(start, start + n, dtype=np.uint32), 4)
        table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 4),
                          "length": pa.array(np.arange(start, start + n) % 7, type=pa.int32())})
        with pa.ipc.new_file(str(root / f"part-{k:05d}.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=512)
        files.append(str(root / f"part-{k:05d}.arrow"))
        start += n
    return data.Sequences(files, ["input_ids", "length"])


def test_rows_are_read_by_index_across_shards_and_record_batches(split):
    assert len(split) == N and len(split.chunks) == 2 + 3 + 1  # 700 = 512 + 188, 1100 = 512 + 512 + 76
    index = np.array([1889, 0, 511, 512, 699, 700, 1799, 5, 1800])
    rows = split.take(index)
    assert rows["input_ids"].dtype == np.uint32 and rows["input_ids"].shape == (9, 4)
    assert (rows["input_ids"] == index[:, None]).all() and (rows["length"] == index % 7).all()


def test_ranks_read_disjoint_equal_shares_of_one_permutation(split):
    want = data.batches_per_epoch(N, WORLD, MICRO)
    orders = [data.rank_order(N, 7, 0, r, WORLD, MICRO) for r in range(WORLD)]
    assert want == N // WORLD // MICRO and all(len(o) == want * MICRO for o in orders)
    assert len(np.intersect1d(*orders)) == 0 and len(np.unique(np.concatenate(orders))) == want * MICRO * WORLD
    for rank, order in enumerate(orders):
        read = [b["input_ids"] for b in data.rank_batches(split, 7, 0, rank, WORLD, MICRO)]
        assert len(read) == want and all(b.shape == (MICRO, 4) for b in read)
        assert np.concatenate(read)[:, 0].tolist() == order.tolist()
    # A resumed worker starts at its saved micro-batch: the same batches from there on.
    later = [b["input_ids"] for b in data.rank_batches(split, 7, 0, 1, WORLD, MICRO, start=want - 3)]
    assert np.concatenate(later)[:, 0].tolist() == orders[1][(want - 3) * MICRO:].tolist()


def test_epochs_differ_and_the_order_is_a_pure_function(split):
    first = data.rank_order(N, 7, 0, 0, WORLD, MICRO)
    assert first.tolist() == data.rank_order(N, 7, 0, 0, WORLD, MICRO).tolist()
    assert (first != data.rank_order(N, 7, 1, 0, WORLD, MICRO)).mean() > 0.9
    assert (first != data.rank_order(N, 8, 0, 0, WORLD, MICRO)).mean() > 0.9
    # Uniform over the whole split: a split of 200,000 sequences in three sources, one after the other, is read
    # with every source's share within 2 points of its overall share in every 5% stretch of a rank's order.
    sources = np.digitize(data.rank_order(200_000, 7, 0, 1, WORLD, MICRO), [50_000, 150_000])
    assert mixing_deviation(sources) < 2 and mixing_deviation(np.sort(sources)) > 40


def test_mixing_deviation_tells_sorted_from_shuffled():
    labels = np.r_[np.zeros(3000, int), np.ones(1000, int)]  # sorted by source: 75% / 25%
    assert mixing_deviation(labels) == pytest.approx(75.0)
    shuffled = np.random.default_rng(0).permutation(labels)
    assert mixing_deviation(shuffled) < 10
