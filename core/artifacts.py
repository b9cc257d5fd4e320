"""Content-addressed stage artifacts.

An artifact lives at `workdir/artifacts/<stage>/<id>/`, where `<id>` is a hash of
(stage name, stage version, the stage's config sections, its inputs' ids). It is built in a
temporary sibling directory and renamed into place only after `manifest.json` and the
success marker `_SUCCESS` (written last) are there, so a partial artifact is never visible
and a finished one is never recomputed. A finished artifact is never deleted in place either: if the same
artifact appeared while ours was being built, ours is dropped and theirs kept; a `--force` rebuild moves the old one
aside before the new one takes its name. Which run may build what is `core.locks`' business.

Checking: `verify` compares a finished artifact with its manifest - sizes always (a stat per file), SHA-256
digests on demand: hashing reads every byte (`bench.artifact_check` measures it against the stages' times), which at
hundreds of GB on shared storage is minutes per consuming stage, and the common damage (a copy or a write cut short)
already shows in the size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from core.errors import StageInputError

SUCCESS = "_SUCCESS"
MANIFEST = "manifest.json"
ID_LENGTH = 16
BUILDING, REPLACED = ".tmp-", ".old-"
"""Prefixes of a build in progress and of a finished artifact a `--force` rebuild replaced: `<prefix><id>-<hex>`."""
HASH_THREADS = max(2, os.cpu_count() or 1)  # files hashed at once when an artifact is finished


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal configs hash equally."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(stage: str, version: str, config: Any, input_ids: dict[str, str]) -> str:
    """Hash of everything that determines a stage's output; any change gives a new id."""
    payload = canonical_json({"stage": stage, "version": version, "config": config, "inputs": input_ids})
    return hashlib.sha256(payload.encode()).hexdigest()[:ID_LENGTH]


def file_digest(path: Path, new: Callable[[], Any] = hashlib.sha256, chunk: int = 1 << 20) -> str:
    """Hex digest of a file's bytes, read in chunks; `new` makes the hash object (SHA-256, or e.g. xxh3)."""
    h = new()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def code_version() -> str:
    """The git commit of the pipeline's code (with "+dirty" for uncommitted changes), or "unknown"."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if rev.returncode != 0:
        return "unknown"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@dataclass(frozen=True)
class Artifact:
    """A finished artifact: what downstream stages receive as an input reference."""

    stage: str
    id: str
    path: Path

    @property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())

    @property
    def digest(self) -> str:
        """One digest over the manifest's file digests: what MLflow records as the dataset digest."""
        files = self.manifest.get("files", {})
        payload = canonical_json({k: v["sha256"] for k, v in files.items()})
        return hashlib.sha256(payload.encode()).hexdigest()[:ID_LENGTH]


class ArtifactStore:
    """Derives artifact paths under a workdir and writes artifacts atomically."""

    def __init__(self, workdir: Path):
        self.root = Path(workdir) / "artifacts"

    def path(self, stage: str, art_id: str) -> Path:
        return self.root / stage / art_id

    def find(self, stage: str, art_id: str) -> Artifact | None:
        """The finished artifact, or None when it was never completed."""
        path = self.path(stage, art_id)
        if (path / SUCCESS).is_file() and (path / MANIFEST).is_file():
            return Artifact(stage, art_id, path)
        return None

    def scratch_path(self, stage: str, art_id: str) -> Path:
        return Path(self.root).parent / "scratch" / stage / art_id

    def scratch(self, stage: str, art_id: str) -> Path:
        """A persistent per-artifact work area (e.g. training checkpoints) that survives failed attempts."""
        path = self.scratch_path(stage, art_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def building(self, stage: str, art_id: str, manifest: dict[str, Any], replace: bool = False) -> Iterator[Path]:
        """Yield a temp dir to write into; on success add manifest + marker and rename into place.

        On any exception the temp dir is removed and nothing appears at the final path. A finished artifact already
        at the final path is kept (ours is dropped) unless `replace` (`--force`): then it is moved aside first.
        """
        final = self.path(stage, art_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{BUILDING}{art_id}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            yield tmp
            _finish(tmp, manifest)
            _publish(tmp, final, replace)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def leftovers(self) -> list[tuple[str, str, Path]]:
        """(stage, artifact id, path) of every build directory and replaced artifact still on disk: a run's own
        while it builds, else debris of a run that died (whoever holds the artifact's lock may remove it)."""
        out = []
        for p in sorted(self.root.glob(f"*/{BUILDING}*")) + sorted(self.root.glob(f"*/{REPLACED}*")):
            prefix = BUILDING if p.name.startswith(BUILDING) else REPLACED
            out.append((p.parent.name, p.name.removeprefix(prefix).rpartition("-")[0], p))
        return out


def _publish(tmp: Path, final: Path, replace: bool) -> None:
    """Rename the finished build into place without ever deleting a finished artifact at the final path in place."""
    if (final / SUCCESS).is_file() and not replace:
        shutil.rmtree(tmp)  # another run finished the same artifact meanwhile: a reader may hold theirs
        return
    if final.exists():  # the artifact --force replaces, or an incomplete directory someone put there
        aside = final.parent / f"{REPLACED}{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)


def verify(art: Artifact, digests: bool = False) -> None:
    """Check a finished artifact against its manifest: every file present with its size, and with `digests` its
    SHA-256 too. StageInputError naming the first file that differs and the fix."""
    fix = f"rebuild it with --force {art.stage}"
    try:
        files = art.manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        raise StageInputError(f"artifact {art.path}: its {MANIFEST} is unreadable ({e}); {fix}") from None
    for rel, entry in files.items():
        path = art.path / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StageInputError(f"artifact {art.stage}/{art.id}: {path} is missing; {fix}") from None
        if size != entry["bytes"]:
            raise StageInputError(f"artifact {art.stage}/{art.id}: {path} has {size} bytes, its manifest says "
                                  f"{entry['bytes']} (truncated or overwritten); {fix}")
        if digests and file_digest(path) != entry["sha256"]:
            raise StageInputError(f"artifact {art.stage}/{art.id}: {path} does not match its manifest's sha256 "
                                  f"(changed since it was written); {fix}")


# ----------------------------------------------------------------------------------------------- disk full

def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception's chain (Ray and pyarrow wrap the OSError, some only in text)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_WRITES: dict[str, Any] = {"root": None, "last": None, "hooked": False}


def _audit(event: str, args: tuple) -> None:
    if event != "open" or _WRITES["root"] is None:
        return
    path, _, flags = args
    if isinstance(path, (str, bytes, os.PathLike)) and flags & (os.O_WRONLY | os.O_RDWR):
        path = os.path.abspath(os.fsdecode(path))
        if path.startswith(_WRITES["root"]):
            _WRITES["last"] = path


@contextlib.contextmanager
def watching_writes(root: Path) -> Iterator[Callable[[], str | None]]:
    """Yield a function that returns the file under `root` this process last opened for writing, so a disk-full
    error, which carries no file name when a write() fails, can name the file. Python's audit event "open" (PEP 578)
    sees every open() and os.open() of this process; writes of C++ libraries and of Ray workers it does not see."""
    if not _WRITES["hooked"]:
        sys.addaudithook(_audit)  # a hook cannot be removed: installed once, idle outside this context
        _WRITES["hooked"] = True
    _WRITES.update(root=str(Path(root).resolve()), last=None)
    try:
        yield lambda: _WRITES["last"]
    finally:
        _WRITES["root"] = None


def _finish(tmp: Path, manifest: dict[str, Any]) -> None:
    paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    # hashlib and file reads release the GIL: threads hash several files at once (a stage's shards are many)
    with concurrent.futures.ThreadPoolExecutor(min(HASH_THREADS, len(paths) or 1)) as pool:
        digests = list(pool.map(file_digest, paths))
    files = {str(p.relative_to(tmp)): {"sha256": d, "bytes": p.stat().st_size} for p, d in zip(paths, digests)}
    full = dict(manifest, files=files, code_version=code_version(), created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True, default=str))
    (tmp / SUCCESS).write_text("")  # written last: its presence means the artifact is complete
