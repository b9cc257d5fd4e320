"""Finetune stage: a Ray Tune sweep over the paper's Table 9 grid, the champion to the MLflow registry.

    kinds/       the task kinds, one file each: sequence.py (classification, regression), token.py (NER),
                 span.py (extractive QA); each owns its format, features, head, metrics, baseline and serving
    tasks.py     a built-in name or a task directory -> the task, read by its kind
    data.py      the splits as token arrays; the checkpoint (ours, or `finetune.init`: an HF DeBERTa-v2 directory
                 or a registry version)
    trial.py     one trial: `run_epochs` on a torch or DeepSpeed engine (`training.engine`)
    sweep.py     the Tune grid, trials as nested MLflow runs, selection
    registry.py  the champion's model/ and hf/, the sweep plot, the registry entry
    control.py   finetune.control=scratch: the same sweep from the initial weights, the gain on the registry version
    contamination.py  the dev examples the pretraining corpus holds (GPT-3's 13-grams), on the registry version

Outputs: model/ (config.json, model.pt, finetune.json, tokenizer/), hf/ (DebertaV2For{Sequence,Token}-
Classification or DebertaV2ForQuestionAnswering with its tokenizer and label names), onnx/model.onnx (hf/ for
onnxruntime, checked against torch on dev rows; absent where the check refused it), results.csv (one row per
trial), sweep.png (dev metric against learning rate), champion.json. The champion is registered as
`deberta-<preset>-<task>` with alias `champion`, an MLflow Model over hf/ (and onnx/):
`mlflow.pyfunc.load_model("models:/deberta-<preset>-<task>@champion").predict(df)` reads the kind's columns
(`sentence1` (+ `sentence2`); `text`; `question` + `context`) and answers label/score, entities, or answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.config import FinetuneConfig
from deberta.config import DebertaConfig
from core.tokenizer import Tokenizer
from core.errors import StageInputError
from stages.base import StageContext, StageResult
from stages.finetune import contamination, estimates
from stages.finetune.control import run_control
from stages.finetune.data import ExternalCheckpoint, load_pretrained, prepare_data
from stages.finetune.kinds.base import TaskRef
from stages.finetune.tasks import task_list
from stages.finetune.registry import _jsonable, export_hf, export_onnx, plot_sweep, register_champion, save_model
from stages.finetune.sweep import (GRID_KEYS, _trial_runs_callback, best_checkpoint, champion_epoch, grid_size,
                                   pick_champion, results_table, run_sweep, sweeps_at_once, with_champion)

VERSION = "4"
"""Bumped when the stage's code changes what it writes (part of the artifact id)."""


def check_task(cfg: FinetuneConfig, task: TaskRef) -> None:
    """Before Ray starts (the real run and `--dry-run`): what the task's kind needs of the settings."""
    task.kind.check(cfg, task)


def dry_run(cfg: FinetuneConfig, model: DebertaConfig, inputs: dict | None = None,
            instances: list[dict] | None = None, cluster: tuple[int, int] | None = None) -> str:
    """`--dry-run`: the size of each task's sweep, then (`estimates.suite_lines`) the trials of the tasks that will
    be fine-tuned (`instances`: their inputs), how many run at once on `cluster` ((CPUs, GPUs)) and the time."""
    grid = " x ".join(f"{k}{list(getattr(cfg, k))}" for k in (*GRID_KEYS, "seeds"))
    trainer = ("one torch process" if cfg.trainer == "torch" else
               f"{cfg.workers_per_trial} DeepSpeed ZeRO-{cfg.zero_stage} workers") + (" on GPUs" if cfg.use_gpu else "")
    tasks = task_list(cfg.task)
    what = (f"task {cfg.task}, {grid_size(cfg)} trials" if len(tasks) == 1 else
            f"{len(tasks)} tasks ({', '.join(tasks)}), {grid_size(cfg)} trials each, {len(tasks) * grid_size(cfg)} "
            f"in the suite, the tasks' sweeps side by side")
    line = (f"finetune: {what} ({grid}), <= {cfg.epochs} epochs each, scheduler {cfg.scheduler}, "
            f"{cfg.max_concurrent_trials} at once per task, {trainer} per trial, sift={cfg.sift}")
    building = [i["task"] for i in instances or () if isinstance(i.get("task"), TaskRef)]
    if not building:
        return line
    return "\n".join([line, *estimates.suite_lines(cfg, model, building, len(tasks) - len(building), cluster)])


WARM_IMPORTS = ("ray.tune", "ray.tune.schedulers", "stages.finetune.trial", "deberta.hf", "deberta.onnx_export",
                "transformers.models.deberta_v2.modeling_deberta_v2", "transformers.convert_slow_tokenizer",
                "onnxruntime", "matplotlib.figure", "mlflow.models", "safetensors.torch")
"""What a task's sweep imports on its way, imported once before the suite's threads start: two threads importing
one package for the first time may each see the other's modules half-initialised (torch's and transformers'
imports run into each other)."""


def side_by_side(cfg: FinetuneConfig, *, cpus: int, gpus: int) -> int:
    """How many tasks of a suite the executor fine-tunes at once (`sweep.sweeps_at_once`), in threads of the driver,
    after the imports their threads would otherwise race on."""
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    return sweeps_at_once(cfg, cpus, gpus)


def run(cfg: FinetuneConfig, *, model: DebertaConfig, inputs: dict[str, Any], out: Path,
        ctx: StageContext) -> StageResult:
    from stages.finetune.trial import TrialSetup

    task: TaskRef = inputs["task"]
    tok_dir, weights = load_pretrained(inputs, model, ctx.scratch)
    tok = Tokenizer.load(tok_dir)
    if len(tok) > model.vocab_size:
        raise StageInputError(f"tokenizer {tok_dir} has {len(tok)} ids but the model only {model.vocab_size} embedding "
                              f"rows; the pretrained artifact and its vocabulary do not belong together")
    data = prepare_data(task, tok_dir, cfg)
    setup = TrialSetup(model, task.num_labels, task.kind, task.metric, cfg)
    metric = f"dev_{task.metric}"
    baseline, baseline_name = task.kind.baseline(task)
    print(f"[finetune] {task.name} ({task.problem}): {len(task.train)} train / {len(task.dev)} dev examples in "
          f"{len(data[0])} / {len(data[1])} rows, {grid_size(cfg)} trials, selection on {metric} "
          f"({baseline_name} {baseline:.4f})", flush=True)
    init = inputs.get("pretrain") if isinstance(inputs.get("pretrain"), ExternalCheckpoint) else None
    ctx.tracker.log_params({"task.name": task.name, "task.id": task.id, "task.kind": task.problem,
                            "task.train_examples": len(data[0]), "task.dev_examples": len(data[1]),
                            **({"init.source": init.source, "init.digest": init.id} if init else {})})

    grid = run_sweep(cfg, setup, data, weights, ctx.storage_path,
                     ctx.run_name, callbacks=[_trial_runs_callback(ctx.tracker, metric, ctx.run_name)])
    table = results_table(grid, metric)
    row = pick_champion(table, metric)
    best = next(r for r in grid if r.metrics["trial_id"] == row["trial_id"])
    with best_checkpoint(best, metric).as_directory() as ckpt:  # one epoch: its weights and its figures
        champion = champion_epoch(row, Path(ckpt))
        save_model(out / "model", Path(ckpt), setup, task, tok_dir, champion)
    table = with_champion(table, champion)
    table.drop(columns=["trial_path"]).to_csv(out / "results.csv", index=False)
    plot_sweep(table, metric, baseline, out / "sweep.png", f"{task.name}: {ctx.preset}, sweep {ctx.artifact_id}",
               baseline_name)
    (out / "champion.json").write_text(json.dumps(_jsonable(champion), indent=2, sort_keys=True) + "\n")

    export_hf(out / "model", out / "hf", task, float(champion["dropout"]))
    onnx = export_onnx(out / "hf", out / "onnx", data[1].ids)
    print(f"[finetune] onnx/ {onnx}", flush=True)
    control = run_control(setup, data, ctx, metric, champion, out) if cfg.control == "scratch" else {}
    contaminated = contamination.measure(inputs.get("corpus"), task, ctx.workdir)
    print(f"[finetune] dev contamination: {contaminated['figure']} (dev examples sharing a 13-gram with the "
          f"pretraining corpus)", flush=True)
    version = register_champion(ctx, out, task, champion, baseline, init,
                                {**control.get("tags", {}), **contamination.tags(contaminated)}, onnx)
    name = f"deberta-{ctx.preset}-{task.name}"
    trial_cfg = {k: _jsonable(champion)[k] for k in (*GRID_KEYS, "seed")}
    # every dev figure of the served epoch, on the stage's run (the v2.0 threshold among them)
    champion_figures = {f"champion_{k}": float(v) for k, v in champion.items() if k.startswith("dev_")}
    others = ", ".join(f"{k} {v:.4g}" for k, v in champion.items() if k.startswith("dev_") and k != metric)
    return StageResult(
        metrics={f"best_{metric}": float(champion[metric]), f"best_{metric}_seed_mean": champion["seed_mean"],
                 "champion_epoch": champion["best_epoch"], **champion_figures,
                 **{name: baseline for name in ("baseline", *task.kind.baseline_aliases)},
                 **control.get("metrics", {}),
                 **({"dev_contamination_fraction": contaminated["fraction"]} if "fraction" in contaminated else {})},
        counts={"trials": len(table), "trial_epochs": int(table["epochs"].sum()),
                "train_examples": len(data[0]), "dev_examples": len(data[1])},
        log_files=("results.csv", "sweep.png", "champion.json", *(("results_scratch.csv",) if control else ())),
        summary={"finetune": f"{name} v{version} (alias champion): {metric}={champion[metric]:.4f} "
                             f"vs {baseline_name} {baseline:.4f}; trial {json.dumps(trial_cfg)}, epoch "
                             f"{champion['best_epoch']} ({others})"
                             + (f"; gain over scratch {control['metrics']['gain_over_scratch']:+.4f} (seed means)"
                                if control else "")
                             + f"; dev contamination: {contaminated['figure']}"},
    )
