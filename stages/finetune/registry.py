"""The champion's outputs: `model/` (ours) and `hf/` (transformers) in the artifact, the sweep plot, and the
MLflow registry entry (an MLflow Model over hf/ that reads what the task's kind reads: `sentence1`/`sentence2`,
`text`, or `question`/`context`)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from core.tokenizer import MODEL_FILE, SPECIAL_FILE
from stages.base import StageContext
from stages.finetune.kinds.base import TaskRef, code_tree
from stages.finetune.sweep import GRID_KEYS

if TYPE_CHECKING:
    from stages.finetune.data import ExternalCheckpoint
    from stages.finetune.trial import TrialSetup


def plot_sweep(table, metric: str, baseline: float, path: Path, title: str, baseline_name: str = "majority baseline"
               ) -> None:
    """Dev metric against learning rate, one line per (batch size, dropout); best warmup, mean over seeds. A suite's
    tasks plot from threads, and matplotlib is not thread-safe (pyplot's current figure, mathtext's one parser of
    tick labels): a Figure of its own, drawn under a lock."""
    with _PLOTTING:
        _plot_sweep(table, metric, baseline, path, title, baseline_name)


_PLOTTING = threading.Lock()


def _plot_sweep(table, metric: str, baseline: float, path: Path, title: str, baseline_name: str) -> None:
    from matplotlib.figure import Figure

    agg = table.groupby(["batch_size", "dropout", "lr", "warmup_steps"])[metric].mean().groupby(
        level=["batch_size", "dropout", "lr"]).max()
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for (bs, dropout), line in agg.groupby(level=["batch_size", "dropout"]):
        lrs = line.index.get_level_values("lr")
        ax.plot(lrs, line.values, marker="o", label=f"batch {bs}, dropout {dropout:g}")
    ax.axhline(baseline, color="grey", linestyle="--", label=f"{baseline_name} {baseline:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"{metric} (best epoch; best warmup; mean over seeds)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_model(dst: Path, checkpoint_dir: Path, setup: "TrialSetup", task: TaskRef, tok_dir: Path,
               champion: dict) -> None:
    """model/ = config.json (DebertaConfig) + model.pt (the head's state dict) + finetune.json + tokenizer/.
    `champion`: the trial's figures at the epoch of the checkpoint at `checkpoint_dir` (`sweep.champion_epoch`);
    the kind's export settings (the v2.0 threshold) are read from them."""
    dst.mkdir(parents=True)
    shutil.copyfile(Path(checkpoint_dir) / "model.pt", dst / "model.pt")
    (dst / "config.json").write_text(json.dumps(setup.model.to_dict(), indent=2, sort_keys=True) + "\n")
    head = {"task": task.name, "task_id": task.id, "problem": task.problem, "metric": task.metric,
            "labels": list(task.labels), "num_labels": setup.num_labels, "sift": setup.ft.sift,
            "max_seq_len": setup.ft.max_seq_len, "doc_stride": setup.ft.doc_stride,
            "max_answer_len": setup.ft.max_answer_len, "options": dict(task.options), "trial": _jsonable(champion)}
    (dst / "finetune.json").write_text(json.dumps(head, indent=2, sort_keys=True) + "\n")
    (dst / "tokenizer").mkdir()
    for name in (MODEL_FILE, SPECIAL_FILE):
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, dst / "tokenizer" / name)


def _jsonable(d: dict) -> dict:
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in d.items() if k != "trial_path"}


def export_hf(model_dir: Path, hf_dir: Path, task: TaskRef, dropout: float) -> None:
    """hf/: the champion as `DebertaV2For{Sequence,Token}Classification` or `DebertaV2ForQuestionAnswering` with
    the tokenizer, `id2label`/`label2id` from the task's label names (`problem_type` regression for a score), and
    the kind's serving settings in config.json (`TaskKind.export_config`)."""
    import torch

    from deberta import hf
    from deberta.config import DebertaConfig
    from deberta.model import unshared_state_dict

    head = json.loads((model_dir / "finetune.json").read_text())
    cfg = DebertaConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    state = torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True)
    # HF layers own their weights: a model with ALBERT's shared layers is exported as its unshared copy
    model = task.kind.build_head(cfg.replace(share_layers="none"), head["num_labels"], dropout, sift=head["sift"])
    model.load_state_dict(unshared_state_dict(state, cfg))
    # HF has no place for SiFT's parameter-free normalisation of the embeddings: the export drops it (logits move
    # by ~1e-6 relative at this scale; measured in tests/unit/test_hf_interop.py)
    hf.save_pretrained(model.eval(), hf_dir, vocab_dir=model_dir / "tokenizer", labels=task.labels or None,
                       model_max_length=head["max_seq_len"], drop_sift_normalisation=head["sift"],
                       config_extra=task.kind.export_config(task, head))


ONNX_CHECK_ROWS = 64
"""Dev rows the ONNX export is checked on against torch before it goes into the registry version."""


_EXPORTING = threading.Lock()
"""torch.onnx's TorchScript exporter keeps its state (opset, "in export") in one module-level GLOBALS: one export
at a time in a process whose threads fine-tune several tasks."""


def export_onnx(hf_dir: Path, onnx_dir: Path, dev_ids) -> str:
    """onnx_dir/model.onnx: the champion for onnxruntime (`deberta.onnx_export`), its logits checked against torch's
    on the first dev rows, at their own width and at a narrower one (the traced graph holds at any length). Returns
    the line the stage prints and the version is tagged with; an export that differs (or one the exporter refuses)
    is deleted and said there: the version then carries hf/ alone, never an ONNX file that answers differently."""
    import shutil

    import numpy as np

    from deberta import onnx_export

    rows = np.asarray(dev_ids[:ONNX_CHECK_ROWS]).astype(np.int64)
    width = max(1, int((rows != 0).sum(-1).max()))  # right-padded with [PAD]=0: the widest row's tokens
    narrow = max(1, width // 2)
    batches = (rows[..., :width], rows[:8, ..., :narrow])
    try:
        with _EXPORTING:
            path = onnx_export.export(hf_dir, onnx_dir)
        diff = onnx_export.check(hf_dir, path, *batches)
    except ValueError as e:
        shutil.rmtree(onnx_dir, ignore_errors=True)
        return f"none: {e}"
    return f"{onnx_export.FILE}: logits within {diff:.1e} of torch on {len(rows)} dev rows"


def register_champion(ctx: StageContext, out: Path, task: TaskRef, champion: dict, baseline: float,
                      init: "ExternalCheckpoint | None" = None, extra_tags: dict[str, str] | None = None,
                      onnx: str = "") -> str:
    """Log model/ on the stage's run, hf/ as an MLflow Model (core/hf_pyfunc.py: `mlflow.pyfunc.load_model`
    predicts from `sentence1` (+ `sentence2`), `mlflow models serve` serves it) with onnx/ beside it when
    `export_onnx` wrote one (`pipeline.predict --backend onnx` runs it; `onnx`: its line, a tag), and register that as
    deberta-<preset>-<task> @champion; returns the version. Tags: the champion's epoch (`best_epoch`) and every dev
    figure of that epoch (`dev_<metric>`, the v2.0 `dev_null_threshold` its export answers with). init: the
    external checkpoint it started from, named in the version's tags (`init`, `init_digest`); `extra_tags`: e.g.
    the gain over scratch (`control.py`)."""
    ctx.tracker.log_artifacts(out / "model", "model")
    trial_cfg = {k: _jsonable(champion)[k] for k in (*GRID_KEYS, "seed")}
    tags = {"pretrain": ctx.lineage.get("pretrain", ""), "corpus": ctx.lineage.get("corpus", ""),
            "vocab": ctx.lineage.get("vocab", ""), "task": task.id, "task_name": task.name, "sweep": ctx.artifact_id,
            "trial_id": champion["trial_id"], "trial_config": json.dumps(trial_cfg, sort_keys=True),
            "best_epoch": str(champion["best_epoch"]), "baseline": f"{baseline:.6f}",
            # every dev figure of the served epoch (metric and the v2.0 threshold included)
            **{k: f"{v:.6f}" for k, v in _jsonable(champion).items() if k.startswith("dev_")}}
    tags.update({name: tags["baseline"] for name in task.kind.baseline_aliases})
    if init is not None:
        tags.update(init=init.source, init_digest=init.id)
    tags.update(extra_tags or {})
    if onnx:
        tags["onnx"] = onnx
    kind = task.kind
    onnx_dir = out / "onnx" if (out / "onnx").is_dir() else None
    with tempfile.TemporaryDirectory() as code:  # the kinds' code ships with the model: it predicts (one path)
        uri = ctx.tracker.log_hf_model(out / "hf", task=kind.pyfunc_task, input_example=kind.input_example(task),
                                       name="champion", tags=tags, kind=type(kind).__module__,
                                       code_paths=tuple(code_tree(Path(code), kind)), auto=kind.hf_auto,
                                       outputs=kind.signature_outputs(task), onnx_dir=onnx_dir)
    return ctx.tracker.register_model(f"deberta-{ctx.preset}-{task.name}", model_uri=uri, alias="champion",
                                      tags=tags)
