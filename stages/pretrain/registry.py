"""What a finished pretraining run leaves in MLflow: metrics.json and the loss curve beside the stage's run, and the
registry version `deberta-<preset>-pretrained` (an MLflow Model over hf/, `core/hf_pyfunc.py`) tagged with its
lineage and objective. What the loss is called, which validation numbers the run reports and how the model is
exported are the objective's (`Objective.loss_label`, `final_metrics`, `export`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from core.config import PretrainConfig
from stages.base import StageContext, StageResult
from stages.pretrain.objective import Objective

RELEASED_LOSS = "val_loss_released"
"""Continued runs: the validation loss before the first step, computed as `transformers` computes it for the
released checkpoint (`Objective.released_loss_inputs`, `released_loss`); equal to HF's own loss on the same
batches."""


def metric_history(ctx: StageContext, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in ctx.tracker.client.get_metric_history(ctx.tracker.run_id, key)]


def plot_losses(ctx: StageContext, path: Path, label: str) -> None:
    """Train and validation loss per step, from the stage's MLflow run (the last value logged per step wins);
    `label`: what the loss is (`Objective.loss_label`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("val_loss", "o-")):
        points = dict(metric_history(ctx, key))
        if points:
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def finish(cfg: PretrainConfig, objective: Objective, out: Path, ctx: StageContext, final: dict,
           seq_len: int, hf_note: str, lineage: dict[str, str] | None = None) -> StageResult:
    """metrics.json, loss curve, MLflow artifacts and the registry entry."""
    def last(key: str) -> float | None:
        history = metric_history(ctx, key)
        return max(history)[1] if history else None  # the value at the highest step

    first_val = dict(metric_history(ctx, "val_loss")).get(0)
    released = dict(metric_history(ctx, RELEASED_LOSS)).get(0)
    throughput = [v for _, v in metric_history(ctx, "tokens_per_s")]
    metrics = {"final_loss": last("loss"), **{k: last(k) for k in objective.final_metrics},
               "initial_val_loss": first_val, RELEASED_LOSS: released,
               "tokens_per_s": float(np.median(throughput)) if throughput else None}
    metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
    report = {**metrics, "objective": objective.name, "steps": cfg.max_steps, "seq_len": seq_len,
              "train_batch_size": cfg.train_batch_size, "zero_stage": cfg.zero_stage, "num_workers": cfg.num_workers,
              "worker_nodes": final.get("worker_nodes", []), "hf_export": hf_note,
              **({"init": lineage} if lineage else {})}
    (out / "metrics.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    plot_losses(ctx, out / "loss_curve.png", objective.loss_label)
    ctx.tracker.log_artifact(out / "loss_curve.png")
    version = register(cfg, objective, out, ctx, lineage or {})
    name = f"deberta-{ctx.preset}-pretrained"
    unsent = int(final.get("unsent_metrics") or 0)
    lost = {"metrics not logged": f"{unsent} points (tracking server unreachable at the end)"} if unsent else {}
    if unsent:
        print(f"[pretrain] warning: {unsent} metric points could not be logged to MLflow; the model is complete",
              flush=True)
    return StageResult(
        metrics=metrics,
        counts={"steps": cfg.max_steps, "tokens": cfg.max_steps * cfg.train_batch_size * seq_len},
        log_files=("metrics.json",),
        summary={f"registered {name}": f"version {version}",
                 "pretrain": f"val {objective.loss_label} {metrics.get('initial_val_loss', float('nan')):.3f} -> "
                             f"{metrics.get('val_loss', float('nan')):.3f}, "
                             f"{metrics.get('tokens_per_s', 0):,.0f} tokens/s", **lost},
    )


def register(cfg: PretrainConfig, objective: Objective, out: Path, ctx: StageContext,
             lineage: dict[str, str]) -> str:
    """Our checkpoint as a run artifact; the registry version `deberta-<preset>-pretrained`, tagged with its
    lineage and objective: an MLflow Model over hf/ (`core/hf_pyfunc.py`) of the objective's task."""
    export = objective.export()
    ctx.tracker.log_artifacts(out / "model", "model")  # ours, with what the objective keeps beyond HF's classes
    for directory in export.extra_dirs:
        ctx.tracker.log_artifacts(out / directory, directory)
    name = f"deberta-{ctx.preset}-pretrained"
    tags = {**{stage: ctx.lineage.get(stage, "") for stage in ("corpus", "vocab", "tokenize")},
            "pretrain": ctx.artifact_id, **export.tags, **lineage}
    description = f"{export.description}, {cfg.max_steps} steps, ZeRO-{cfg.zero_stage}"
    uri = ctx.tracker.log_hf_model(out / "hf", task=export.task, name="pretrained", tags=tags,
                                   input_example={"text": [export.example]})
    return ctx.tracker.register_model(name, model_uri=uri, tags=tags, description=description)
