"""MLflow lineage: with core/registry.py (registry versions back to disk), the only module that imports mlflow.

One parent run per pipeline invocation, one child run per stage. A child run carries the
stage's resolved config as params, its artifact id and input ids as tags, and its inputs as
MLflow datasets with digests, so any registered model can be walked back to the corpus.
`Tracker` wraps one run by id (no global "active run"), so it pickles into Ray workers.

Registry versions are MLflow Models: `Tracker.log_hf_model` logs a `deberta.hf` export directory as a pyfunc
(core/hf_pyfunc.py, "models from code": why not the `transformers` flavor is said there) in an MLflow 3 logged
model linked to the run, and `register_model` registers that; core/registry.py brings a version back to disk.

A sqlite store is opened under a lock file beside it (`mlflow.db.lock`, core/locks.py): MLflow creates and migrates
the schema on first open, and two runs starting at once on one workdir would both migrate it and break each other.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
from mlflow.data.dataset_source import DatasetSource
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from core import locks

EXPERIMENT = "deberta-pipeline"
TAG_STAGE = "pipeline.stage"
TAG_ARTIFACT = "pipeline.artifact_id"
TAG_STATUS = "pipeline.status"
# MLflow 3.17's UI opens an experiment by this tag: "custom_model_development" -> the Runs tab of the "Machine
# learning" workflow. Untagged, the page keeps the sidebar's workflow, which defaults to GenAI (traces).
TAG_EXPERIMENT_KIND, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
HF_PYFUNC = Path(__file__).with_name("hf_pyfunc.py")
PRETRAINED_AUTO = {"fill-mask": "AutoModelForMaskedLM", "feature-extraction": "AutoModel"}
"""The tasks of a pretrained model's export (it reads `text`; fill-mask: with [MASK]) and their transformers auto
classes. A fine-tuned model's task, columns, auto class and answers are its task kind's (core/hf_pyfunc.py)."""
# What the model needs at load time. Given, MLflow does not infer them (it would load the model again in a
# subprocess); local version labels (+cpu) are dropped so the pins resolve on any index.
HF_REQUIREMENTS = ("transformers", "tokenizers", "safetensors", "torch", "pandas", "numpy")


def default_tracking_uri(workdir: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else a sqlite store under the workdir (the registry works without a server)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    (workdir / "mlflow").mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(workdir / 'mlflow' / 'mlflow.db').resolve()}"


STORE_LOCK_TIMEOUT_S = 300.0
"""How long a run waits for another to finish creating the sqlite store (seconds, on a slow shared disk)."""


@contextlib.contextmanager
def opening_store(tracking_uri: str):
    """For a sqlite store, hold its lock while the schema is created or checked (LockHeld after the timeout)."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    lock = locks.wait(db.with_name(db.name + ".lock"), timeout=STORE_LOCK_TIMEOUT_S)
    try:
        yield
    finally:
        lock.release()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


_FLUENT_URI = threading.RLock()


@contextlib.contextmanager
def fluent_tracking_uri(uri: str):
    """Point the fluent API (which `log_model` and the sqlite registry use) at `uri` for a while, then restore it.

    set_tracking_uri also writes MLFLOW_TRACKING_URI, which `default_tracking_uri` reads: both the global and the
    variable are put back exactly as they were (get_tracking_uri would turn "unset" into the default store). Both
    are one per process, so threads (the tasks of a suite, fine-tuned side by side) take turns."""
    from mlflow.tracking._tracking_service import utils

    with _FLUENT_URI:
        previous, previous_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)
            if previous_env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = previous_env



def _hf_signature(task: str, columns: list[str], outputs: list[dict[str, Any]] | None):
    """Inputs: the example's columns, text or lists of texts; outputs: a fine-tuned model's from its kind (MLflow
    schema JSON), a pretrained model's as core/hf_pyfunc.py answers for the task."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import Array

    inputs = Schema([ColSpec(Array(DataType.string) if listed else DataType.string, c) for c, listed in columns])
    if outputs is not None:
        return ModelSignature(inputs, Schema.from_json(json.dumps(outputs)))
    if task == "fill-mask":
        answers = [ColSpec("string", "token"), ColSpec("double", "score"), ColSpec("string", "sequence")]
    else:
        answers = [ColSpec(Array(DataType.double), "embedding")]
    return ModelSignature(inputs, Schema(answers))


@functools.lru_cache(maxsize=None)
def client_of(tracking_uri: str) -> MlflowClient:
    """One client per tracking URI and process: a Tracker logs every training step, and a client is not free."""
    return MlflowClient(tracking_uri)


@dataclass(frozen=True)
class Tracker:
    """One MLflow run, addressed by id. Picklable: pass it to Ray workers and log from rank 0."""

    tracking_uri: str
    run_id: str
    experiment_id: str

    @property
    def client(self) -> MlflowClient:
        return client_of(self.tracking_uri)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, timestamp_ms: int | None = None) -> None:
        """`timestamp_ms`: when the values were measured (a buffered point arrives later); default now."""
        ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_dict(self, obj: dict[str, Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, path: Path | str, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path)

    def child(self, name: str, tags: dict[str, Any] | None = None) -> "Tracker":
        """A nested run under this one (e.g. one per Tune trial)."""
        tags = {"mlflow.parentRunId": self.run_id, **(tags or {})}
        run = self.client.create_run(self.experiment_id, run_name=name, tags={k: str(v) for k, v in tags.items()})
        return Tracker(self.tracking_uri, run.info.run_id, self.experiment_id)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)

    def log_hf_model(self, hf_dir: Path | str, *, task: str, input_example, name: str = "model",
                     tags: dict[str, Any] | None = None, kind: str = "", code_paths: tuple[Path, ...] = (),
                     auto: str = "", outputs: list[dict[str, Any]] | None = None,
                     onnx_dir: Path | str | None = None) -> str:
        """Log an HF directory (`deberta.hf.save_pretrained`) as an MLflow Model - core/hf_pyfunc.py over the
        directory, kept whole as the model's artifact `hf` - in an MLflow 3 logged model of this run's experiment
        whose source run is this one. Returns its URI, `models:/<model_id>`, for `register_model(model_uri=...)`.

        task: the transformers pipeline tag (the logged model's type). input_example: a pandas DataFrame (or dict of
        lists) whose columns are the model's inputs (`text` for a pretrained model's tasks, PRETRAINED_AUTO).
        kind: for a fine-tuned model, the module of the task kind whose code predicts
        (`stages.finetune.kinds.base.TaskKind`), importable from `code_paths`, which the model ships (MLflow's
        `code_paths`); with it `auto`, the transformers auto class its export loads with, and `outputs`, its
        answer columns as MLflow schema JSON (`TaskKind.hf_auto`, `signature_outputs`). onnx_dir: a directory
        holding the model's ONNX export (`deberta.onnx_export`), kept as the model's artifact `onnx` beside `hf`.
        """
        import pandas as pd

        hf_dir = Path(hf_dir).resolve()  # an absolute path is never taken for a Hub repo id
        if not kind and task not in PRETRAINED_AUTO:
            raise ValueError(f"log_hf_model: task={task!r} without a task kind; a pretrained model's task is one of "
                             f"{tuple(PRETRAINED_AUTO)}, a fine-tuned model names its kind")
        if not (hf_dir / "config.json").is_file() or not (hf_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"log_hf_model: {hf_dir} lacks config.json or tokenizer.json; write it with "
                                    f"deberta.hf.save_pretrained(model, dir, vocab_dir=...)")
        if bool(kind) != bool(code_paths) or bool(kind) != bool(auto) or bool(kind) != bool(outputs):
            raise ValueError(f"log_hf_model: kind={kind!r}: a fine-tuned model needs kind, code_paths, auto and "
                             f"outputs together, a pretrained one none of them")
        example = pd.DataFrame(input_example)
        if not kind and tuple(example.columns) != ("text",):
            raise ValueError(f"log_hf_model: input_example has columns {list(example.columns)}; a {task} model "
                             f"takes ['text']")
        # Created here, not by Model.log: MLflow 3.17 files a new logged model under the fluent API's active
        # experiment (the default one, "0"), not under its source run's.
        logged = self.client.create_logged_model(
            self.experiment_id, name=name, source_run_id=self.run_id, model_type=task,
            params=self.client.get_run(self.run_id).data.params,
            tags={k: str(v) for k, v in (tags or {}).items()} or None)
        _log_pyfunc_model(self.tracking_uri, self.run_id, logged.model_id, hf_dir, task, example,
                          {"kind": kind, "auto": auto or PRETRAINED_AUTO.get(task, "")}, code_paths, outputs,
                          Path(onnx_dir).resolve() if onnx_dir else None)
        return f"models:/{logged.model_id}"

    def register_model(self, name: str, artifact_path: str | None = None, tags: dict[str, Any] | None = None,
                       alias: str | None = None, description: str | None = None, *,
                       model_uri: str | None = None) -> str:
        """Register a new version of `name`; returns the version.

        model_uri: a logged model (`models:/<model_id>`, from `log_hf_model`) - the version is an MLflow Model
        linked to it and to this run. artifact_path: the older form, `runs:/<this run>/<artifact_path>`.
        """
        if (model_uri is None) == (artifact_path is None):
            raise ValueError("register_model: give exactly one of model_uri (models:/<model_id>) or artifact_path")
        client = self.client
        try:
            client.get_registered_model(name)
        except mlflow.exceptions.MlflowException:
            client.create_registered_model(name, description=description)
        model_id = model_uri.removeprefix("models:/") if model_uri else None
        if model_uri and (not model_uri.startswith("models:/") or "/" in model_id):
            raise ValueError(f"register_model: model_uri={model_uri!r} must be a logged model, models:/<model_id>")
        # a sqlite registry resolves models:/<id> through the fluent API's store, so point that at ours too
        with fluent_tracking_uri(self.tracking_uri):
            mv = client.create_model_version(
                name, source=model_uri or f"runs:/{self.run_id}/{artifact_path}", run_id=self.run_id,
                tags={k: str(v) for k, v in (tags or {}).items()}, description=description, model_id=model_id,
            )
        if alias:
            client.set_registered_model_alias(name, alias, mv.version)
        return str(mv.version)


def _log_pyfunc_model(tracking_uri: str, run_id: str, model_id: str, hf_dir: Path, task: str, example,
                      serving: dict[str, str], code_paths: tuple[Path, ...], outputs: list | None,
                      onnx_dir: Path | None = None) -> None:
    """Fill logged model `model_id` with core/hf_pyfunc.py over the HF directory."""
    import tempfile

    from mlflow.models import Model

    with tempfile.TemporaryDirectory() as tmp, fluent_tracking_uri(tracking_uri):
        # the task and input columns as an artifact, not as model_config: Model.log copies a model_config into the
        # run's params, where a second model of the same run would collide with the first
        interface = Path(tmp) / "interface.json"
        interface.write_text(json.dumps({"task": task, "inputs": list(example.columns), **serving}) + "\n")
        # Model.log rather than mlflow.pyfunc.log_model, which cannot name the run (it would need an active one)
        Model.log(
            artifact_path=None, name="model", flavor=mlflow.pyfunc, run_id=run_id, model_id=model_id,
            python_model=str(HF_PYFUNC), artifacts={"hf": str(hf_dir), "interface": str(interface),
                                                    **({"onnx": str(onnx_dir)} if onnx_dir else {})},
            signature=_hf_signature(task, [(c, isinstance(example[c].iloc[0], (list, tuple))) for c in example.columns],
                                     outputs), input_example=example,
            pip_requirements=[f"{p}=={metadata.version(p).split('+')[0]}" for p in HF_REQUIREMENTS],
            code_paths=[str(p) for p in code_paths] or None,
        )


class Lineage:
    """Driver-side: the invocation's parent run and the per-stage child runs."""

    def __init__(self, workdir: Path, experiment: str = EXPERIMENT):
        self.tracking_uri = default_tracking_uri(workdir)
        self.artifact_root = (workdir / "mlflow" / "artifacts").resolve()
        with opening_store(self.tracking_uri):  # the schema, and the experiment, created once
            client = client_of(self.tracking_uri)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                location = None if self.tracking_uri.startswith("http") else self.artifact_root.as_uri()
                exp_id = client.create_experiment(experiment, artifact_location=location,
                                                  tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
            else:
                exp_id = exp.experiment_id
                if TAG_EXPERIMENT_KIND not in exp.tags:  # created before the tag existed: the UI guessed GenAI
                    client.set_experiment_tag(exp_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        self.experiment_id = exp_id
        self.parent: Tracker | None = None

    def start(self, run_name: str, config: dict[str, Any], plan: list[str]) -> Tracker:
        client = client_of(self.tracking_uri)
        run = client.create_run(self.experiment_id, run_name=run_name,
                                tags={"pipeline.plan": ",".join(plan), "pipeline.preset": config["preset"]})
        self.parent = Tracker(self.tracking_uri, run.info.run_id, self.experiment_id)
        self.parent.log_dict(config, "config.json")
        return self.parent

    def stage_run(self, stage: str, art_id: str, config: dict[str, Any],
                  inputs: dict[str, tuple[str, str, str]], cached: bool) -> Tracker:
        """Child run for a stage. `inputs` maps name -> (artifact id, digest, source path)."""
        assert self.parent is not None, "start() the parent run first"
        tags = {TAG_STAGE: stage, TAG_ARTIFACT: art_id, TAG_STATUS: "cached" if cached else "running"}
        tags.update({f"pipeline.input.{name}": ids[0] for name, ids in inputs.items()})
        tracker = self.parent.child(stage, tags)
        tracker.log_params(config)
        self._log_inputs(tracker, inputs)
        return tracker

    @staticmethod
    def _log_inputs(tracker: Tracker, inputs: dict[str, tuple[str, str, str]]) -> None:
        import warnings

        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        entries = []
        for name, (art_id, digest, source) in inputs.items():
            with warnings.catch_warnings():  # local paths match two equivalent source types
                warnings.simplefilter("ignore")
                src = RegistrySource(source) if source.startswith(MODELS_URI) else resolve_dataset_source(source)
            ds = MetaDataset(source=src, name=f"{name}:{art_id}", digest=digest)
            entries.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", name)]))
        if entries:
            with _LOGGING_INPUTS:
                tracker.client.log_inputs(tracker.run_id, datasets=entries)


_LOGGING_INPUTS = threading.Lock()
"""MLflow's SQL store adds a dataset that is not in the experiment yet by looking, then inserting: stage runs opened
at once from threads (a suite's tasks, all reading the same checkpoint) would both insert it, and one fail on the
store's unique key. They log their inputs one at a time."""


# ----------------------------------------------------------------------------------------------- registry -> disk

MODELS_URI = "models:/"


class RegistrySource(DatasetSource):
    """A registry version (`models:/NAME/VERSION`) as the source of a run's input dataset: MLflow resolves no source
    type for models:/ URIs, and the lineage should name the version, not the directory it was downloaded to."""

    def __init__(self, uri: str):
        self.uri = uri

    @staticmethod
    def _get_source_type() -> str:
        return "mlflow_registry"

    def load(self, **kwargs):
        raise NotImplementedError("download it with core.registry.download_registered_model")

    @staticmethod
    def _can_resolve(raw_source) -> bool:
        return isinstance(raw_source, str) and raw_source.startswith(MODELS_URI)

    @classmethod
    def _resolve(cls, raw_source) -> "RegistrySource":
        return cls(raw_source)

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri}

    @classmethod
    def from_dict(cls, source_dict) -> "RegistrySource":
        return cls(source_dict["uri"])
