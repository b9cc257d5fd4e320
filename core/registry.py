"""Registry versions back to disk, and the lineage of what they answer.

`download_registered_model` brings a version's HF export to the workdir (`finetune.init=models:/NAME/VERSION`);
`download_model` caches a logged model for `pipeline.predict`, keyed by what the model is (its model id and a
SHA-256 of every file), so two stores' `NAME/1` never share a cache entry; `log_prediction` records a batch
prediction's inputs, outputs and the model version that answered them. Runs and stage lineage are core/lineage.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from core.artifacts import file_digest
from core.lineage import (EXPERIMENT, EXPERIMENT_KIND, MODELS_URI, TAG_EXPERIMENT_KIND, TAG_STAGE, RegistrySource,
                          Tracker, client_of, default_tracking_uri, fluent_tracking_uri, opening_store)

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
    client = client_of(tracking_uri)
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
    client = client_of(tracking_uri)
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

    client = client_of(tracking_uri)
    mv = _model_version(client, uri, tracking_uri)
    version_uri = f"{MODELS_URI}{mv.name}/{mv.version}"
    what = mv.source.removeprefix(MODELS_URI) if mv.source.startswith(MODELS_URI) else f"run-{mv.run_id}"
    target = workdir / "registry" / mv.name / f"{mv.version}-{what}"
    if (target / "config.json").is_file():  # renamed into place whole: present means complete
        return RegisteredExport(version_uri, target, mv.source)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{mv.version}-") as tmp,
          fluent_tracking_uri(tracking_uri)):
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
            fluent_tracking_uri(tracking_uri):
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

    client = client_of(tracking_uri)
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

    client = client_of(tracking_uri)
    with opening_store(tracking_uri):
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
