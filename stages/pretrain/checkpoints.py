"""The pretraining run's checkpoints: what one holds besides DeepSpeed's files, saving and reporting one, listing a
run's, and restoring the newest that verifies (`training.checkpoint_files` checks each).

Every `ckpt_interval` steps each worker saves its DeepSpeed shard into a rank-local directory and all of them report
one Ray Train checkpoint (model, optimizer, scheduler, data position). A lost worker: Ray Train restarts the group
and the loop resumes from `ray.train.get_checkpoint()`. A restart of the whole stage (same artifact id) finds the run
again by its name, and Ray Train reloads the run's checkpoint snapshot. Ray Train writes that snapshot in place: one
cut short by a driver killed mid-write is set aside (`set_aside_cut_short_snapshot`), and `restore` lists the run's
checkpoints itself.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages.pretrain.rank_zero import RankZero
from training import checkpoint_files
from training.checkpoint_files import STATE_FILE

SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train V2's record of a run's registered checkpoints, in the run's storage directory."""


def set_aside_cut_short_snapshot(directory: str) -> None:
    """Ray Train rewrites its snapshot in place at every checkpoint; a driver killed mid-write leaves it cut short,
    and Ray Train would then fail to start the run at every restart. Set aside, Ray Train registers nothing, and
    the loop's `restore` lists the run's checkpoints itself (the newest that verifies is taken)."""
    fs, path = checkpoint_files.storage_fs(directory)
    if checkpoint_files.set_aside_if_cut_short(fs, f"{path}/{SNAPSHOT}"):
        print(f"[pretrain] Ray Train's checkpoint snapshot {path}/{SNAPSHOT} is cut short (a driver killed while "
              f"writing it); set aside as {SNAPSHOT}{checkpoint_files.CUT_SHORT}, and the run resumes from the "
              f"newest of its checkpoints that verifies", flush=True)


@dataclass
class TrainState:
    """Step and data position, saved with every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tag: str = ""

    @classmethod
    def read(cls, directory: Path) -> "TrainState":
        return cls(**json.loads((Path(directory) / STATE_FILE).read_text()))


def save_and_report(engine, state: TrainState, metrics: dict[str, float], rank: int) -> None:
    """DeepSpeed checkpoint on every rank into a rank-local directory, then one collective Ray Train report."""
    import ray.train

    root = Path(tempfile.mkdtemp(prefix=f"ds-ckpt-rank{rank}-"))
    try:
        state.tag = f"step{state.step}"  # never "latest": that name is DeepSpeed's pointer file
        engine.ds.save_checkpoint(str(root), tag=state.tag, client_state={"train_state": asdict(state)})
        if rank == 0:
            (root / STATE_FILE).write_text(json.dumps(asdict(state)))
        checkpoint_files.write_file_list(root, rank)  # last: a checkpoint without it never finished
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(root)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def saved_step(fs, directory: str) -> int:
    """The step a checkpoint directory holds, from its state file (-1 when it has none: never finished)."""
    try:
        with fs.open_input_stream(f"{directory}/{STATE_FILE}") as f:
            return int(json.loads(f.read())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def checkpoints_in(fs, parent: str, below: int | None = None) -> list:
    """The finished checkpoints in a run's directory (those with a state file), newest step first (for a step
    saved twice, the newer directory first); with `below`, only those of earlier steps."""
    import pyarrow.fs as pafs
    import ray.train

    dirs = [i.path for i in fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
            if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")]
    steps = {d: saved_step(fs, d) for d in dirs}
    kept = [d for d in dirs if steps[d] >= 0 and (below is None or steps[d] < below)]
    return [ray.train.Checkpoint(d, filesystem=fs) for d in sorted(kept, key=lambda d: (steps[d], d), reverse=True)]


def run_checkpoints(latest, run_dir: str = "") -> list:
    """The run's checkpoints to try, newest first: the one Ray Train reports as latest, then those beside it that
    hold earlier steps. Directories of later steps that Ray Train never registered (its driver was lost during the
    upload) are left alone. With none registered (`latest` None), every finished one in `run_dir`."""
    if latest is None:
        return checkpoints_in(*checkpoint_files.storage_fs(run_dir)) if run_dir else []
    fs, parent = latest.filesystem, latest.path.rstrip("/").rsplit("/", 1)[0]
    return [latest, *checkpoints_in(fs, parent, below=saved_step(fs, latest.path))]


def restore(engine, rank0: RankZero, rank: int, world: int, run_dir: str = "") -> TrainState:
    """The newest checkpoint that verifies (after a worker failure, or a restart of the stage) -> engine + position;
    `rank0` says and logs what was taken and skipped.

    Each rank reads its own files' list (`training.checkpoint_files`) and the ranks agree: a checkpoint a lost node
    left half-written, or a shard a bad disk truncated, is skipped - said, and logged as `checkpoints_skipped` -
    for the one before it."""
    import ray.train
    import torch.distributed as dist

    candidates = run_checkpoints(ray.train.get_checkpoint(), run_dir)
    if not candidates:
        return TrainState()
    skipped: list[str] = []
    for ckpt in candidates:
        with ckpt.as_directory() as d:
            reasons: list[Any] = [None] * world
            dist.all_gather_object(reasons, checkpoint_files.problem(Path(d), world, range(rank, rank + 1)))
            found = [r for r in reasons if r is not None]
            if found:
                skipped.append(f"{ckpt.path}: {found[0]}")
                rank0.print(f"skipping checkpoint {ckpt.path}: {found[0]}")
                continue
            state = TrainState.read(Path(d))
            path, _ = engine.ds.load_checkpoint(d, tag=state.tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load checkpoint {state.tag} from {d}")
        rank0.print(f"restored {state.tag} from {ckpt.path}: resuming at step {state.step + 1}, "
                    f"epoch {state.epoch}, micro-batch {state.batch_in_epoch}")
        rank0.log({"restored_from_step": state.step, "checkpoints_skipped": len(skipped)}, step=state.step)
        return state
    raise RuntimeError("no checkpoint of this run verifies (" + "; ".join(skipped) + "); start over with "
                       "--force pretrain")
