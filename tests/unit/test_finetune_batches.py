"""Fine-tuning epochs: the same batches for a torch trial and every DeepSpeed worker count."""

import numpy as np
import pytest

from stages.finetune.trial import epoch_batches, steps_per_epoch


# (n, batch, world) -> the batch sizes of one epoch, worked out by hand: full batches in order, then the rest
# unless it is too small to give every worker an example (with one worker it is always kept)
CASES = [
    (100, 32, 1, [32, 32, 32, 4]),
    (100, 32, 4, [32, 32, 32, 4]),  # a last batch of exactly one example per worker is kept
    (97, 16, 8, [16] * 6),  # 1 left over for 8 workers: dropped
    (64, 32, 2, [32, 32]),
    (5, 8, 8, []),  # not one example per worker: an empty epoch
    (7, 8, 2, [7]),
]


@pytest.mark.parametrize("n, batch, world, sizes", CASES)
def test_epoch_batches_cover_the_data_and_split_over_workers(n, batch, world, sizes):
    batches = epoch_batches(n, batch, np.random.default_rng(0), world)
    assert [len(b) for b in batches] == sizes
    assert steps_per_epoch(n, batch, world) == len(sizes)  # what the schedule's total_steps counts
    seen = np.concatenate(batches) if batches else np.zeros(0, dtype=int)
    assert len(set(seen.tolist())) == len(seen) == sum(sizes)  # no example twice in an epoch
    assert set(seen.tolist()) <= set(range(n))
    if world == 1:
        assert sorted(seen.tolist()) == list(range(n))
    shares = [np.concatenate([b[r::world] for b in batches]) for r in range(world)] if batches else []
    assert sum(len(s) for s in shares) == len(seen)  # the workers' rows partition each batch
    assert all(len(b[r::world]) >= 1 for b in batches for r in range(world))  # every worker has a row every step


def test_each_epoch_draws_a_new_order():
    rng = np.random.default_rng(0)
    first, second = (np.concatenate(epoch_batches(100, 32, rng)) for _ in range(2))
    assert sorted(first) == sorted(second) == list(range(100)) and not np.array_equal(first, second)
    assert not np.array_equal(first, np.arange(100))  # shuffled, not in file order
