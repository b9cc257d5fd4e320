"""`--dry-run` for a suite of tasks: its trials, how many run at once, and its time where something measured it.

The time rests on bench/suite.py's run on this machine (SUITE_TABLE, `basis`): the seconds a trial spends per
example and epoch (train examples, capped at `max_train_examples`, plus dev examples: each epoch trains on the one
and scores the other), and the seconds a task costs outside its trials (the data prepared, Tune started, the
champion exported, checked and registered). A plan whose trials differ from the measured ones in what sets their
cost (the model's shape, the sequence length, the trainer, CPUs or GPUs per trial) gets no time: it is unknown.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import FinetuneConfig
from stages.finetune.sweep import grid_size, sweeps_at_once, trials_at_once

if TYPE_CHECKING:
    from deberta.config import DebertaConfig
    from stages.finetune.kinds.base import TaskRef

REPO = Path(__file__).resolve().parents[2]
SUITE_TABLE = "bench/results/suite.json"
"""bench/suite.py's measurement; its `basis` holds the figures and the trial shape they hold for."""
SHAPE_MODEL = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
SHAPE_FINETUNE = ("max_seq_len", "trainer", "cpus_per_trial", "workers_per_trial", "use_gpu", "sift")


def examples(task: "TaskRef", cfg: FinetuneConfig) -> int:
    """Examples a trial reads per epoch: the train examples (at most `max_train_examples`) and the dev examples."""
    train = len(task.train) if cfg.max_train_examples is None else min(len(task.train), cfg.max_train_examples)
    return train + len(task.dev)


def trial_shape(cfg: FinetuneConfig, model: "DebertaConfig") -> dict:
    """What sets a trial's cost per example besides the data: the model's shape and the trial's layout."""
    return {**{k: getattr(model, k) for k in SHAPE_MODEL}, **{k: getattr(cfg, k) for k in SHAPE_FINETUNE}}


def basis(table: str = SUITE_TABLE) -> dict | None:
    """The measured figures (`basis` of SUITE_TABLE), or None without the file."""
    try:
        return json.loads((REPO / table).read_text())["basis"]
    except (OSError, KeyError, ValueError):
        return None


def seconds(cfg: FinetuneConfig, tasks: list["TaskRef"], cpus: int, gpus: int, measured: dict,
            at_once: int | None = None) -> float:
    """The suite's wall time by `measured` (`basis`): its trials' seconds over the trials that run at once, plus
    each task's own seconds over the sweeps side by side (`at_once`, default `sweeps_at_once`; 1: one after
    another). An upper bound with ASHA, which stops trials early."""
    sweeps = min(len(tasks), at_once or sweeps_at_once(cfg, cpus, gpus))
    trials = min(trials_at_once(cfg, cpus, gpus), sweeps * cfg.max_concurrent_trials)
    work = sum(grid_size(cfg) * cfg.epochs * examples(t, cfg) for t in tasks) * measured["trial_s_per_example_epoch"]
    return work / trials + len(tasks) * measured["task_s"] / sweeps


def suite_lines(cfg: FinetuneConfig, model: "DebertaConfig", tasks: list["TaskRef"], cached: int,
                cluster: tuple[int, int] | None) -> list[str]:
    """The dry run's lines about the tasks that will be fine-tuned: trials, concurrency, time."""
    trials = grid_size(cfg) * len(tasks)
    head = (f"  suite: {trials} trials in {len(tasks)} task{'s' if len(tasks) != 1 else ''} to fine-tune"
            + (f" ({cached} cached)" if cached else ""))
    if cluster is None:
        return [f"{head}; the cluster is known once joined: how many run at once and the time are not estimated"]
    cpus, gpus = cluster
    room, sweeps = trials_at_once(cfg, cpus, gpus), min(len(tasks), sweeps_at_once(cfg, cpus, gpus))
    at_once = min(room, sweeps * cfg.max_concurrent_trials)
    lines = [f"{head}; on {cpus} CPUs and {gpus} GPUs {room} trial{'s' if room != 1 else ''} fit at once: "
             f"{sweeps} task{'s' if sweeps != 1 else ''}' sweeps side by side, up to {cfg.max_concurrent_trials} "
             f"trials each, {at_once} at once"]
    measured = basis()
    if measured is None:
        return lines + [f"  time: unknown: no measurement ({SUITE_TABLE} missing: run python -m bench.suite)"]
    if measured["shape"] != trial_shape(cfg, model):
        differ = sorted(k for k, v in trial_shape(cfg, model).items() if measured["shape"].get(k) != v)
        return lines + [f"  time: unknown for these trials: {SUITE_TABLE} measured trials of another "
                        f"{', '.join(differ)} ({measured['preset']} preset's, on {measured['machine']})"]
    total = seconds(cfg, tasks, cpus, gpus, measured)
    asha = ", at most: ASHA stops trials early" if cfg.scheduler == "asha" else ""
    return lines + [f"  time: about {_duration(total)}{asha} ({sum(examples(t, cfg) for t in tasks):,} examples "
                    f"x {cfg.epochs} epochs x {grid_size(cfg)} trials at "
                    f"{measured['trial_s_per_example_epoch'] * 1e3:.3g} ms per example-epoch over {at_once} at once, "
                    f"plus {measured['task_s']:.0f} s per task outside its trials over {sweeps} side by side: "
                    f"measured on {measured['machine']} by python -m bench.suite, {SUITE_TABLE})"]


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"
