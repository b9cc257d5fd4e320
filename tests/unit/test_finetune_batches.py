"""Fine-tuning epochs: the same batches for a torch trial and every DeepSpeed worker count."""

import numpy as np
import pytest

from stages.finetune.trial import epoch_batches, steps_per_epoch


@pytest.mark.parametrize("n, batch, world", [(100, 32, 1), (100, 32, 4), (97, 16, 8), (64, 32, 2), (5, 8, 8), (7, 8, 2)])
def test_epoch_batches_cover_the_data_and_split_over_workers(n, batch, world):
    batches = epoch_batches(n, batch, np.random.default_rng(0), world)
    assert len(batches) == steps_per_epoch(n, batch, world)
    assert all(len(b) >= world for b in batches)  # every worker gets an example in every step
    seen = np.concatenate(batches) if batches else np.zeros(0, dtype=int)
    assert len(set(seen.tolist())) == len(seen)  # no example twice in an epoch
    assert len(seen) >= n - (n % batch)  # at most the short last batch is dropped
    if world == 1:
        assert sorted(seen.tolist()) == list(range(n))
    shares = [np.concatenate([b[r::world] for b in batches]) for r in range(world)] if batches else []
    assert sum(len(s) for s in shares) == len(seen)  # the workers' rows partition each batch
