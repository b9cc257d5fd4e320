"""MLflow lineage: the only module that imports mlflow.

One parent run per pipeline invocation, one child run per stage. A child run carries the
stage's resolved config as params, its artifact id and input ids as tags, and its inputs as
MLflow datasets with digests, so any registered model can be walked back to the corpus.
`Tracker` wraps one run by id (no global "active run"), so it pickles into Ray workers.

Registry versions are MLflow Models: `Tracker.log_hf_model` logs a `deberta.hf` export directory with MLflow's
`transformers` flavor as an MLflow 3 logged model linked to the run, and `register_model` registers that.
The flavor rather than a pyfunc of ours: the model's files stay plain HF directories (model/, components/tokenizer/)
that any `transformers` user loads, `mlflow.pyfunc` predicts through `transformers.pipeline` (text pairs and
regression included), and `mlflow models serve` serves it with no code of ours to ship or import - a custom
PythonModel would have to carry this package (or a models-from-code file) into every serving environment.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

EXPERIMENT = "deberta-pipeline"
TAG_STAGE = "pipeline.stage"
TAG_ARTIFACT = "pipeline.artifact_id"
TAG_STATUS = "pipeline.status"
# MLflow 3.17's UI opens an experiment by this tag: "custom_model_development" -> the Runs tab of the "Machine
# learning" workflow. Untagged, the page keeps the sidebar's workflow, which defaults to GenAI (traces).
TAG_EXPERIMENT_KIND, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
HF_TASKS = ("fill-mask", "text-classification")
# What an HF export needs at load time. Given, the flavor does not infer them (it would load the model again in a
# subprocess, and adds torchvision); local version labels (+cpu) are dropped so the pins resolve on any index.
HF_REQUIREMENTS = ("transformers", "tokenizers", "safetensors", "torch")


def default_tracking_uri(workdir: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else a sqlite store under the workdir (the registry works without a server)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    (workdir / "mlflow").mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(workdir / 'mlflow' / 'mlflow.db').resolve()}"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


@contextlib.contextmanager
def _tracking_uri(uri: str):
    """Point the fluent API (which `log_model` and the sqlite registry use) at `uri` for a while, then restore it.

    set_tracking_uri also writes MLFLOW_TRACKING_URI, which `default_tracking_uri` reads: both the global and the
    variable are put back exactly as they were (get_tracking_uri would turn "unset" into the default store)."""
    from mlflow.tracking._tracking_service import utils

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


def _hf_signature(task: str, example):
    """Inputs: the example's string columns (text, and text_pair for pair tasks); outputs: label + score, or the
    fill-mask pipeline's best token."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    inputs = Schema([ColSpec("string", str(c)) for c in example.columns])
    if task == "text-classification":
        return ModelSignature(inputs, Schema([ColSpec("string", "label"), ColSpec("double", "score")]))
    return ModelSignature(inputs, Schema([ColSpec("string")]))


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

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        ts = int(time.time() * 1000)
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
                     tags: dict[str, Any] | None = None) -> str:
        """Log an HF directory (`deberta.hf.save_pretrained`) as an MLflow Model with the `transformers` flavor:
        an MLflow 3 logged model in this run's experiment whose source run is this one. Returns its URI,
        `models:/<model_id>`, for `register_model(model_uri=...)`.

        task: "fill-mask" or "text-classification". input_example: a pandas DataFrame (or dict of lists) with a
        `text` column, and `text_pair` for pair tasks; its columns become the signature's inputs.
        """
        import pandas as pd

        hf_dir = Path(hf_dir).resolve()  # an absolute path is never taken for a Hub repo id
        if task not in HF_TASKS:
            raise ValueError(f"log_hf_model: task={task!r}; choose one of {HF_TASKS}")
        if not (hf_dir / "config.json").is_file() or not (hf_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"log_hf_model: {hf_dir} lacks config.json or tokenizer.json; write it with "
                                    f"deberta.hf.save_pretrained(model, dir, vocab_dir=...)")
        example = pd.DataFrame(input_example)
        if "text" not in example.columns or set(example.columns) - {"text", "text_pair"}:
            raise ValueError(f"log_hf_model: input_example has columns {list(example.columns)}; give `text` "
                             f"(and `text_pair` for pair tasks)")
        # Created here, not by log_model: MLflow 3.17 files a new logged model under the fluent API's active
        # experiment (the default one, "0"), not under its source run's.
        logged = self.client.create_logged_model(
            self.experiment_id, name=name, source_run_id=self.run_id, model_type=task,
            params=self.client.get_run(self.run_id).data.params,
            tags={k: str(v) for k, v in (tags or {}).items()} or None)
        _log_transformers_model(self.tracking_uri, self.run_id, logged.model_id, hf_dir, task, example)
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


def _log_transformers_model(tracking_uri: str, run_id: str, model_id: str, hf_dir: Path, task: str, example) -> None:
    """Fill logged model `model_id` with the HF directory as a `transformers`-flavor MLflow Model."""
    import mlflow.transformers
    import transformers
    from huggingface_hub import ModelCard

    # MLflow 3.17's directory form (log_model(str(hf_dir), task=...)) fails on transformers 5 (`check_task` now
    # names the pipeline class as a string: AttributeError '__name__'); a pipeline in memory takes the flavor's
    # main path. It reads the directory offline and holds the model once in memory (fp32: 4 bytes a parameter).
    pipe = transformers.pipeline(task, model=str(hf_dir), tokenizer=str(hf_dir))
    readme = hf_dir / "README.md"
    with _tracking_uri(tracking_uri):
        mlflow.transformers.log_model(
            pipe, name="model", task=task, model_id=model_id, run_id=run_id,
            signature=_hf_signature(task, example), input_example=example,
            # given, the card is not looked up on the Hub (the flavor would try the local path as a repo id)
            model_card=ModelCard.load(readme) if readme.is_file() else None,
            pip_requirements=[f"{p}=={metadata.version(p).split('+')[0]}" for p in HF_REQUIREMENTS],
            # truncate to the tokenizer's model_max_length (fine-tuning's max_seq_len), pairs longest first
            model_config={"truncation": True} if task == "text-classification" else None,
        )


class Lineage:
    """Driver-side: the invocation's parent run and the per-stage child runs."""

    def __init__(self, workdir: Path, experiment: str = EXPERIMENT):
        self.tracking_uri = default_tracking_uri(workdir)
        self.artifact_root = (workdir / "mlflow" / "artifacts").resolve()
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
                src = resolve_dataset_source(source)
            ds = MetaDataset(source=src, name=f"{name}:{art_id}", digest=digest)
            entries.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", name)]))
        if entries:
            tracker.client.log_inputs(tracker.run_id, datasets=entries)
