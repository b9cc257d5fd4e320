"""MLflow lineage: the only module that imports mlflow.

One parent run per pipeline invocation, one child run per stage. A child run carries the
stage's resolved config as params, its artifact id and input ids as tags, and its inputs as
MLflow datasets with digests, so any registered model can be walked back to the corpus.
`Tracker` wraps one run by id (no global "active run"), so it pickles into Ray workers.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

EXPERIMENT = "deberta-pipeline"
TAG_STAGE = "pipeline.stage"
TAG_ARTIFACT = "pipeline.artifact_id"
TAG_STATUS = "pipeline.status"


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

    def register_model(self, name: str, artifact_path: str, tags: dict[str, Any],
                       alias: str | None = None, description: str | None = None) -> str:
        """Register `runs:/<this run>/<artifact_path>` as a new version of `name`; returns the version."""
        client = self.client
        try:
            client.get_registered_model(name)
        except mlflow.exceptions.MlflowException:
            client.create_registered_model(name, description=description)
        mv = client.create_model_version(
            name, source=f"runs:/{self.run_id}/{artifact_path}", run_id=self.run_id,
            tags={k: str(v) for k, v in tags.items()}, description=description,
        )
        if alias:
            client.set_registered_model_alias(name, alias, mv.version)
        return str(mv.version)


class Lineage:
    """Driver-side: the invocation's parent run and the per-stage child runs."""

    def __init__(self, workdir: Path, experiment: str = EXPERIMENT):
        self.tracking_uri = default_tracking_uri(workdir)
        self.artifact_root = (workdir / "mlflow" / "artifacts").resolve()
        client = _client(self.tracking_uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            location = None if self.tracking_uri.startswith("http") else self.artifact_root.as_uri()
            exp_id = client.create_experiment(experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
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
