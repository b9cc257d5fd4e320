"""Checkpoints that can be checked before they are trusted.

A DeepSpeed checkpoint reported to Ray Train is the union of every rank's directory (each rank saves its own
optimizer shard; Ray Train copies them all into one storage directory). A node lost mid-copy or a bad disk
leaves a directory that looks whole and fails deep inside `torch.load`. So each rank, after its save, writes
`_files.rank<R>.json` LAST: every file it wrote with its size and xxh3-64 digest. A checkpoint verifies when
all `world` rank lists are present and every file they name exists with that size and digest.

Ray's own resume records are checked too. Ray Train's checkpoint-manager snapshot and Tune's experiment state are
written to the storage path in place (`pyarrow.fs` output streams), not by a rename, so a process killed while
writing one leaves it cut short; `set_aside_if_cut_short` moves such a file out of the way before a restore.

Digests, not only sizes: a flipped byte keeps the size. xxh3 reads at memory speed, so checking costs one
read of the checkpoint (what loading it costs anyway). Resume (`stages.pretrain.checkpoints.restore`) walks the
run's checkpoints newest first and takes the first that verifies, naming each one it skips and why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from core import storage
from core.artifacts import file_digest

CUT_SHORT = ".cut-short"
"""Suffix of a resume record set aside because it does not parse (nothing is deleted)."""
LIST_PREFIX = "_files.rank"
STATE_FILE = "train_state.json"
"""The loop's own record of step and data position (written by rank 0 beside DeepSpeed's files)."""


def _digest(path: Path) -> str:
    return file_digest(path, xxhash.xxh3_64)


def write_file_list(directory: Path, rank: int) -> None:
    """Record every file under `directory` (this rank's part of a checkpoint), then the list itself, last."""
    directory = Path(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and not p.name.startswith(LIST_PREFIX):
            files[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "xxh3": _digest(p)}
    tmp = directory / f".{LIST_PREFIX}{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "files": files}, sort_keys=True))
    os.replace(tmp, directory / f"{LIST_PREFIX}{rank}.json")


def problem(directory: Path, world: int, ranks: range | None = None) -> str | None:
    """None when the checkpoint verifies; otherwise what is wrong, naming the file.

    Every rank's list must be there; the files of `ranks`' lists are read (default: all), so `world` resuming
    workers can split the reading (each its own: `range(rank, rank + 1)`) and agree by an all-reduce."""
    directory = Path(directory)
    for rank in range(world):
        listing = directory / f"{LIST_PREFIX}{rank}.json"
        if not listing.is_file():
            return f"{listing.name} is missing (rank {rank} never finished writing this checkpoint)"
    for rank in ranks if ranks is not None else range(world):
        listing = directory / f"{LIST_PREFIX}{rank}.json"
        try:
            files = json.loads(listing.read_text())["files"]
        except (ValueError, KeyError) as e:
            return f"{listing.name} is unreadable ({e})"
        for rel, want in files.items():
            path = directory / rel
            if not path.is_file():
                return f"{rel} is missing"
            size = path.stat().st_size
            if size != want["bytes"]:
                return f"{rel} has {size:,} bytes, {want['bytes']:,} were written"
            if _digest(path) != want["xxh3"]:
                return f"{rel} does not match its digest (same size, different bytes)"
    return None


storage_fs = storage.filesystem
"""(pyarrow filesystem, path) of a storage location as Ray Train and Tune take it: a local path or a URI."""


def move_dir(fs, src: str, dst: str) -> None:
    """`fs.move` for a directory: a rename on disk; in an object store, which has no directories to rename (pyarrow's
    S3 move takes one object and answers NoSuchKey for a prefix), every object copied, then the source deleted."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        fs.move(src, dst)
        return
    pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=fs)
    fs.delete_dir(src)


def set_aside_if_cut_short(fs, path: str) -> bool:
    """A JSON resume record that does not parse (its writer was killed mid-write) is renamed to `<path>.cut-short`
    and True returned; a whole or absent one is left as it is."""
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type != pafs.FileType.File:
        return False
    with fs.open_input_stream(path) as f:
        data = f.readall()
    try:
        json.loads(data)
        return False
    except ValueError:
        fs.move(path, path + CUT_SHORT)
        return True
