"""The sweep: Table 9's grid under Ray Tune, each trial mirrored as a nested MLflow run, and the champion picked.

Every combination of task-layer dropout x warmup steps x learning rate x batch size x seed is one Tune trial
(`tune.grid_search`), optionally cut short by ASHA on the dev metric. The driver hands the token arrays and the
backbone weights to every trial through the object store (`tune.with_parameters`), so trials need no shared
filesystem. Selection: the grid point with the best dev metric (mean over seeds), then its best seed's best epoch.

Faults: a trial whose process, worker or node dies is retried `finetune.max_failures` times (Tune's FailureConfig),
from its newest checkpoint where it has one (trial.py). A re-run of a stage whose driver died restores the Tune
experiment under the same storage path (`Tuner.restore`): finished trials keep their results, the others continue,
and every trial keeps its one MLflow run; a state file the killed driver left cut short is set aside first
(`prepare_restore`). `--force finetune` removes the experiment, so the sweep starts afresh.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import pickletools
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.config import FinetuneConfig, trial_workers
from core.storage import join
from stages.finetune.data import Encoded
from training.checkpoint_files import CUT_SHORT, move_dir, set_aside_if_cut_short, storage_fs

if TYPE_CHECKING:
    import torch

    from stages.finetune.trial import TrialSetup

GRID_KEYS = ("dropout", "warmup_steps", "lr", "batch_size")
"""FinetuneConfig fields that form the Table 9 grid (plus `seeds`, searched as "seed")."""


def param_space(cfg: FinetuneConfig) -> dict[str, Any]:
    """Tune's search space: a grid over every combination of the Table 9 values and the seeds."""
    from ray import tune

    space = {k: tune.grid_search(list(getattr(cfg, k))) for k in GRID_KEYS}
    space["seed"] = tune.grid_search(list(cfg.seeds))
    return space


def grid_size(cfg: FinetuneConfig) -> int:
    return math.prod(len(getattr(cfg, k)) for k in (*GRID_KEYS, "seeds"))


def trials_at_once(cfg: FinetuneConfig, cpus: int, gpus: int) -> int:
    """How many trials a cluster of `cpus` CPUs and `gpus` GPUs holds at once (at least 1): each takes
    `cpus_per_trial` CPUs per process, and a GPU per process with `use_gpu`."""
    workers = trial_workers(cfg)
    room = cpus // (cfg.cpus_per_trial * workers)
    if cfg.use_gpu:
        room = min(room, gpus // workers)
    return max(1, room)


def sweeps_at_once(cfg: FinetuneConfig, cpus: int, gpus: int) -> int:
    """How many tasks' sweeps of a suite run side by side (`tasks_at_once`, else): enough that their trials
    (`max_concurrent_trials` each, Tune's bound per sweep) fill the cluster's room (`trials_at_once`), plus one
    whose trials wait in Ray's queue for the slots a sweep leaves while its driver prepares the data or exports and
    registers the champion, or while its last trials finish. Ray's scheduler holds the suite to the room: a trial
    past it waits for a slot."""
    return cfg.tasks_at_once or -(-trials_at_once(cfg, cpus, gpus) // cfg.max_concurrent_trials) + 1


def _existing_trial_runs(parent, experiment: str) -> dict[str, Any]:
    """trial id -> the MLflow run (entity) of each trial of Tune experiment `experiment` already in the store."""
    runs = parent.client.search_runs([parent.experiment_id], f"tags.`tune.experiment` = '{experiment}'",
                                     max_results=50_000)
    return {r.data.tags["tune.trial_id"]: r for r in runs}


def _trial_runs_callback(parent, metric: str, experiment: str):
    """A Tune callback mirroring each trial as a nested MLflow run of the stage's run.

    One run per trial for the life of the Tune experiment, keyed by (experiment, trial id): a trial restarted by
    a retry, or continued by a restored sweep, logs into the run it had from the epoch after the last one logged
    there; at the end every trial's run hangs under the stage run that finished the sweep.
    Written here rather than Ray's MLflowLoggerCallback, which cannot nest under a run it did not start and
    would import mlflow outside core/lineage.py and core/registry.py.
    """
    from ray import tune

    class TrialRuns(tune.Callback):
        def __init__(self):
            self.runs: dict[str, Any] = {}
            self.logged: dict[str, int] = {}  # trial id -> last epoch in its run
            self.known: dict[str, Any] = {}

        def setup(self, **info):
            self.known = _existing_trial_runs(parent, experiment)

        def on_trial_start(self, iteration, trials, trial, **info):
            if trial.trial_id in self.runs:  # restarted after a failure: the same run
                return
            known = self.known.get(trial.trial_id)
            if known is None:
                run = parent.child(f"trial-{trial.trial_id}", {"tune.trial_id": trial.trial_id,
                                                               "tune.trial_name": str(trial),
                                                               "tune.experiment": experiment})
                run.log_params(dict(trial.config))
                self.logged[trial.trial_id] = 0
            else:  # started by an earlier attempt of the stage
                run = dataclasses.replace(parent, run_id=known.info.run_id)
                run.set_tags({"mlflow.parentRunId": parent.run_id})
                run.client.update_run(run.run_id, status="RUNNING")
                history = run.client.get_metric_history(run.run_id, "train_loss")
                self.logged[trial.trial_id] = max((int(m.step) for m in history), default=0)
            self.runs[trial.trial_id] = run

        def on_trial_result(self, iteration, trials, trial, result, **info):
            epoch = int(result["epoch"])
            if epoch <= self.logged.get(trial.trial_id, 0):  # an epoch repeated after a resume
                return
            keys = [k for k in result if k.startswith("dev_") or k in ("train_loss", "sift_loss", "lr")]
            self.runs[trial.trial_id].log_metrics({k: result[k] for k in keys}, step=epoch)
            self.logged[trial.trial_id] = epoch

        def on_trial_complete(self, iteration, trials, trial, **info):
            run = self.runs.pop(trial.trial_id, None)
            if run is not None:
                last = trial.last_result or {}
                run.set_tags({"tune.epochs": last.get("epoch", 0), "tune.metric": metric})
                run.end("FINISHED")

        def on_trial_error(self, iteration, trials, trial, **info):
            run = self.runs.pop(trial.trial_id, None)
            if run is not None:
                run.end("FAILED")

        def on_experiment_end(self, trials, **info):
            # trials an earlier attempt finished: adopted by this attempt's stage run
            for trial in trials:
                known = self.known.get(trial.trial_id)
                if known is not None and known.data.tags.get("mlflow.parentRunId") != parent.run_id:
                    parent.client.set_tag(known.info.run_id, "mlflow.parentRunId", parent.run_id)

    return TrialRuns()


def tensorboard_hint(storage_path: str, name: str, metric: str) -> str:
    """What to type to watch the sweep: Tune writes each trial's results as TensorBoard events (tensorboardX, a Ray
    Tune dependency) and, when a trial ends, its grid point with its best `metric` for the HPARAMS tab."""
    return (f"[finetune] Tune experiment {storage_path}/{name}; watch it live on the Ray dashboard (Jobs, Train) or "
            f"with TensorBoard (pip install -e '.[tensorboard]'):\n"
            f"  tensorboard --logdir {storage_path}/{name} --host 127.0.0.1   "
            f"(HPARAMS ranks the finished trials by ray/tune/best_{metric})")


STATE_PATTERN = "experiment_state-*.json"
"""Tune's experiment-state files (one per driver session); `Tuner.restore` reads the newest name."""


def _whole_pickle(data: bytes) -> bool:
    """Whether `data` is a complete pickle stream: its opcodes are walked, nothing is loaded."""
    try:
        for _ in pickletools.genops(data):
            pass
    except Exception:  # a stream cut short ends mid-opcode or without STOP: genops raises ValueError or EOFError
        return False
    return bool(data)


def prepare_restore(experiment: str) -> bool:
    """Whether the Tune experiment at `experiment` (a local path or a storage URI) can be restored, after setting
    aside what a killed driver left cut short.

    Tune copies its state to the storage path by writing each file in place (`pyarrow.fs.copy_files`), not by a
    rename, and rewrites the experiment state every few seconds. A driver killed in that window leaves the file cut
    short; `Tuner.restore` reads only the newest, and on a parse error it logs the error and starts every trial
    again, the finished ones too. So: a cut-short `experiment_state-*.json` is renamed out of Tune's pattern
    (`.cut-short`), and the restore takes the newest whole one, an earlier attempt's. With no whole state or
    `tuner.pkl` left, the experiment directory is renamed aside and the sweep starts over. Nothing is deleted; what
    was set aside is printed."""
    import pyarrow.fs as pafs

    fs, root = storage_fs(experiment)
    entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    if not entries:
        return False
    names = {Path(e.path).name: e.path for e in entries if e.type == pafs.FileType.File}
    whole = False
    for name in sorted(fnmatch.filter(names, STATE_PATTERN), reverse=True):
        if set_aside_if_cut_short(fs, names[name]):
            print(f"[finetune] the Tune experiment state {names[name]} is cut short (a driver killed while writing "
                  f"it); set aside as {name}{CUT_SHORT}, the restore uses an earlier one", flush=True)
        else:
            whole = True
    if whole and "tuner.pkl" in names:
        with fs.open_input_stream(names["tuner.pkl"]) as f:
            if _whole_pickle(f.readall()):
                return True
    aside = f"{root}.unrestorable-{time.strftime('%Y%m%d-%H%M%S')}"
    move_dir(fs, root, aside)
    print(f"[finetune] the Tune experiment {experiment} has no whole state to restore from (its driver was killed "
          f"while writing it); moved to {aside}, and the sweep starts over", flush=True)
    return False


def run_sweep(cfg: FinetuneConfig, setup: "TrialSetup", data: tuple[Encoded, Encoded],
              weights: dict[str, "torch.Tensor"], storage_path: str, name: str, callbacks: list | None = None):
    """Run the grid under Tune; returns the ResultGrid (every trial, its history and its best checkpoint)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from stages.finetune.trial import deepspeed_trial, torch_trial

    metric = f"dev_{setup.metric}"
    if cfg.trainer == "deepspeed":
        import ray

        # refs inside the parameter: the trial passes them on to its workers, which fetch them themselves
        payload = {"data": ray.put(data), "weights": ray.put(weights)}
        trainable = tune.with_parameters(deepspeed_trial, payload=payload, setup=setup,
                                         storage_path=join(storage_path, f"{name}-train"))
        # The trial function only waits on its Ray Train run, which reserves the workers itself. Tune refuses an
        # empty request, so the trial asks for one byte of memory: nothing a worker needs (a CPU would be).
        resources = {"cpu": 0, "memory": 1}
    else:
        trainable = tune.with_parameters(torch_trial, data=data, weights=weights, setup=setup)
        resources = {"cpu": cfg.cpus_per_trial, "gpu": 1 if cfg.use_gpu else 0}
    scheduler = None
    if cfg.scheduler == "asha":  # grace 1 epoch, halve at each rung; time unit = epochs (one report each)
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=cfg.epochs, grace_period=1,
                                  reduction_factor=2)
    # A trial keeps one checkpoint (num_to_keep=1), so Tune snapshots the experiment state after each epoch's
    # checkpoint: a restore never names a deleted one. Its warning when two snapshots fall within 5 s fires on every
    # short epoch and offers only more kept checkpoints or fewer of them; its slow-snapshot warning (30 s) stays on.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    run_config = tune.RunConfig(
        storage_path=storage_path, name=name, callbacks=callbacks or [], verbose=1,
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1, checkpoint_score_attribute=metric,
                                                checkpoint_score_order="max"),
        failure_config=tune.FailureConfig(max_failures=cfg.max_failures))
    trainable = _registered(tune.with_resources(trainable, resources), name)
    experiment = f"{storage_path.rstrip('/')}/{name}"
    if prepare_restore(experiment):
        print(f"[finetune] resuming the Tune experiment {experiment} of an earlier attempt: its finished trials "
              f"are kept, the others continue from their newest checkpoint", flush=True)
        tuner = tune.Tuner.restore(experiment, trainable, resume_errored=True, param_space=param_space(cfg))
        if tuner._local_tuner is not None:
            # Tuner.restore brings back the first attempt's pickled RunConfig: this attempt's callbacks log under
            # this attempt's stage run, and max_failures (a how field) may have changed since
            tuner._local_tuner._run_config = run_config
    else:
        tuner = tune.Tuner(trainable, param_space=param_space(cfg), run_config=run_config,
                           tune_config=tune.TuneConfig(metric=metric, mode="max", scheduler=scheduler,
                                                       max_concurrent_trials=cfg.max_concurrent_trials))
    print(tensorboard_hint(storage_path, name, metric), flush=True)
    grid = tuner.fit()
    errors = [r.error for r in grid if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(grid)} trials failed; first error: {errors[0]}")
    return grid


_REGISTERING = threading.Lock()


def _registered(trainable, name: str) -> str:
    """Register the sweep's trainable under its experiment's name and return the name, which Tune accepts for the
    trainable. Tune would register it under its function's name (`torch_trial`) in one registry per Ray job, read
    when each trial starts: two sweeps of one driver (the tasks of a suite, side by side) would run each other's
    trials, on each other's data. The registry's write is not safe from two threads at once, hence the lock."""
    from ray import tune

    with _REGISTERING:
        tune.register_trainable(name, trainable)
    return name


def results_table(grid, metric: str):
    """One row per trial: its grid point, epochs run, best epoch and the dev metrics there."""
    import pandas as pd

    rows = []
    for r in grid:
        # a trial resumed from an epoch checkpoint may repeat epochs its lost process had already reported
        hist = r.metrics_dataframe.drop_duplicates("epoch", keep="last").reset_index(drop=True)
        best = hist.loc[_newest_best(hist[metric])]
        row = {k: r.config[k] for k in (*GRID_KEYS, "seed")}
        row.update(trial_id=r.metrics["trial_id"], epochs=int(hist["epoch"].max()), best_epoch=int(best["epoch"]),
                   final_train_loss=float(hist["train_loss"].iloc[-1]), trial_path=r.path)
        row.update({c: float(best[c]) for c in hist.columns if c.startswith("dev_")})
        rows.append(row)
    table = pd.DataFrame(rows).sort_values(list(GRID_KEYS) + ["seed"]).reset_index(drop=True)
    point = [*GRID_KEYS, "seed"]
    repeated = table[table.duplicated(point, keep=False)][point].drop_duplicates().to_dict("records")
    if repeated:  # selection must see each grid point x seed once
        raise RuntimeError(f"the sweep ran {repeated} more than once; rerun it with --force finetune")
    return table


def best_checkpoint(result, metric: str):
    """The trial's checkpoint from its best epoch: Tune's own (trainer=torch), or the Ray Train checkpoint whose
    path `TuneReportCallback` put in that epoch's result (trainer=deepspeed)."""
    from ray import tune

    hist = result.metrics_dataframe.drop_duplicates("epoch", keep="last").reset_index(drop=True)
    if "checkpoint_path" in hist.columns:
        return tune.Checkpoint(hist.loc[_newest_best(hist[metric]), "checkpoint_path"])
    return result.get_best_checkpoint(metric, "max")


def _newest_best(values):
    """The index of the last of the largest values: of equally good epochs the newest is the trial's best, as Tune
    and Ray Train keep the newest of equally scored checkpoints (`num_to_keep=1`)."""
    return values[::-1].idxmax()


def champion_epoch(row: dict[str, Any], checkpoint_dir: Path) -> dict[str, Any]:
    """The champion as served: `row` (its trial's grid point, seed, id and seed mean) with the epoch and every dev
    metric of the checkpoint whose weights are exported (`best_checkpoint`, opened at `checkpoint_dir`), read from
    the result that checkpoint carries (trial.EPOCH_RESULT), never from another epoch's row: equally good epochs
    (the newest is kept) differ in their other figures, the v2.0 no-answer threshold among them, and a trial
    resumed after a lost process may have reported an epoch twice."""
    from stages.finetune.trial import read_epoch_result

    epoch = read_epoch_result(checkpoint_dir)
    return ({k: v for k, v in row.items() if not k.startswith("dev_")} | {"best_epoch": int(epoch["epoch"])}
            | {k: float(v) for k, v in epoch.items() if k.startswith("dev_")})


def with_champion(table, champion: dict[str, Any]):
    """The results table with the champion's row at the epoch it is served from (`champion_epoch`)."""
    table = table.copy()
    at = table["trial_id"] == champion["trial_id"]
    for k in ("best_epoch", *(c for c in table.columns if c.startswith("dev_"))):
        table.loc[at, k] = champion[k]
    return table


def pick_champion(table, metric: str) -> dict[str, Any]:
    """Best grid point by the seed-mean of the dev metric, then its best seed (ties: first in grid order)."""
    means = table.groupby(list(GRID_KEYS), sort=False)[metric].mean()
    point = dict(zip(GRID_KEYS, means.idxmax()))
    runs = table[np.logical_and.reduce([table[k] == v for k, v in point.items()])]
    return dict(runs.loc[runs[metric].idxmax()]) | {"seed_mean": float(means.max())}
