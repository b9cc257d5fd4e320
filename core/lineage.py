"""MLflow lineage: the only module that imports mlflow.

One parent run per pipeline invocation, one child run per stage. A child run carries the
stage's resolved config as params, its artifact id and input ids as tags, and its inputs as
MLflow datasets with digests, so any registered model can be walked back to the corpus.
`Tracker` wraps one run by id (no global "active run"), so it pickles into Ray workers.

Registry versions are MLflow Models: `Tracker.log_hf_model` logs a `deberta.hf` export directory as a pyfunc
(core/hf_pyfunc.py, "models from code": why not the `transformers` flavor is said there) in an MLflow 3 logged
model linked to the run, and `register_model` registers that. `download_registered_model` brings a version's export
back to disk (`finetune.init=models:/NAME/VERSION`).

A sqlite store is opened under a lock file beside it (`mlflow.db.lock`, core/locks.py): MLflow creates and migrates
the schema on first open, and two runs starting at once on one workdir would both migrate it and break each other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
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
from core.artifacts import file_digest

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
def _opening_store(tracking_uri: str):
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
def _tracking_uri(uri: str):
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
def _client(tracking_uri: str) -> MlflowClient:
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
        return _client(self.tracking_uri)

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
        with _tracking_uri(self.tracking_uri):
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

    with tempfile.TemporaryDirectory() as tmp, _tracking_uri(tracking_uri):
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
        with _opening_store(self.tracking_uri):  # the schema, and the experiment, created once
            client = _client(self.tracking_uri)
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
        client = _client(self.tracking_uri)
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
        raise NotImplementedError("download it with core.lineage.download_registered_model")

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


@dataclass(frozen=True)
class RegisteredExport:
    """A registry version's HF export, on local disk."""

    uri: str
    """models:/NAME/VERSION: the version itself (an alias resolved; a version never changes)."""
    path: Path
    source: str
    """The version's source: its logged model (models:/<model_id>) or run artifact (runs:/...)."""


def _parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """models:/NAME/VERSION -> (name, version, None); models:/NAME@ALIAS -> (name, None, alias)."""
    rest = uri.removeprefix(MODELS_URI)
    name, sep, version = rest.partition("/")
    if sep and name and version.isdigit():
        return name, version, None
    name, sep, alias = rest.partition("@")
    if sep and name and alias and "/" not in rest:
        return name, None, alias
    raise ValueError(f"{uri}: expected models:/NAME/VERSION (a number) or models:/NAME@ALIAS")


def _model_version(client: MlflowClient, uri: str, tracking_uri: str):
    """The registry version a models:/ URI names; ValueError saying what the registry has instead."""
    name, version, alias = _parse_models_uri(uri)
    try:
        registered = client.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        known = [m.name for m in client.search_registered_models(max_results=50)]
        raise ValueError(f"no registered model {name!r} in {tracking_uri} (it has: {', '.join(known) or 'none'}); "
                         f"check the name, or point MLFLOW_TRACKING_URI at the registry that holds it") from None
    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except mlflow.exceptions.MlflowException:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise ValueError(f"{name!r} has no {'alias ' + repr(alias) if alias else 'version ' + version} (versions: "
                         f"{', '.join(map(str, versions)) or 'none'}; aliases: "
                         f"{', '.join(registered.aliases) or 'none'})") from None


def champion_version(tracking_uri: str, name: str, sweep: str) -> tuple[str, dict[str, str]]:
    """(version, tags) of registry model `name`'s newest version registered by sweep artifact `sweep` (its `sweep`
    tag), or ("", {}) when there is none."""
    client = _client(tracking_uri)
    try:
        versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get("sweep") == sweep]
    except mlflow.exceptions.MlflowException:
        return "", {}
    if not versions:
        return "", {}
    newest = max(versions, key=lambda v: int(v.version))
    return newest.version, dict(newest.tags)


def logged_json(tracking_uri: str, ref: str, artifact: str) -> tuple[str, dict[str, Any]]:
    """(the pipeline run's id, the JSON file `artifact` it logged) for `ref`: that run's id, or a registry version
    (models:/NAME/VERSION or @ALIAS) whose stage run it is the parent of. ValueError saying what is missing."""
    client = _client(tracking_uri)
    run_id = ref
    if ref.startswith(MODELS_URI):
        version = _model_version(client, ref, tracking_uri)
        run_id = client.get_run(version.run_id).data.tags.get("mlflow.parentRunId", version.run_id)
    try:
        client.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise ValueError(f"{ref}: no run of that id in {tracking_uri}; give a pipeline run's id (the summary's "
                         f"'parent run') or models:/NAME/VERSION") from None
    try:
        with open(client.download_artifacts(run_id, artifact)) as f:
            return run_id, json.load(f)
    except (OSError, mlflow.exceptions.MlflowException):
        raise ValueError(f"{ref}: run {run_id} logged no {artifact} (a run that fine-tuned nothing, or one from "
                         f"before the table was logged)") from None


def _export_path(model_dir: Path) -> str:
    """Where a downloaded MLflow Model keeps its HF export: the pyfunc's artifact `hf` ("" if it has none)."""
    if not (model_dir / "MLmodel").is_file():
        return ""
    pyfunc = mlflow.models.Model.load(str(model_dir / "MLmodel")).flavors.get("python_function", {})
    return (pyfunc.get("artifacts") or {}).get("hf", {}).get("path", "")


def download_registered_model(uri: str, workdir: Path) -> RegisteredExport:
    """The HF export a registry version holds, downloaded once per logged model to
<workdir>/registry/NAME/VERSION-<model id> (or -run-<run id>): keyed by what the version is, not by its name and
number, which another tracking server or a recreated registry gives to other weights.

    A version logged by `Tracker.log_hf_model` holds it as its pyfunc's artifact `hf`; one registered from a run
    directory (an RTD pretraining's checkpoint, today) is read from the `hf/` its run logged. ValueError (one message
    naming the fix) for a malformed URI, an unknown model, version or alias, or a version without an HF export.
    """
    tracking_uri = default_tracking_uri(workdir)
    store = tracking_uri.removeprefix("sqlite:///")
    if tracking_uri.startswith("sqlite:///") and not Path(store).is_file():  # asked, sqlite would create an empty one
        raise ValueError(f"there is no registry at {store} (nothing was registered from this workdir); set "
                         f"MLFLOW_TRACKING_URI to the tracking server or sqlite:///PATH that holds the model")
    try:
        return _download_version(uri, workdir, tracking_uri)
    except mlflow.exceptions.MlflowException as e:  # an unreachable server, a missing artifact
        raise ValueError(f"reading it from the registry at {tracking_uri} failed: {e.message}") from None


def _download_version(uri: str, workdir: Path, tracking_uri: str) -> RegisteredExport:
    import shutil
    import tempfile

    client = _client(tracking_uri)
    mv = _model_version(client, uri, tracking_uri)
    version_uri = f"{MODELS_URI}{mv.name}/{mv.version}"
    what = mv.source.removeprefix(MODELS_URI) if mv.source.startswith(MODELS_URI) else f"run-{mv.run_id}"
    target = workdir / "registry" / mv.name / f"{mv.version}-{what}"
    if (target / "config.json").is_file():  # renamed into place whole: present means complete
        return RegisteredExport(version_uri, target, mv.source)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{mv.version}-") as tmp, _tracking_uri(tracking_uri):
        hf_dir = None
        if mv.source.startswith(MODELS_URI):  # a logged model: its pyfunc's artifact `hf`
            root = Path(mlflow.artifacts.download_artifacts(artifact_uri=version_uri, dst_path=tmp))
            hf_dir = root / _export_path(root) if _export_path(root) else None
        elif mv.run_id and "hf" in {f.path for f in client.list_artifacts(mv.run_id)}:  # a run directory
            hf_dir = Path(mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path="hf", dst_path=tmp))
        if hf_dir is None or not (hf_dir / "config.json").is_file():
            raise ValueError(f"{version_uri} (source {mv.source}) holds no HF export: no artifact `hf` in its MLflow "
                             f"Model and no hf/ in its run; register the model with Tracker.log_hf_model")
        shutil.move(str(hf_dir), str(target))
    return RegisteredExport(version_uri, target, mv.source)


# ----------------------------------------------------------------------------------------------- batch prediction

@dataclass(frozen=True)
class PredictionModel:
    """A logged MLflow Model (core/hf_pyfunc.py over an HF export) on local disk, for batch prediction."""

    uri: str
    """What was downloaded, a URI that names the same bytes tomorrow: models:/<model_id> (a registry version's
    logged model), runs:/RUN/PATH, or models:/NAME/VERSION for a version without a logged model."""
    path: Path
    """The downloaded MLflow Model directory (MLmodel, artifacts/)."""
    hf: Path
    """Its HF export (the pyfunc's artifact `hf`)."""
    interface: dict[str, Any]
    """The pyfunc's artifact `interface`: {"task", "inputs", "kind", "auto"}."""
    outputs: list[dict[str, Any]] | None
    """The signature's answer columns, MLflow schema JSON (None without a signature)."""
    model_id: str = ""
    """The MLflow 3 logged model behind it ("" for a run's model logged without one)."""
    onnx: Path | None = None
    """The directory of its ONNX export (the pyfunc's artifact `onnx`, the finetune stage's), None without one."""
    version: str = ""
    """The registry version it was asked for by (models:/NAME/VERSION, an alias resolved), else `uri`: for people."""
    identity: str = ""
    """What the model is, for the predictions' lineage and their reuse: models:/<model_id>, or without a logged
    model `uri` at its tracking server (a run id is only unique within one store)."""


CACHE_FILES = "files.json"
"""Beside a cached model's `model/`: the SHA-256 of each of its files, written at download, checked on reuse."""


def _cache_key(client: MlflowClient, uri: str, tracking_uri: str) -> tuple[str, Path, str, str]:
    """(the immutable URI to download, its cache folder, the logged model id, the version asked for) of a model URI.
    The folder is named by what the model is (its logged model id; a run's path with the tracking server), never by
    a registry name and version, which another store or a re-registration gives to other bytes."""
    server = hashlib.sha256(tracking_uri.encode()).hexdigest()[:16]
    if uri.startswith(MODELS_URI) and ("@" in uri or uri.count("/") >= 2):  # a registered name: version or alias
        mv = _model_version(client, uri, tracking_uri)
        version = f"{MODELS_URI}{mv.name}/{mv.version}"
        # MLflow 3.17's REST answer carries no `model_id` (ModelVersion.from_proto); the source names the logged model
        logged = mv.source.removeprefix(MODELS_URI) if mv.source.startswith(MODELS_URI) else ""
        model_id = mv.model_id or ("" if "/" in logged else logged)
        if model_id:
            return f"{MODELS_URI}{model_id}", Path("logged") / model_id, model_id, version
        source = mv.source if mv.source.startswith("runs:/") else version
        return source, Path("versions") / server / hashlib.sha256(mv.source.encode()).hexdigest()[:16], "", version
    if uri.startswith(MODELS_URI):  # a logged model, models:/<model_id>
        model_id = uri.removeprefix(MODELS_URI)
        return uri, Path("logged") / model_id, model_id, uri
    if uri.startswith("runs:/") and uri.count("/") >= 2:
        return uri, Path("runs") / server / uri.removeprefix("runs:/").strip("/"), "", uri
    raise ValueError(f"{uri}: not a model URI; give models:/NAME/VERSION, models:/NAME@ALIAS, models:/<model_id>, "
                     f"runs:/RUN_ID/PATH or an HF export directory")


def _file_digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _cached(target: Path, uri: str) -> bool:
    """Whether `target` holds a whole download whose files still match the digests written with it; a copy that no
    longer does is moved aside (said in one line) so that it is downloaded again."""
    import shutil
    import uuid

    if not (target / CACHE_FILES).is_file():  # renamed into place whole, digests included: absent means none
        return False
    try:
        want = json.loads((target / CACHE_FILES).read_text())
    except ValueError:
        want = None
    got = _file_digests(target / "model")
    if got == want:
        return True
    changed = [CACHE_FILES] if want is None else [f"model/{f}" for f in sorted(set(want) | set(got))
                                                   if want.get(f) != got.get(f)]
    print(f"cache: {target}/{changed[0]} no longer matches the digest written when {uri} was downloaded; "
          f"downloading it again")
    aside = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(FileNotFoundError):  # another process on this node moved it first
        os.rename(target, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return False


def _download(fetch: str, uri: str, tracking_uri: str, target: Path) -> None:
    """`fetch` into `target`/model with its files' digests, renamed into place whole (so a copy there is complete)."""
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp, \
            _tracking_uri(tracking_uri):
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=fetch, dst_path=str(Path(tmp, "download"))))
        if not (got / "MLmodel").is_file():
            raise ValueError(f"{uri} is not an MLflow Model (no MLmodel file); give a model logged by "
                             f"the finetune stage (Tracker.log_hf_model) or an HF export directory")
        entry = Path(tmp, "entry")
        entry.mkdir()
        os.rename(got, entry / "model")
        (entry / CACHE_FILES).write_text(json.dumps(_file_digests(entry / "model"), indent=1, sort_keys=True))
        try:
            os.rename(entry, target)
        except OSError:  # another process put it there first: theirs is complete
            if not (target / CACHE_FILES).is_file():
                raise


def download_model(uri: str, tracking_uri: str, cache: Path) -> PredictionModel:
    """The MLflow Model `uri` names, downloaded once per logged model into `cache` (`_cache_key`) and read: its HF
    export, its interface and its signature's outputs. Called by the driver (which checks the input against it
    before Ray starts) and again by every prediction actor with the driver's `uri` (a no-op on the driver's node; a
    download on another). ValueError, one message naming the fix, for what a user can get wrong."""
    import shutil

    client = _client(tracking_uri)
    try:
        fetch, rel, model_id, version = _cache_key(client, uri, tracking_uri)
        target = Path(cache) / rel
        if not _cached(target, fetch):
            _download(fetch, uri, tracking_uri, target)
    except mlflow.exceptions.MlflowException as e:  # an unreachable server, a missing artifact
        raise ValueError(f"{uri}: reading it from {tracking_uri} failed: {e.message.splitlines()[0]}") from None
    path = target / "model"
    model = mlflow.models.Model.load(str(path / "MLmodel"))
    artifacts = model.flavors.get("python_function", {}).get("artifacts") or {}
    if "hf" not in artifacts or "interface" not in artifacts:
        shutil.rmtree(target, ignore_errors=True)
        raise ValueError(f"{uri} holds no HF export (no pyfunc artifacts `hf` and `interface`); give a model logged "
                         f"by Tracker.log_hf_model (the finetune stage's champion) or an HF export directory")
    interface = json.loads((path / artifacts["interface"]["path"]).read_text())
    outputs = json.loads(model.signature.outputs.to_json()) if model.signature and model.signature.outputs else None
    onnx = path / artifacts["onnx"]["path"] if "onnx" in artifacts else None
    identity = f"{MODELS_URI}{model_id}" if model_id else f"{fetch} at {tracking_uri}"
    return PredictionModel(fetch, path, path / artifacts["hf"]["path"], interface, outputs, model_id, onnx,
                           version, identity)


def log_prediction(tracking_uri: str, name: str, model_uri: str, model_id: str, inputs: str, input_digest: str,
                   output: str, params: dict[str, Any], metrics: dict[str, float]) -> str:
    """One run in the pipeline's experiment for a batch prediction: its input data set (the listed files' digest)
    and the model version as its inputs (and the logged model, MLflow 3's model input), where the predictions went
    as a tag. Returns the run id."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag, LoggedModelInput

    client = _client(tracking_uri)
    with _opening_store(tracking_uri):
        exp = client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else client.create_experiment(
            EXPERIMENT, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
    run = client.create_run(exp_id, run_name=name, tags={TAG_STAGE: "predict", "pipeline.model_version": model_uri,
                                                         "pipeline.output": output})
    tracker = Tracker(tracking_uri, run.info.run_id, exp_id)
    tracker.log_params(params)
    datasets = []
    for context, source, digest in (("predict_input", inputs, input_digest), ("model", model_uri, "")):
        with warnings.catch_warnings():  # local paths match two equivalent source types
            warnings.simplefilter("ignore")
            try:
                src = RegistrySource(source) if source.startswith(MODELS_URI) else resolve_dataset_source(source)
            except Exception:  # a scheme MLflow has no source type for: named as a registry-style URI source
                src = RegistrySource(source)
        ds = MetaDataset(source=src, name=context, digest=digest or None)
        datasets.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
    client.log_inputs(run.info.run_id, datasets=datasets,
                      models=[LoggedModelInput(model_id)] if model_id else None)
    tracker.log_metrics(metrics)
    tracker.end()
    return run.info.run_id
