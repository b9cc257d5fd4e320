"""The probes' bookkeeping (`stages.pretrain.probes`): which steps, which grid point, the ledger on disk. The probes
themselves run in tests/integration/test_pretrain.py (the ZeRO-3 restart test)."""

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


def test_the_ledger_is_replaced_whole_and_read_back(tmp_path):
    run_dir = str(tmp_path / "run")
    assert probes.read_ledger(run_dir) == {}
    probes.write_ledger(run_dir, {0: {"t": {"mean": 0.1}}})
    probes.write_ledger(run_dir, {0: {"t": {"mean": 0.1}}, 30: {"t": {"mean": 0.2}}})
    assert probes.read_ledger(run_dir) == {0: {"t": {"mean": 0.1}}, 30: {"t": {"mean": 0.2}}}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [probes.LEDGER]  # no temporary left behind


def test_the_plot_has_each_probe_and_the_loss(tmp_path):
    ledger = {s: {"t": {"metric": "f1", "mean": 0.5 + s / 1e4, "std": 0.01}} for s in (0, 1_000, 2_000)}
    probes.plot(ledger, [(0, 9.0), (1_000, 6.0), (2_000, 5.5)], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1_000
    assert probes.summary_line(ledger) == "t f1 0.500 (step 0) -> 0.700 ± 0.010 (step 2000) (probes.png)"
