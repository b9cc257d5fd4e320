"""Probes: the pretraining run measured in task terms (`pretrain.probes`).

At step 0 (the model's initial weights: the from-scratch control, or the released checkpoint a continued run starts
from) and at every `probe_interval` steps, the newest checkpoint's backbone is fine-tuned on each probe task by the
finetune stage's own trial code (`stages.finetune.trial`: `trial_engine`, `run_epochs`; the same kinds, heads and dev
metrics), on a fixed small grid (`probe_lr`) x `probe_seeds`, with `probe_examples` training rows. Each (grid point,
seed) is one Ray task of `probe_cpus` CPUs (and `probe_gpus` GPUs): the tasks wait in Ray's queue while the training
workers hold the cluster and never hold training up. Tune is not used: a probe is a handful of trials whose results
only this driver reads.

A probe measures what the finetune stage would report at this label budget, so each trial trains to convergence:
up to `probe_max_steps` optimizer steps, stopped early once its dev metric has not improved for `probe_patience`
evaluations (one per epoch), its best epoch counting. A fixed few epochs of a small label budget measures how fast a
model starts to learn instead, which can rank a pretrained model below its own from-scratch control. The grid point
with the best seed mean is logged against the pretraining step as `probe.<task>.<metric>` (mean over seeds) and
`probe.<task>.<metric>_std` (their spread), as the finetune stage selects its champion; a seed that collapsed
(`collapsed`) is left out of that mean, printed, listed in the ledger and counted in `probe.<task>.failed`.

The driver watches the run's checkpoints from a thread beside `TorchTrainer.fit()` (`Probes.watch`): a checkpoint of a
probe step is consolidated on the driver as soon as it is listed (Ray Train keeps only the last two) and its backbone
put in the object store for the trials. A finished (step, task) is recorded in `probes.json` in the run's storage
directory (written to a temporary name, then renamed): a restarted stage logs it again into the plot but never
re-probes it. A probe still running when the driver dies is run again if its checkpoint is still kept.

Each probe task's dev split is measured against the run's corpus artifact as the finetune stage measures its own
(`stages.finetune.contamination`: the dev examples sharing a 13-gram with the corpus's train shards, cached per corpus
artifact and task, so a probe and a sweep of the same task read one figure): logged once the trials are in as the
param `probe.<task>.dev_contamination` (e.g. "12 of 1,409 (0.9%)") and the metric
`probe.<task>.dev_contamination_fraction`, written to the stage's probes.json and named in the summary line. A
continued run's starting checkpoint read a corpus this run does not have: its share of the figure is unknown, and
the figure says so.

`plot` draws each probe's metric against the step with the task's baseline (the kind's `baseline`: the rule a
practitioner tries first) and any collapsed seed, the validation loss on a second axis (probes.png).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.config import FinetuneConfig, PretrainConfig

if TYPE_CHECKING:
    from stages.finetune.kinds.base import Encoded, TaskRef
    from stages.finetune.trial import TrialSetup
    from stages.pretrain.objective import Objective

LEDGER = "probes.json"
"""In the run's storage directory: the finished probes, {step: {task: result}}."""

COLLAPSE_SPREADS = 3.0
"""A seed more than this many spreads of the other seeds below the grid point's median has collapsed (`collapsed`)."""
MIN_SPREAD = 0.02
"""The least spread `collapsed` assumes: two seeds that agree closely do not make a third's ordinary seed-to-seed
difference (a few points of a metric in [0, 1]) a collapse."""


def budget_epochs(p: PretrainConfig, train_rows: int) -> int:
    """`probe_max_steps` as whole epochs of `train_rows` (the trial loop evaluates once per epoch)."""
    from stages.finetune.trial import steps_per_epoch

    return max(1, math.ceil(p.probe_max_steps / steps_per_epoch(train_rows, p.probe_batch_size)))


def finetune_config(p: PretrainConfig, task: str, train_rows: int | None = None) -> FinetuneConfig:
    """The finetune stage's settings a probe trial runs with: the probes' fixed grid, one dropout and warmup, the
    step budget as epochs of `train_rows` (the encoded label budget; None: `probe_examples` rows, for the checks
    made before the task is encoded)."""
    rows = train_rows if train_rows is not None else (p.probe_examples or p.probe_batch_size)
    return FinetuneConfig(task=task, dropout=(0.1,), warmup_steps=(p.probe_warmup_steps,), lr=p.probe_lr,
                          batch_size=(p.probe_batch_size,), seeds=p.probe_seeds, epochs=budget_epochs(p, rows),
                          max_seq_len=p.probe_max_seq_len, doc_stride=p.probe_max_seq_len // 4,
                          max_train_examples=p.probe_examples, cpus_per_trial=p.probe_cpus,
                          use_gpu=p.probe_gpus > 0, precision=p.precision)


def resolve_probes(p: PretrainConfig, workdir: Path | None = None) -> list["TaskRef"]:
    """The probe tasks, each checked against its settings as the finetune stage checks its task (StageInputError)."""
    from stages.finetune import check_task
    from stages.finetune.tasks import resolve_task

    tasks = []
    for name in p.probes:
        task = resolve_task(name, workdir)
        check_task(finetune_config(p, name), task)
        tasks.append(task)
    return tasks


def probe_steps(p: PretrainConfig) -> list[int]:
    """0, every probe_interval, and the last step."""
    return sorted({0, *range(p.probe_interval, p.max_steps + 1, p.probe_interval), p.max_steps})


def backbone(objective: "Objective", state_dict: dict) -> dict:
    """The `deberta.*` tensors a task head starts from (`Objective.backbone_weights`: what model/ holds)."""
    from deberta import checkpoint

    state_dict = objective.backbone_weights(state_dict)
    return {k: v.detach().float().contiguous() for k, v in state_dict.items()
            if k.startswith(checkpoint.BACKBONE_PREFIX)}


def initial_backbone(objective: "Objective", model, seed: int, init_file: str = "") -> dict:
    """Step 0: the objective's model as the run starts it (seeded as `training.engine.build` seeds it; a continued
    run's starting weights loaded)."""
    import torch

    factory, _ = objective.build_model(model)
    torch.manual_seed(seed)
    net = factory()
    if init_file:
        from stages.pretrain.continued import SafetensorsFile

        net.load_state_dict(dict(SafetensorsFile(init_file)), strict=False)
    return backbone(objective, net.state_dict())


class _Converged(Exception):
    """Raised by a probe trial's `report` to end the finetune stage's epoch loop: its dev metric stopped improving."""


def probe_trial(setup: "TrialSetup", config: dict[str, Any], data: tuple["Encoded", "Encoded"],
                weights: dict, patience: int) -> dict[str, Any]:
    """One Ray task: one grid point and seed fine-tuned by the finetune stage's loop for at most `setup.ft.epochs`,
    stopped after `patience` epochs without a new best dev metric; the best epoch's dev metric, that epoch, the
    epochs run and whether it converged (stopped early) rather than running out of budget."""
    import torch

    from stages.finetune.trial import optim_spec, run_epochs, trial_engine

    torch.set_num_threads(setup.ft.cpus_per_trial)
    device = "cuda" if setup.ft.use_gpu and torch.cuda.is_available() else "cpu"
    engine = trial_engine(setup, config, weights, optim_spec(setup.ft, config, len(data[0])), device=device)
    epochs: list[dict[str, Any]] = []
    since_best = 0

    def report(result: dict[str, Any], _engine, improved: bool, _progress) -> None:
        nonlocal since_best
        epochs.append(result)
        since_best = 0 if improved else since_best + 1
        if since_best >= patience:
            raise _Converged

    try:
        run_epochs(engine, data, setup, config, report)
        converged = False
    except _Converged:
        converged = True
    key = f"dev_{setup.metric}"
    best = max(epochs, key=lambda r: r[key])  # the first of equals, as `improved` counts only a strict gain
    return {"value": float(best[key]), "epoch": int(best["epoch"]), "epochs": len(epochs), "converged": converged}


def collapsed(values: list[float], baseline: float) -> list[bool]:
    """Which seeds of one grid point failed rather than varied: a seed below the task's baseline while the grid
    point's median is not (it learnt less than the rule a practitioner tries first, where its siblings did not), or
    more than `COLLAPSE_SPREADS` sample spreads of the other seeds (at least `MIN_SPREAD`) below the median (with
    three seeds or more: one other seed has no spread). Seeds at or above the median never count, so at least half
    of a grid point's seeds stay in its mean."""
    median = float(np.median(values))
    out = []
    for i, v in enumerate(values):
        others = values[:i] + values[i + 1:]
        far = len(others) > 1 and median - v > COLLAPSE_SPREADS * max(float(np.std(others, ddof=1)), MIN_SPREAD)
        out.append(v < baseline <= median or far)
    return out


def summarize(task: "TaskRef", trials: dict[tuple[float, int], float], baseline: float = -math.inf) -> dict[str, Any]:
    """{(lr, seed): dev metric} -> the grid point with the best seed mean, collapsed seeds (`collapsed`) left out of
    every grid point's mean: its mean, spread (sample std) and seeds, and every collapsed trial of the grid."""
    lrs = sorted({lr for lr, _ in trials})
    kept: dict[float, dict[int, float]] = {}
    failed = []
    for lr in lrs:
        seeds = sorted(s for l, s in trials if l == lr)
        values = [trials[(lr, s)] for s in seeds]
        for s, v, bad in zip(seeds, values, collapsed(values, baseline)):
            if bad:
                failed.append({"lr": lr, "seed": s, "value": v})
            else:
                kept.setdefault(lr, {})[s] = v
    means = {lr: float(np.mean(list(kept[lr].values()))) for lr in lrs}
    lr = max(lrs, key=lambda x: means[x])
    values = list(kept[lr].values())
    return {"metric": task.metric, "mean": means[lr], "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            "lr": lr, "per_seed": {str(s): v for s, v in kept[lr].items()}, "failed": failed}


# ----------------------------------------------------------------------------------------------- the ledger

def read_ledger(run_dir: str) -> dict[int, dict[str, Any]]:
    from training.checkpoint_files import storage_fs

    fs, path = storage_fs(run_dir)
    try:
        with fs.open_input_stream(f"{path}/{LEDGER}") as f:
            return {int(k): v for k, v in json.loads(f.read()).items()}
    except (OSError, ValueError):  # none yet (a ledger cut short is not possible: it is renamed into place)
        return {}


def write_ledger(run_dir: str, ledger: dict[int, dict[str, Any]]) -> None:
    """Written whole to a temporary name, then renamed over the old one: never seen half-written."""
    from training.checkpoint_files import storage_fs

    fs, path = storage_fs(run_dir)
    fs.create_dir(path, recursive=True)
    with fs.open_output_stream(f"{path}/{LEDGER}.tmp", compression=None) as f:
        f.write(json.dumps({str(k): ledger[k] for k in sorted(ledger)}, indent=1, sort_keys=True).encode())
    fs.move(f"{path}/{LEDGER}.tmp", f"{path}/{LEDGER}")


# ----------------------------------------------------------------------------------------------- the driver's side

@dataclass
class Probes:
    """The probes of one pretraining run, on its driver: submits, collects, logs, records."""

    cfg: PretrainConfig
    objective: "Objective"
    tasks: list["TaskRef"]
    run_dir: str
    tracker: Any
    ds_config: Any
    tok_dir: Path
    model: Any
    init_file: str = ""
    corpus: Any = None
    """The corpus artifact the run pretrains on (None: no corpus input, the contamination is "unknown")."""
    workdir: Path | None = None
    """Where the contamination figures are cached (`stages.finetune.contamination.CACHE`)."""
    ledger: dict[int, dict[str, Any]] = field(default_factory=dict)
    pending: dict[Any, tuple[int, str, float, int]] = field(default_factory=dict)
    """Ray object ref -> (step, task, lr, seed)."""
    trials: dict[tuple[int, str], dict[tuple[float, int], dict | None]] = field(default_factory=dict)
    """(step, task) -> {(lr, seed): `probe_trial`'s result, None for a trial that raised}, until all are in."""
    submitted: set[int] = field(default_factory=set)
    data_refs: dict[str, Any] = field(default_factory=dict)
    setups: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, tuple[float, str]] = field(default_factory=dict)
    """task -> the kind's baseline (value, what it is): the collapse rule's floor and the plot's line."""
    notes: list[str] = field(default_factory=list)
    contamination: dict[str, dict[str, Any]] = field(default_factory=dict)
    """task -> its dev split's contamination against `corpus` (`stages.finetune.contamination.measure`)."""

    def start(self) -> None:
        """Encode each task once (the run's vocabulary), read the ledger, log what it holds, probe step 0."""
        import ray

        from stages.finetune.data import prepare_data
        from stages.finetune.trial import TrialSetup

        for task in self.tasks:
            data = prepare_data(task, self.tok_dir, finetune_config(self.cfg, task.name))
            ft = finetune_config(self.cfg, task.name, len(data[0]))  # the step budget as epochs of these rows
            self.data_refs[task.name] = ray.put(data)
            self.setups[task.name] = TrialSetup(self.model, task.num_labels, task.kind, task.metric, ft)
            self.baselines[task.name] = task.kind.baseline(task)
        self.ledger = read_ledger(self.run_dir)
        done = sorted(s for s, r in self.ledger.items() if set(r) >= {t.name for t in self.tasks})
        if done:
            print(f"[pretrain] probes of steps {done} finished before (in {self.run_dir}/{LEDGER}); not run again",
                  flush=True)
        self.submitted.update(done)
        if 0 not in self.submitted:
            self.submit(0, initial_backbone(self.objective, self.model, self.cfg.seed, self.init_file))

    def submit(self, step: int, weights: dict) -> None:
        import ray

        ref = ray.put(weights)
        remote = ray.remote(probe_trial).options(num_cpus=self.cfg.probe_cpus, num_gpus=self.cfg.probe_gpus,
                                                 max_retries=1)
        for task in self.tasks:
            if task.name in self.ledger.get(step, {}):
                continue
            for lr in self.cfg.probe_lr:
                for seed in self.cfg.probe_seeds:
                    config = {"lr": lr, "seed": seed, "dropout": 0.1, "batch_size": self.cfg.probe_batch_size,
                              "warmup_steps": self.cfg.probe_warmup_steps}
                    out = remote.remote(self.setups[task.name], config, self.data_refs[task.name], ref,
                                        self.cfg.probe_patience)
                    self.pending[out] = (step, task.name, lr, seed)
        self.submitted.add(step)
        print(f"[pretrain] probing step {step}: {len(self.tasks)} task(s) x {len(self.cfg.probe_lr)} lr x "
              f"{len(self.cfg.probe_seeds)} seeds queued, each up to {self.cfg.probe_max_steps} steps or "
              f"{self.cfg.probe_patience} epochs without a better dev metric", flush=True)

    def collect(self, timeout: float = 0) -> None:
        """Results of finished trials; a (step, task) with all its trials in is logged and recorded."""
        import ray

        if not self.pending:
            return
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=timeout)
        for ref in ready:
            step, name, lr, seed = self.pending.pop(ref)
            try:
                value = ray.get(ref)
            except Exception as e:  # noqa: BLE001  (a failed trial is said, never the training run's end)
                print(f"[pretrain] probe trial {name} step {step} lr {lr:g} seed {seed} failed: {e}", flush=True)
                value = None
            self.trials.setdefault((step, name), {})[(lr, seed)] = value
            if len(self.trials[(step, name)]) == len(self.cfg.probe_lr) * len(self.cfg.probe_seeds):
                self.record(step, next(t for t in self.tasks if t.name == name), self.trials.pop((step, name)))

    def record(self, step: int, task: "TaskRef", trials: dict[tuple[float, int], dict | None]) -> None:
        """A (step, task) with every trial in: logged against the step and written to the ledger."""
        done = {k: v for k, v in trials.items() if v is not None}
        if not done:  # nothing to log; not recorded, so a restarted stage tries again
            return
        baseline, baseline_name = self.baselines[task.name]
        result = summarize(task, {k: v["value"] for k, v in done.items()}, baseline)
        chosen = {s: done[(lr, s)] for lr, s in done if lr == result["lr"]}
        result.update(baseline=baseline, baseline_name=baseline_name,
                      best_epoch={str(s): r["epoch"] for s, r in sorted(chosen.items())},
                      not_converged=[s for s, r in sorted(chosen.items()) if not r["converged"]])
        key = f"probe.{task.name}.{result['metric']}"
        self.ledger.setdefault(step, {})[task.name] = result
        write_ledger(self.run_dir, self.ledger)  # first: the plot has it even if the tracking server is down
        self.tracker.log_metrics({key: result["mean"], f"{key}_std": result["std"],
                                  f"probe.{task.name}.failed": len(result["failed"])}, step=step)
        for f in result["failed"]:
            print(f"[pretrain] probe step {step}: {task.name} lr {f['lr']:g} seed {f['seed']} collapsed "
                  f"({result['metric']} {f['value']:.4f}; {baseline_name} {baseline:.4f}): a failed trial, left out "
                  f"of its grid point's mean", flush=True)
        if result["not_converged"]:
            print(f"[pretrain] probe step {step}: {task.name} seeds {result['not_converged']} were still improving "
                  f"when their {self.cfg.probe_max_steps} steps ran out; raise pretrain.probe_max_steps", flush=True)
        print(f"[pretrain] probe step {step}: {key} = {result['mean']:.4f} ± {result['std']:.4f} "
              f"(lr {result['lr']:g}, best epochs {list(result['best_epoch'].values())}, {len(done)} of "
              f"{len(trials)} trials, {len(result['failed'])} collapsed)", flush=True)

    def checkpoints_to_probe(self) -> None:
        """Newly listed checkpoints of probe steps, once every rank's files are in: consolidated now (Ray Train
        deletes all but the last two)."""
        from stages.pretrain.checkpoints import TrainState, checkpoints_in, saved_step
        from training import checkpoint_files
        from training.engine import consolidated_state_dict

        wanted = set(probe_steps(self.cfg)) - self.submitted
        fs, path = checkpoint_files.storage_fs(self.run_dir)
        for ckpt in checkpoints_in(fs, path):
            if saved_step(ckpt.filesystem, ckpt.path) not in wanted:  # the state file alone, nothing downloaded
                continue
            try:
                with ckpt.as_directory() as d:
                    if checkpoint_files.problem(Path(d), self.cfg.num_workers, range(0)):
                        continue  # a rank's files not in yet: the next look
                    state = TrainState.read(Path(d))
                    weights = backbone(self.objective, consolidated_state_dict(Path(d), state.tag, self.ds_config))
            except (OSError, ValueError, RuntimeError, KeyError) as e:  # deleted as it was read
                self.notes.append(f"{ckpt.path}: {e}")
                continue
            wanted.discard(state.step)
            self.submit(state.step, weights)

    def watch(self, stop: threading.Event, every: float = 1.0) -> None:
        """The thread beside `fit()`: probe new checkpoints, collect results, until `stop`."""
        while not stop.is_set():
            try:
                self.checkpoints_to_probe()
                self.collect()
            except Exception as e:  # noqa: BLE001  (a probe must never take the training run down)
                print(f"[pretrain] probes: {type(e).__name__}: {e}", flush=True)
            stop.wait(every)

    def finish(self, final_step: int, final_state: dict) -> None:
        """After training: the last step (from the driver's consolidated weights) if not yet probed, then every
        result in."""
        if final_step not in self.submitted:
            self.submit(final_step, backbone(self.objective, final_state))
        while self.pending:
            self.collect(timeout=5)
        self.measure_contamination()
        missing = sorted(set(probe_steps(self.cfg)) - set(self.ledger))
        if missing:
            print(f"[pretrain] probes of steps {missing} were not run: their checkpoints were gone before the driver "
                  f"read them (raise pretrain.ckpt_interval, or see {self.notes[-1:] or 'the log'})", flush=True)


    def measure_contamination(self) -> None:
        """Each task's dev contamination against the run's corpus, logged as the probe's param and metric."""
        from stages.finetune import contamination

        for task in self.tasks:
            found = contamination.measure(self.corpus, task, self.workdir or Path("."))
            if self.init_file and found["figure"] != contamination.UNKNOWN:
                found = {**found, "figure": f"{found['figure']} of this run's corpus, "
                                            f"{contamination.UNKNOWN} for the checkpoint it continues"}
            self.contamination[task.name] = found
            key = f"probe.{task.name}.dev_contamination"
            self.tracker.log_params({key: found["figure"]})
            if "fraction" in found:
                self.tracker.log_metrics({f"{key}_fraction": found["fraction"]})
            print(f"[pretrain] probe {task.name}: dev contamination {found['figure']} (dev examples sharing a "
                  f"13-gram with the pretraining corpus)", flush=True)


def start_watching(probes: Probes) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    probes.start()
    thread = threading.Thread(target=probes.watch, args=(stop,), name="probes", daemon=True)
    thread.start()
    return thread, stop


# ----------------------------------------------------------------------------------------------- the picture

def plot(ledger: dict[int, dict[str, Any]], val_loss: list[tuple[int, float]], path: Path, title: str = "",
         loss_label: str = "loss") -> list[str]:
    """Each probe's dev metric (seed mean, spread as error bars) against the pretraining step, its task's baseline
    as a dotted line and its collapsed seeds as crosses; the validation loss (`Objective.loss_label`) on a second
    axis. Returns the legends' labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = sorted({name for results in ledger.values() for name in results})
    for name in names:
        steps = sorted(s for s in ledger if name in ledger[s])
        rows = [ledger[s][name] for s in steps]
        line = ax.errorbar(steps, [r["mean"] for r in rows], yerr=[r["std"] for r in rows], marker="o", capsize=3,
                           label=f"{name} dev {rows[0]['metric']}")
        color = line.lines[0].get_color()
        if "baseline" in rows[-1]:
            ax.axhline(rows[-1]["baseline"], linestyle=":", color=color,
                       label=f"{name} {rows[-1]['baseline_name']}")
        fails = [(s, f["value"]) for s, r in zip(steps, rows) for f in r.get("failed", [])]
        if fails:
            ax.scatter(*zip(*fails), marker="x", color=color, label=f"{name} collapsed seeds (not in the mean)")
    ax.set_xlabel("pretraining step")
    ax.set_ylabel("probe dev metric (seed mean ± std)")
    if val_loss:
        loss = ax.twinx()
        points = dict(val_loss)
        steps = sorted(points)
        loss.plot(steps, [points[s] for s in steps], "--", color="grey", label=f"validation {loss_label}")
        loss.set_ylabel(f"validation {loss_label}")
        loss.legend(loc="upper center")
    ax.legend(loc="center right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    labels = [t.get_text() for a in fig.axes if a.get_legend() for t in a.get_legend().get_texts()]
    plt.close(fig)
    return labels


def summary_line(ledger: dict[int, dict[str, Any]], contamination: dict[str, dict[str, Any]] | None = None) -> str:
    """`make run`'s summary: each probe from step 0 to the last step probed, and its dev contamination."""
    parts = []
    for name in sorted({n for r in ledger.values() for n in r}):
        steps = sorted(s for s in ledger if name in ledger[s])
        first, last = ledger[steps[0]][name], ledger[steps[-1]][name]
        found = (contamination or {}).get(name)
        parts.append(f"{name} {first['metric']} {first['mean']:.3f} (step {steps[0]}) -> {last['mean']:.3f} ± "
                     f"{last['std']:.3f} (step {steps[-1]})"
                     + (f", dev contamination: {found['figure']}" if found else ""))
    return "; ".join(parts) + " (probes.png)"


def with_probes(result, probes: Probes, out: Path, ctx) -> Any:
    """The stage's result with the probes' plot logged and their line in the summary."""
    from stages.pretrain.registry import metric_history

    val_loss = metric_history(ctx, "val_loss")
    plot(probes.ledger, val_loss, out / "probes.png", f"probes: {ctx.preset}, {ctx.artifact_id}",
         probes.objective.loss_label)
    ctx.tracker.log_artifact(out / "probes.png")
    (out / LEDGER).write_text(json.dumps({"steps": {str(k): probes.ledger[k] for k in sorted(probes.ledger)},
                                          "val_loss": {str(s): v for s, v in sorted(dict(val_loss).items())},
                                          "dev_contamination": probes.contamination},
                                         indent=1, sort_keys=True) + "\n")
    return replace(result, summary={**result.summary, "probes": summary_line(probes.ledger, probes.contamination)})
