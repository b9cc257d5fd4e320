"""Runs a plan: one MLflow child run per stage, artifacts written atomically, cached ones skipped.

Runs sharing a workdir: `claim` locks every artifact the plan builds before anything is written (core/locks.py says
why per artifact), refuses when another live run builds one of them, rebuilds (`--force`) one this run reads or reads
one this run rebuilds, and removes the build directories dead runs left behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from core import locks
from core import storage
from core.storage import filesystem
from core.artifacts import Artifact, ArtifactStore, is_disk_full, watching_writes
from core.config import ConfigError, PipelineConfig, check_cluster
from core.lineage import TAG_STATUS, Lineage, Tracker
from pipeline import suite
from pipeline.plan import PlannedStage


class RunConflict(Exception):
    """Another live run owns what this one would build, rebuild or read; printed as one `error:` line, exit 2."""


@dataclass
class Outcome:
    ok: bool = True
    artifacts: dict[str, tuple[str, str]] = field(default_factory=dict)
    """stage -> (artifact id, "ran" | "cached")."""
    summary: dict[str, str] = field(default_factory=dict)
    tracking_uri: str = ""
    parent_run_id: str = ""
    error: str = ""
    failed: dict[str, str] = field(default_factory=dict)
    """stage (`finetune:<task>` for a task of several) -> its error."""
    table: str = ""
    """The fine-tuned tasks' row (pipeline/suite.py), as text."""


def _input_refs(st: PlannedStage, store: ArtifactStore, objects: dict[str, Any]) -> dict[str, Any]:
    refs = {}
    for name, art_id in st.input_ids.items():
        key = st.object_key(name)
        refs[name] = objects[key] if key in objects else store.find(name, art_id, fetching=not st.cached)
        if refs[name] is None:
            raise RuntimeError(f"input {name}:{art_id} of stage {st.name} is missing")
    return refs


def _lineage_inputs(refs: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """name -> (id, digest, source) for MLflow dataset inputs."""
    out = {}
    for name, ref in refs.items():
        if isinstance(ref, Artifact):
            out[name] = (ref.id, ref.digest, ref.uri or str(ref.path))
        else:
            ref_id = getattr(ref, "id", None) or name
            source = ",".join(getattr(ref, "patterns", ())) or str(getattr(ref, "source", name))
            out[name] = (ref_id, ref_id, source)
    return out


@dataclass(frozen=True)
class ClusterFit:
    """What the Ray cluster this run would use is known to lack, before Ray starts."""

    line: str
    """The plan's line about the cluster (`--dry-run` prints it)."""
    lacks: str = ""
    """Empty, or what is missing and the fix (a real run refuses with it before starting Ray)."""
    size: tuple[int, int] | None = None
    """(CPUs, GPUs) of that cluster; None for one joined later (RAY_ADDRESS)."""


def local_gpus() -> int:
    """GPUs a local Ray started here would see (Ray's own detection: NVML, CUDA_VISIBLE_DEVICES), without Ray."""
    from ray._private.accelerators import get_accelerator_manager_for_resource

    manager = get_accelerator_manager_for_resource("GPU")
    visible = manager.get_current_process_visible_accelerator_ids()
    count = manager.get_current_node_num_accelerators()
    return count if visible is None else min(count, len(visible))


def cluster_fit(cfg: PipelineConfig, stages: list[str]) -> ClusterFit:
    """What the cluster lacks (`ray_fit`) and, for a GPU pretraining run, whether its memory plan fits one GPU
    (`gpu_memory_fit`): both before Ray starts."""
    fit, memory = ray_fit(cfg, stages), gpu_memory_fit(cfg, stages)
    if not memory.line:
        return fit
    lacks = "; ".join(x for x in (fit.lacks, memory.lacks) if x)
    return ClusterFit(f"{fit.line}\n{memory.line}", lacks, fit.size)


def gpu_memory_fit(cfg: PipelineConfig, stages: list[str]) -> ClusterFit:
    """A GPU pretraining run against one GPU's memory (`pretrain.gpu_memory_gb`, else this machine's GPU): the
    memory plan of `stages.pretrain.estimates`; nothing to say when neither names a memory."""
    p = cfg.pretrain
    if "pretrain" not in stages or not p.use_gpu:
        return ClusterFit("")
    from stages.pretrain.estimates import GB, gpu_memory_bytes, memory_lacks

    memory = gpu_memory_bytes(p)
    if memory is None:
        return ClusterFit("memory: no GPU here and no pretrain.gpu_memory_gb: the plan's fit to a GPU is not checked")
    lacks = memory_lacks(p, cfg.model, cfg.tokenize.max_seq_len, memory)
    verdict = f"it does not fit: {lacks}" if lacks else "the pretraining plan fits it"
    return ClusterFit(f"memory: {memory / GB:.3g} GB per GPU; {verdict}", lacks)


def ray_fit(cfg: PipelineConfig, stages: list[str]) -> ClusterFit:
    """`check_cluster` against the local Ray this run would start (ray.num_cpus or this machine's CPUs, its GPUs),
    before anything starts; a cluster the run joins (RAY_ADDRESS, `ray job submit`) is checked once joined."""
    import os

    import ray

    if ray.is_initialized():  # the Ray this process already joined: checked against it now
        from cluster.ray_init import cluster_cpus, cluster_gpus

        cpus, gpus, where = cluster_cpus(), cluster_gpus(), "the Ray this process joined"
        line = f"cluster: {where}: {cpus} CPUs, {gpus} GPUs"
    elif os.environ.get("RAY_ADDRESS"):
        return ClusterFit(f"cluster: joining {os.environ['RAY_ADDRESS']}; its CPUs and GPUs are checked once joined")
    else:
        cpus, gpus, where = cfg.ray.num_cpus or os.cpu_count() or 1, local_gpus(), "a local Ray on this machine"
        line = f"cluster: {where}: {cpus} CPUs{' (ray.num_cpus)' if cfg.ray.num_cpus else ''}, {gpus} GPUs"
    try:
        check_cluster(cfg, stages, cpus=cpus, gpus=gpus)
    except ConfigError as e:
        lacks = f"{e} ({where}; to use a GPU cluster, run under `ray job submit` or set RAY_ADDRESS)"
        return ClusterFit(f"{line}; it lacks what this plan needs: {lacks}", lacks, (cpus, gpus))
    return ClusterFit(line, size=(cpus, gpus))


def _connect_ray(cfg: PipelineConfig, runs: list[PlannedStage], store: ArtifactStore) -> None:
    """Connect, then check the config against the live cluster (the one place CPUs and GPUs are checked), and that
    every node reaches the local side of an object-store workdir when a stage's tasks need it (`_check_local_dir`).
    Raises ConfigError, which the entry point prints as one line."""
    from cluster.ray_init import cluster_cpus, cluster_gpus, connect

    print(connect(cfg.ray), flush=True)
    check_cluster(cfg, [s.spec.name for s in runs], cpus=cluster_cpus(), gpus=cluster_gpus())
    _check_local_dir(store, [s.spec.name for s in runs if s.spec.tasks_use_paths])


def _check_local_dir(store: ArtifactStore, stages: list[str]) -> None:
    """With an object-store workdir the build area and the copies of inputs are on this machine's `--local-dir`.
    The stages whose Ray tasks read their inputs and write their output there by path need it on every node of
    the cluster (a shared file system): checked with a file written here and looked for on each node."""
    from cluster.ray_init import nodes_not_seeing

    if store.remote is None or not stages:
        return
    store.root.mkdir(parents=True, exist_ok=True)
    probe = store.root / f".node-probe-{uuid.uuid4().hex[:8]}"
    probe.write_text("")
    try:
        blind = nodes_not_seeing(str(probe))
    finally:
        probe.unlink()
    if blind:
        raise ConfigError(f"stage {', '.join(stages)} reads and writes by path from Ray tasks on every node, and "
                          f"--local-dir {store.root.parent} is not on node {', '.join(blind)}; with a workdir in "
                          f"object storage give a --local-dir that every node mounts (NFS), or build those stages "
                          f"on one node (--until tokenize) and pretrain on the cluster")


def storage_path(cfg: PipelineConfig, store: ArtifactStore) -> str:
    """`ray.storage_path`, else `ray_results` in the workdir (in the bucket when the workdir is one)."""
    return cfg.ray.storage_path or storage.join(store.workdir, "ray_results")


def discard_resumable_state(st: PlannedStage, store: ArtifactStore, storage: str) -> list[str]:
    """`--force STAGE`: drop what a re-run would otherwise resume from - the stage's scratch directory and its
    Ray Train / Tune runs (named `<stage>-<artifact id>...` under the Ray storage path). Returns what went."""
    import pyarrow.fs as pafs

    gone = []
    scratch = store.scratch_path(st.spec.name, st.artifact_id)
    if scratch.exists():
        shutil.rmtree(scratch)
        gone.append(str(scratch))
    fs, root = filesystem(storage)
    prefix = f"{st.spec.name}-{st.artifact_id}"
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith(prefix):
            fs.delete_dir(info.path)
            gone.append(info.path)
    return gone


def _lock_path(workdir: Path, stage: str, art_id: str) -> Path:
    return workdir / "locks" / f"{stage}-{art_id}.lock"


@contextlib.contextmanager
def claim(plan: list[PlannedStage], store: ArtifactStore, workdir: Path,
          take_foreign: bool = False) -> Iterator[None]:
    """Hold the locks of every artifact the plan builds for the block's duration (RunConflict if another live run
    holds one), then remove the leftovers of dead runs: build directories and lock files. Each takeover and removal
    is said in one line."""
    planned = {st.spec.name for st in plan}
    builds = [st for st in plan if st.selected and not st.cached]
    held: list[locks.Lock] = []
    try:
        for st in builds:
            reads = tuple(f"{name}/{art_id}" for name, art_id in st.input_ids.items() if name in planned)
            try:
                held.append(locks.acquire(_lock_path(workdir, st.spec.name, st.artifact_id), reads, take_foreign))
            except locks.LockHeld as e:
                raise RunConflict(f"artifact {st.spec.name}/{st.artifact_id} is being built by another run: {e}; "
                                  f"wait for it, or plan something else") from None
        _check_readers(builds, workdir)
        notes = [lock.takeover_note() for lock in held if lock.takeover_note()]
        notes += _remove_leftovers(store, workdir, {lock.path for lock in held})
        notes += locks.remove_stale(workdir / "locks")  # e.g. of the stages a killed run had finished
        for note in notes:
            print(note, flush=True)
        yield
    finally:
        for lock in held:
            lock.release()


def _check_readers(builds: list[PlannedStage], workdir: Path) -> None:
    """No finished artifact this run reads is being rebuilt by another live run, and none this run rebuilds
    (`--force`) is being read by one: its lock lists what it reads."""
    others = {p: h for p, h in locks.holders(workdir / "locks").items() if not h.is_mine()}
    for st in builds:
        for name, art_id in st.input_ids.items():
            path = _lock_path(workdir, name, art_id)
            if path in others:
                raise RunConflict(f"stage {st.spec.name} reads artifact {name}/{art_id}, which another run is "
                                  f"rebuilding: {others[path].describe()} holds {path}; wait for it")
        if st.forced:
            for path, holder in others.items():
                if f"{st.spec.name}/{st.artifact_id}" in holder.reads:
                    raise RunConflict(f"--force {st.spec.name}: artifact {st.spec.name}/{st.artifact_id} is being "
                                      f"read by {holder.describe()} ({path}); wait for that run to finish")


def _remove_leftovers(store: ArtifactStore, workdir: Path, held: set[Path]) -> list[str]:
    """Remove the build directories (and replaced artifacts) whose artifact no live run is building: each one's lock
    is held by this run already or taken for the removal."""
    removed, notes = [], []
    for stage, art_id, path in store.leftovers():
        lock_path = _lock_path(workdir, stage, art_id)
        if lock_path in held:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        try:
            lock = locks.acquire(lock_path)
        except locks.LockHeld:
            continue  # a live run is building it: its own directory
        try:
            if lock.takeover_note():
                notes.append(lock.takeover_note())
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            lock.release()
    if removed:
        notes.append(f"removed {len(removed)} leftover build director{'y' if len(removed) == 1 else 'ies'} of dead "
                     f"runs: {', '.join(str(p) for p in removed)}")
    return notes


def verify_inputs(plan: list[PlannedStage], store: ArtifactStore, digests: bool) -> None:
    """Check every finished artifact the plan reuses against its manifest (core.artifacts.verify): sizes always,
    SHA-256 digests with `digests` (`--verify`). StageInputError naming the file and `--force STAGE`."""
    for st in plan:
        if st.cached:
            store.verify(st.spec.name, st.artifact_id, digests)


def execute(cfg: PipelineConfig, plan: list[PlannedStage], objects: dict[str, Any],
            store: ArtifactStore, workdir: Path) -> Outcome:
    # The tracking store is opened (on a new workdir: its schema created, ~1 s) while Ray starts, both mostly
    # waiting on other processes; no MLflow run exists before Ray is up, so a cluster too small leaves none behind.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        opening = pool.submit(Lineage, workdir)
        if any(not s.cached for s in plan):
            _connect_ray(cfg, [s for s in plan if not s.cached], store)
        lineage = opening.result()
    parent = lineage.start(f"pipeline-{cfg.preset}", cfg.to_dict(), [s.spec.name for s in plan])
    outcome = Outcome(tracking_uri=lineage.tracking_uri, parent_run_id=parent.run_id)
    for st in plan:
        if st.forced:
            gone = discard_resumable_state(st, store, storage_path(cfg, store))
            print(f"[{st.name}] --force: recomputing from scratch; discarded resumable state "
                  f"{', '.join(gone) if gone else '(none)'}", flush=True)
    ids = {name: obj.id for name, obj in objects.items() if hasattr(obj, "id")}
    failed: set[str] = set()
    for group in _groups(plan):
        group = [st for st in group if not failed & set(st.input_ids)]  # an input failed: nothing to build it from
        for st in group:
            if st.cached:
                tracker = lineage.stage_run(st.spec.name, st.artifact_id, st.config,
                                            _lineage_inputs(_input_refs(st, store, objects)), True)
                print(f"[{st.name}] cached: artifact {st.artifact_id} exists, skipping", flush=True)
                tracker.end()
                outcome.artifacts[st.name] = (st.artifact_id, "cached")
            ids[st.spec.name] = st.artifact_id
        builds = [st for st in group if not st.cached]
        build = functools.partial(_build, cfg, store=store, workdir=workdir, objects=objects, lineage=lineage,
                                  ids=dict(ids), outcome=outcome)
        # what does not read a failed stage still runs: the other tasks of a suite are independent of a failed one
        failed |= {st.spec.name for st, ok in zip(builds, _side_by_side(cfg, builds, build)) if not ok}
    _in_plan_order(outcome, plan)
    try:
        with tempfile.TemporaryDirectory(prefix="suite-") as scratch:  # logged on the parent run, nothing kept here
            outcome.table = suite.report(plan, objects, store, parent, cfg.preset, outcome, Path(scratch))
    except Exception as e:  # noqa: BLE001  (the stages' outcome stands: the table's absence is said in one line)
        print(f"warning: the fine-tuned tasks' table was not made: {type(e).__name__}: {e}", file=sys.stderr)
    if not failed:
        parent.end()
        return outcome
    with contextlib.suppress(Exception):  # _fail said it already if the store cannot be written
        parent.end("FAILED")
    return outcome


def _build(cfg: PipelineConfig, st: PlannedStage, *, store: ArtifactStore, workdir: Path, objects: dict[str, Any],
           lineage: Lineage, ids: dict[str, str], outcome: Outcome) -> bool:
    """Open the stage's MLflow run and build its artifact (`_run_stage`); `ids`: the upstream artifacts' ids."""
    refs = _input_refs(st, store, objects)
    tracker = lineage.stage_run(st.spec.name, st.artifact_id, st.config, _lineage_inputs(refs), False)
    return _run_stage(cfg, st, refs, store, workdir, tracker, {**ids, st.spec.name: st.artifact_id}, outcome)


def _groups(plan: list[PlannedStage]) -> list[list[PlannedStage]]:
    """The plan in order, the instances of one stage planned once per task (`one_of_several`) as one group."""
    groups: list[list[PlannedStage]] = []
    for st in plan:
        if st.one_of_several and groups and groups[-1][0].one_of_several and groups[-1][0].spec is st.spec:
            groups[-1].append(st)
        else:
            groups.append([st])
    return groups


def _side_by_side(cfg: PipelineConfig, builds: list[PlannedStage], build) -> list[bool]:
    """`build` each instance, in this thread one after another, or - several instances of a stage that has
    `side_by_side` - in threads, as many at once as it says the cluster holds. Returns each one's success.

    Ctrl+C reaches the main thread only, and a Tune run in another thread installs no handler of its own: the run
    then ends at once, as a killed driver does, and the next run resumes each unfinished instance (its locks are
    taken over, its Tune experiment restored)."""
    spec = builds[0].spec if builds else None
    if len(builds) < 2 or spec.side_by_side is None:
        return [build(st) for st in builds]
    from cluster.ray_init import cluster_cpus, cluster_gpus

    cpus, gpus = cluster_cpus(), cluster_gpus()
    at_once = min(len(builds), spec.side_by_side(getattr(cfg, spec.sections[0]), cpus=cpus, gpus=gpus))
    if at_once < 2:
        return [build(st) for st in builds]
    print(f"[{spec.name}] {len(builds)} to build, {at_once} at once on the cluster's {cpus} CPUs and {gpus} GPUs: "
          f"{', '.join(st.name for st in builds)}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(at_once, thread_name_prefix=spec.name) as pool:
        futures = [pool.submit(build, st) for st in builds]
        try:
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            print(f"\ninterrupted: {spec.name} stopped at once (its threads cannot be interrupted); the next run "
                  f"resumes what did not finish", file=sys.stderr, flush=True)
            os._exit(130)


def _in_plan_order(outcome: Outcome, plan: list[PlannedStage]) -> None:
    """The outcome's artifacts and summary lines in plan order (instances built side by side finish in any order)."""
    order = {st.name: i for i, st in enumerate(plan)}
    outcome.artifacts = dict(sorted(outcome.artifacts.items(), key=lambda kv: order.get(kv[0], -1)))
    tasks = {st.task: i for i, st in enumerate(plan) if st.one_of_several}  # a task's summary line: `<key>:<task>`
    outcome.summary = dict(sorted(outcome.summary.items(), key=lambda kv: tasks.get(kv[0].partition(":")[2], -1)))


_OUTCOME = threading.Lock()
"""Stages built side by side (`_side_by_side`) record their outcome from their threads."""


def _run_stage(cfg: PipelineConfig, st: PlannedStage, refs: dict[str, Any], store: ArtifactStore,
               workdir: Path, tracker: Tracker, lineage_ids: dict[str, str], outcome: Outcome) -> bool:
    from core.errors import StageInputError
    from stages.base import StageContext

    sections = [getattr(cfg, s) for s in st.spec.sections]
    ctx = StageContext(
        stage=st.spec.name, artifact_id=st.artifact_id, workdir=workdir,
        scratch=store.scratch(st.spec.name, st.artifact_id), storage_path=storage_path(cfg, store),
        tracker=tracker, lineage=lineage_ids, preset=cfg.preset)
    manifest = {"stage": st.spec.name, "id": st.artifact_id, "version": st.spec.version,
                "config": st.config, "inputs": st.input_ids}
    print(f"[{st.name}] running -> {store.location(st.spec.name, st.artifact_id)}", flush=True)
    started = time.time()
    out = None
    try:
        with watching_writes(workdir) as last_written, \
                store.building(st.spec.name, st.artifact_id, manifest, replace=st.forced) as out:
            result = st.spec.run(sections[0], **dict(zip(st.spec.sections[1:], sections[1:])),
                                 inputs=refs, out=out, ctx=ctx)
            manifest["counts"] = dict(result.counts)
            for rel in result.log_files:
                tracker.log_artifact(out / rel)
    except StageInputError as e:
        return _fail(st, tracker, outcome, str(e))
    except Exception as e:  # noqa: BLE001  (a stage crash: keep the traceback, end the runs FAILED)
        if is_disk_full(e):  # the user's to fix, and nothing was lost: one line naming the file
            path = getattr(e, "filename", None) or last_written() or f"{out or store.path(st.spec.name, '')}/"
            return _fail(st, tracker, outcome, f"no space left on device writing {path}; free space there and "
                                               f"re-run: finished stages are reused")
        traceback.print_exc()
        return _fail(st, tracker, outcome, f"{type(e).__name__}: {e}")
    elapsed = time.time() - started
    tracker.log_metrics({**result.metrics, "stage_seconds": elapsed})
    tracker.set_tags({TAG_STATUS: "finished", **{f"pipeline.count.{k}": v for k, v in result.counts.items()}})
    tracker.end()
    with _OUTCOME:
        outcome.artifacts[st.name] = (st.artifact_id, "ran")
        outcome.summary.update({f"{k}:{st.task}" if st.one_of_several else k: v for k, v in result.summary.items()})
    print(f"[{st.name}] done in {elapsed:.0f}s: artifact {st.artifact_id}", flush=True)
    return True


def _fail(st: PlannedStage, tracker: Tracker, outcome: Outcome, message: str) -> bool:
    try:
        tracker.set_tags({TAG_STATUS: "failed", "pipeline.error": message[:5000]})
        tracker.end("FAILED")
    except Exception as e:  # noqa: BLE001  (a full disk may hold the store too: the stage's error comes first)
        message += f" (its MLflow run could not be marked failed: {type(e).__name__}: {str(e)[:200]})"
    print(f"error: stage {st.name} failed: {message}", file=sys.stderr, flush=True)
    with _OUTCOME:
        outcome.ok = False
        outcome.failed[st.name] = message
        named = "; ".join(f"{name}: {m}" for name, m in outcome.failed.items())  # which task of a suite failed
        outcome.error = (named if st.one_of_several else message) if len(outcome.failed) == 1 else \
            f"{len(outcome.failed)} stages failed: {named}"
    return False


def print_summary(outcome: Outcome, store: ArtifactStore, seconds: float) -> None:
    print("\n=== summary ===")
    print(f"status: {'succeeded' if outcome.ok else 'FAILED: ' + outcome.error} in {seconds / 60:.1f} min")
    for stage, (art_id, how) in outcome.artifacts.items():
        print(f"  {stage:<9} {art_id}  ({how})  {store.location(stage.partition(':')[0], art_id)}")
    for key, value in outcome.summary.items():
        print(f"  {key}: {value}")
    if outcome.table:
        print(f"fine-tuned tasks (DeBERTa Table 2's row; {suite.TABLE_FILE} and {suite.PLOT_FILE} on the run):")
        print("\n".join(f"  {line}" for line in outcome.table.splitlines()))
    print(f"MLflow: {outcome.tracking_uri} (parent run {outcome.parent_run_id})")
    if outcome.tracking_uri.startswith("sqlite"):
        print(f"  open the UI: mlflow ui --backend-store-uri {outcome.tracking_uri} --host 127.0.0.1 --port 5000")
    else:
        print(f"  open the UI: {outcome.tracking_uri}")
