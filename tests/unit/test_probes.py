"""The probes' bookkeeping (`stages.pretrain.probes`): which steps, which grid point, which seeds collapsed, the ledger
on disk, and one probe trial training until its dev metric stops improving. The probes as a whole run in
tests/integration/test_pretrain.py (the ZeRO-3 restart test)."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from core.config import PretrainConfig
from stages.pretrain import probes


def test_probe_steps_are_zero_every_interval_and_the_last():
    cfg = PretrainConfig(max_steps=2_500, ckpt_interval=500, probe_interval=1_000, probes=("wnut16-ner",))
    assert probes.probe_steps(cfg) == [0, 1_000, 2_000, 2_500]
    assert probes.probe_steps(replace(cfg, max_steps=2_000)) == [0, 1_000, 2_000]


def test_the_grid_point_with_the_best_seed_mean_is_reported_with_its_sample_spread():
    task = SimpleNamespace(metric="f1")
    trials = {(1e-3, 0): 0.50, (1e-3, 1): 0.70, (3e-3, 0): 0.58, (3e-3, 1): 0.60}  # means 0.60 and 0.59
    out = probes.summarize(task, trials)
    assert out["lr"] == 1e-3 and out["mean"] == pytest.approx(0.60)
    assert out["std"] == pytest.approx(math.sqrt(((0.5 - 0.6) ** 2 + (0.7 - 0.6) ** 2) / 1))  # ddof=1
    assert out["per_seed"] == {"0": 0.50, "1": 0.70}
    assert probes.summarize(task, {(1e-3, 0): 0.4})["std"] == 0.0  # one seed: no spread


def test_a_collapsed_seed_is_a_failed_trial_not_part_of_the_mean():
    task = SimpleNamespace(metric="f1")
    # far below its siblings: 0.02 is 0.54 under the median, where 3 spreads of the others (0.014, floored) is 0.06
    trials = {(1e-3, 0): 0.55, (1e-3, 1): 0.57, (1e-3, 2): 0.02, (3e-3, 0): 0.50, (3e-3, 1): 0.52, (3e-3, 2): 0.45}
    out = probes.summarize(task, trials, baseline=0.3)
    assert out["failed"] == [{"lr": 1e-3, "seed": 2, "value": 0.02}]  # 0.45 is an ordinary seed: kept
    assert out["lr"] == 1e-3 and out["mean"] == pytest.approx(0.56) and out["per_seed"] == {"0": 0.55, "1": 0.57}
    assert out["std"] == pytest.approx(math.sqrt(2 * 0.01 ** 2))
    # below the task's baseline while its siblings are above it: failed, however close
    out = probes.summarize(task, {(1e-3, 0): 0.62, (1e-3, 1): 0.60, (1e-3, 2): 0.58}, baseline=0.59)
    assert [f["seed"] for f in out["failed"]] == [2] and out["mean"] == pytest.approx(0.61)
    # every seed below the baseline: what the model learns, not a collapse - all averaged
    out = probes.summarize(task, {(1e-3, 0): 0.10, (1e-3, 1): 0.12, (1e-3, 2): 0.08}, baseline=0.5)
    assert out["failed"] == [] and out["mean"] == pytest.approx(0.10)
    # two of three collapsed: the median is theirs, so nothing is left out and the grid point's mean is low
    assert probes.summarize(task, {(1e-3, 0): 0.01, (1e-3, 1): 0.02, (1e-3, 2): 0.6}, baseline=0.3)["failed"] == []


def test_a_probe_trial_trains_until_its_dev_metric_stops_improving():
    """A probe trains to convergence, not for a fixed few epochs: the budget (steps) becomes whole epochs, and the
    trial ends `patience` evaluations after its best one. Here the best epoch comes after 6 epochs, the fixed count
    probes once had, after a plateau at chance longer than a patience of 4 would wait out."""
    import numpy as np

    from deberta.config import debug
    from stages.finetune.kinds.base import Encoded
    from stages.finetune.kinds.sequence import KIND
    from stages.finetune.trial import TrialSetup
    from stages.pretrain.objectives import objective_for

    def split(n: int, seed: int) -> Encoded:  # the label is whether the first token is below 22: half of each
        ids = np.random.default_rng(seed).integers(5, 40, (n, 8)).astype(np.int32)
        ids[:, 0], ids[:, -1] = 1, 2  # [CLS] ... [SEP]
        return Encoded(ids, (ids[:, 1] < 22).astype(np.float32), "classification")

    cfg = PretrainConfig(probes=("t",), probe_examples=64, probe_batch_size=16, probe_max_steps=100, probe_patience=8)
    ft = probes.finetune_config(cfg, "t", train_rows=64)
    assert ft.epochs == 25 and probes.finetune_config(replace(cfg, probe_max_steps=101), "t", 64).epochs == 26
    model = debug(vocab_size=64, num_hidden_layers=1)
    setup = TrialSetup(model, 2, KIND, "accuracy", ft)
    weights = probes.initial_backbone(objective_for(cfg), model, seed=0)
    config = {"lr": 5e-4, "seed": 0, "dropout": 0.0, "batch_size": 16, "warmup_steps": 0}
    out = probes.probe_trial(setup, config, (split(64, 0), split(64, 1)), weights, patience=8)
    assert out["value"] >= 0.9 and out["epoch"] > 6, out  # learnt, and later than 6 epochs
    assert out["epochs"] == out["epoch"] + 8 < ft.epochs and out["converged"], out  # stopped: not the whole budget


def test_the_ledger_is_replaced_whole_and_read_back(tmp_path):
    run_dir = str(tmp_path / "run")
    assert probes.read_ledger(run_dir) == {}
    probes.write_ledger(run_dir, {0: {"t": {"mean": 0.1}}})
    probes.write_ledger(run_dir, {0: {"t": {"mean": 0.1}}, 30: {"t": {"mean": 0.2}}})
    assert probes.read_ledger(run_dir) == {0: {"t": {"mean": 0.1}}, 30: {"t": {"mean": 0.2}}}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [probes.LEDGER]  # no temporary left behind


def test_the_plot_has_each_probe_its_baseline_its_collapsed_seeds_and_the_loss(tmp_path):
    ledger = {s: {"t": {"metric": "f1", "mean": 0.5 + s / 1e4, "std": 0.01, "baseline": 0.4,
                        "baseline_name": "majority baseline",
                        "failed": [{"lr": 1e-3, "seed": 2, "value": 0.05}] if s == 1_000 else []}}
              for s in (0, 1_000, 2_000)}
    labels = probes.plot(ledger, [(0, 9.0), (1_000, 6.0), (2_000, 5.5)], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1_000
    assert sorted(labels) == ["t collapsed seeds (not in the mean)", "t dev f1", "t majority baseline",
                              "validation loss"]
    assert probes.summary_line(ledger) == "t f1 0.500 (step 0) -> 0.700 ± 0.010 (step 2000) (probes.png)"
    assert probes.summary_line(ledger, {"t": {"figure": "3 of 48 (6.2%)"}}) == \
        "t f1 0.500 (step 0) -> 0.700 ± 0.010 (step 2000), dev contamination: 3 of 48 (6.2%) (probes.png)"
