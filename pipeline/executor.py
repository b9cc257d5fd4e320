"""Runs a plan: one MLflow child run per stage, artifacts written atomically, cached ones skipped."""

from __future__ import annotations

import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.artifacts import Artifact, ArtifactStore
from core.config import PipelineConfig, check_cluster
from core.lineage import TAG_STATUS, Lineage, Tracker
from pipeline.plan import PlannedStage


@dataclass
class Outcome:
    ok: bool = True
    artifacts: dict[str, tuple[str, str]] = field(default_factory=dict)
    """stage -> (artifact id, "ran" | "cached")."""
    summary: dict[str, str] = field(default_factory=dict)
    tracking_uri: str = ""
    parent_run_id: str = ""
    error: str = ""


def _input_refs(st: PlannedStage, store: ArtifactStore, objects: dict[str, Any]) -> dict[str, Any]:
    refs = {}
    for name, art_id in st.input_ids.items():
        refs[name] = objects[name] if name in objects else store.find(name, art_id)
        if refs[name] is None:
            raise RuntimeError(f"input {name}:{art_id} of stage {st.spec.name} is missing")
    return refs


def _lineage_inputs(refs: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """name -> (id, digest, source) for MLflow dataset inputs."""
    out = {}
    for name, ref in refs.items():
        if isinstance(ref, Artifact):
            out[name] = (ref.id, ref.digest, str(ref.path))
        else:
            ref_id = getattr(ref, "id", None) or name
            source = ",".join(getattr(ref, "patterns", ())) or str(getattr(ref, "source", name))
            out[name] = (ref_id, ref_id, source)
    return out


def _connect_ray(cfg: PipelineConfig, stages: list[str]) -> None:
    """Connect, then check the config against the live cluster (the one place CPUs and GPUs are checked).
    Raises ConfigError, which the entry point prints as one line."""
    from cluster.ray_init import cluster_cpus, cluster_gpus, connect

    print(connect(cfg.ray), flush=True)
    check_cluster(cfg, stages, cpus=cluster_cpus(), gpus=cluster_gpus())


def storage_path(cfg: PipelineConfig, workdir: Path) -> str:
    return cfg.ray.storage_path or str(workdir / "ray_results")


def discard_resumable_state(st: PlannedStage, store: ArtifactStore, storage: str) -> list[str]:
    """`--force STAGE`: drop what a re-run would otherwise resume from - the stage's scratch directory and its
    Ray Train / Tune runs (named `<stage>-<artifact id>...` under the Ray storage path). Returns what went."""
    import pyarrow.fs as pafs

    gone = []
    scratch = store.scratch_path(st.spec.name, st.artifact_id)
    if scratch.exists():
        shutil.rmtree(scratch)
        gone.append(str(scratch))
    fs, root = pafs.FileSystem.from_uri(storage) if "://" in storage else (pafs.LocalFileSystem(), storage)
    prefix = f"{st.spec.name}-{st.artifact_id}"
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith(prefix):
            fs.delete_dir(info.path)
            gone.append(info.path)
    return gone


def execute(cfg: PipelineConfig, plan: list[PlannedStage], objects: dict[str, Any],
            store: ArtifactStore, workdir: Path) -> Outcome:
    lineage = Lineage(workdir)
    parent = lineage.start(f"pipeline-{cfg.preset}", cfg.to_dict(), [s.spec.name for s in plan])
    outcome = Outcome(tracking_uri=lineage.tracking_uri, parent_run_id=parent.run_id)
    if any(not s.cached for s in plan):
        _connect_ray(cfg, [s.spec.name for s in plan if not s.cached])
    for st in plan:
        if st.forced:
            gone = discard_resumable_state(st, store, storage_path(cfg, workdir))
            print(f"[{st.spec.name}] --force: recomputing from scratch; discarded resumable state "
                  f"{', '.join(gone) if gone else '(none)'}", flush=True)
    ids = {name: obj.id for name, obj in objects.items() if hasattr(obj, "id")}
    for st in plan:
        refs = _input_refs(st, store, objects)
        ids[st.spec.name] = st.artifact_id
        tracker = lineage.stage_run(st.spec.name, st.artifact_id, st.config, _lineage_inputs(refs), st.cached)
        if st.cached:
            print(f"[{st.spec.name}] cached: artifact {st.artifact_id} exists, skipping", flush=True)
            tracker.end()
            outcome.artifacts[st.spec.name] = (st.artifact_id, "cached")
            continue
        if not _run_stage(cfg, st, refs, store, workdir, tracker, dict(ids), outcome):
            parent.end("FAILED")
            return outcome
    parent.end()
    return outcome


def _run_stage(cfg: PipelineConfig, st: PlannedStage, refs: dict[str, Any], store: ArtifactStore,
               workdir: Path, tracker: Tracker, lineage_ids: dict[str, str], outcome: Outcome) -> bool:
    from core.errors import StageInputError
    from stages.base import StageContext

    sections = [getattr(cfg, s) for s in st.spec.sections]
    ctx = StageContext(
        stage=st.spec.name, artifact_id=st.artifact_id, workdir=workdir,
        scratch=store.scratch(st.spec.name, st.artifact_id), storage_path=storage_path(cfg, workdir),
        tracker=tracker, lineage=lineage_ids, preset=cfg.preset)
    manifest = {"stage": st.spec.name, "id": st.artifact_id, "version": st.spec.version,
                "config": st.config, "inputs": st.input_ids}
    print(f"[{st.spec.name}] running -> {store.path(st.spec.name, st.artifact_id)}", flush=True)
    started = time.time()
    try:
        with store.building(st.spec.name, st.artifact_id, manifest) as out:
            result = st.spec.run(sections[0], **dict(zip(st.spec.sections[1:], sections[1:])),
                                 inputs=refs, out=out, ctx=ctx)
            manifest["counts"] = dict(result.counts)
            for rel in result.log_files:
                tracker.log_artifact(out / rel)
    except StageInputError as e:
        return _fail(st, tracker, outcome, str(e))
    except Exception as e:  # noqa: BLE001  (a stage crash: keep the traceback, end the runs FAILED)
        traceback.print_exc()
        return _fail(st, tracker, outcome, f"{type(e).__name__}: {e}")
    elapsed = time.time() - started
    tracker.log_metrics({**result.metrics, "stage_seconds": elapsed})
    tracker.set_tags({TAG_STATUS: "finished", **{f"pipeline.count.{k}": v for k, v in result.counts.items()}})
    tracker.end()
    outcome.artifacts[st.spec.name] = (st.artifact_id, "ran")
    outcome.summary.update(result.summary)
    print(f"[{st.spec.name}] done in {elapsed:.0f}s: artifact {st.artifact_id}", flush=True)
    return True


def _fail(st: PlannedStage, tracker: Tracker, outcome: Outcome, message: str) -> bool:
    print(f"error: stage {st.spec.name} failed: {message}", file=sys.stderr, flush=True)
    tracker.set_tags({TAG_STATUS: "failed", "pipeline.error": message[:5000]})
    tracker.end("FAILED")
    outcome.ok, outcome.error = False, message
    return False


def print_summary(outcome: Outcome, workdir: Path, seconds: float) -> None:
    print("\n=== summary ===")
    print(f"status: {'succeeded' if outcome.ok else 'FAILED: ' + outcome.error} in {seconds / 60:.1f} min")
    for stage, (art_id, how) in outcome.artifacts.items():
        print(f"  {stage:<9} {art_id}  ({how})  {workdir / 'artifacts' / stage / art_id}")
    for key, value in outcome.summary.items():
        print(f"  {key}: {value}")
    print(f"MLflow: {outcome.tracking_uri} (parent run {outcome.parent_run_id})")
    if outcome.tracking_uri.startswith("sqlite"):
        print(f"  open the UI: mlflow ui --backend-store-uri {outcome.tracking_uri} --host 127.0.0.1 --port 5000")
    else:
        print(f"  open the UI: {outcome.tracking_uri}")
