"""Content-addressed stage artifacts.

An artifact lives at `workdir/artifacts/<stage>/<id>/`, where `<id>` is a hash of
(stage name, stage version, the stage's config sections, its inputs' ids). It is built in a
temporary sibling directory and renamed into place only after `manifest.json` and the
success marker `_SUCCESS` (written last) are there, so a partial artifact is never visible
and a finished one is never recomputed. A finished artifact is never deleted in place either: if the same
artifact appeared while ours was being built, ours is dropped and theirs kept; a `--force` rebuild moves the old one
aside before the new one takes its name. Which run may build what is `core.locks`' business.

In object storage (a workdir `s3://bucket/prefix`): the build happens in a local directory as above, then its files
are uploaded to `<workdir>/artifacts/<stage>/<id>/`, `manifest.json` next and `_SUCCESS` last, so the marker is what
makes an artifact visible there too (an object store has no rename; a write cut short leaves objects without a
marker, which no reader takes and the re-run overwrites). A reader gets a verified local copy: `fetch` downloads an
artifact once per node into the local cache (`<local>/artifacts/<stage>/<id>/`, the same layout), checking every
file's size and SHA-256 against the manifest as it goes, and renames it into place only when all match.

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
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from core import storage
from core.errors import StageInputError

SUCCESS = "_SUCCESS"
MANIFEST = "manifest.json"
ID_LENGTH = 16
BUILDING, REPLACED, FETCHING = ".tmp-", ".old-", ".fetch-"
"""Prefixes of a build in progress, of a finished artifact a `--force` rebuild replaced, and of a download from
object storage in progress: `<prefix><id>-<hex>`."""
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
    """Where the artifact's files are read: the workdir's directory, or this node's copy of an object-store one."""
    uri: str = ""
    """The artifact in object storage (`s3://.../artifacts/<stage>/<id>`), or "" in a local workdir. A process on
    another node calls `fetch(artifact)` before it reads `path`."""

    @property
    def manifest(self) -> dict[str, Any]:
        if self.uri and not _complete(self.path):  # not fetched to this node: read it where it lives
            fs, root = _remote(self.uri)
            return json.loads(fs.open_input_stream(f"{root}/{MANIFEST}").read())
        return json.loads((self.path / MANIFEST).read_text())

    @property
    def digest(self) -> str:
        """One digest over the manifest's file digests: what MLflow records as the dataset digest."""
        files = self.manifest.get("files", {})
        payload = canonical_json({k: v["sha256"] for k, v in files.items()})
        return hashlib.sha256(payload.encode()).hexdigest()[:ID_LENGTH]


class ArtifactStore:
    """Derives artifact paths under a workdir and writes artifacts atomically.

    `workdir` is a local directory or an object-store URI; for a URI, `local` is this machine's directory for the
    local copies (the cache), the build area and the stages' scratch."""

    def __init__(self, workdir: str | Path, local: Path | None = None):
        self.workdir = str(workdir)
        """The workdir as given: a local directory or an object-store URI."""
        if storage.is_uri(workdir):
            if local is None:
                raise ValueError(f"workdir {workdir} is in object storage: give a local directory for its cache")
            self.remote: str | None = storage.join(workdir, "artifacts")
            self.root = Path(local) / "artifacts"
        else:
            self.remote = None
            self.root = Path(workdir) / "artifacts"

    def path(self, stage: str, art_id: str) -> Path:
        return self.root / stage / art_id

    def location(self, stage: str, art_id: str) -> str:
        """Where the artifact lives, as a user would look for it: its URI in object storage, else its directory."""
        return storage.join(self.remote, stage, art_id) if self.remote else str(self.path(stage, art_id))

    def exists(self, stage: str, art_id: str) -> bool:
        """Whether the artifact is finished (in object storage: its marker is there), without reading it."""
        if _complete(self.path(stage, art_id)):
            return True
        return self.remote is not None and _remote_complete(self.location(stage, art_id))

    def find(self, stage: str, art_id: str, fetching: bool = True) -> Artifact | None:
        """The finished artifact, or None when it was never completed. From object storage it is fetched into this
        node's cache first (once), and verified on the way, unless `fetching` is off (for a reference to it only:
        its id and manifest)."""
        path = self.path(stage, art_id)
        art = Artifact(stage, art_id, path, self.location(stage, art_id) if self.remote else "")
        if _complete(path):
            return art
        if self.remote is None or not _remote_complete(art.uri):
            return None
        if fetching:
            fetch(art)
        return art

    def verify(self, stage: str, art_id: str, digests: bool = False) -> None:
        """`verify` of the artifact where it is read from: the local copy when there is one, else (object storage)
        each object's size by one listing; digests are checked when it is fetched."""
        art = Artifact(stage, art_id, self.path(stage, art_id), self.location(stage, art_id) if self.remote else "")
        if _complete(art.path) or self.remote is None:
            verify(art, digests)
        else:
            _verify_remote(art)

    def scratch_path(self, stage: str, art_id: str) -> Path:
        return Path(self.root).parent / "scratch" / stage / art_id

    def scratch(self, stage: str, art_id: str) -> Path:
        """A persistent per-artifact work area (e.g. training checkpoints) that survives failed attempts."""
        path = self.scratch_path(stage, art_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def building(self, stage: str, art_id: str, manifest: dict[str, Any], replace: bool = False) -> Iterator[Path]:
        """Yield a temp dir to write into; on success add manifest + marker and rename into place (and upload it,
        marker last, to object storage).

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
            if self.remote is not None and not _upload(tmp, self.location(stage, art_id), replace):
                shutil.rmtree(tmp)  # another run finished it in the bucket meanwhile: `find` fetches theirs
                return
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


def _complete(path: Path) -> bool:
    return (path / SUCCESS).is_file() and (path / MANIFEST).is_file()


# ----------------------------------------------------------------------------------------------- object storage

def _remote(uri: str) -> tuple[Any, str]:
    return storage.filesystem(uri)


def _remote_complete(uri: str) -> bool:
    import pyarrow.fs as pafs

    fs, path = _remote(uri)
    return fs.get_file_info(f"{path}/{SUCCESS}").type == pafs.FileType.File


def _upload(tmp: Path, uri: str, replace: bool) -> bool:
    """Copy a finished local build to `uri`: data files (in parallel), then the manifest, then the marker. False when
    a finished artifact is already there and `replace` is off (it is kept). With `replace` the old marker goes
    first, then the old objects, so no reader takes a mixture."""
    import pyarrow.fs as pafs

    fs, root = _remote(uri)
    if fs.get_file_info(f"{root}/{SUCCESS}").type == pafs.FileType.File:
        if not replace:
            return False
        fs.delete_file(f"{root}/{SUCCESS}")
    if fs.get_file_info(root).type == pafs.FileType.Directory:
        fs.delete_dir_contents(root)  # a --force's old objects, or those of an upload cut short
    local, _ = storage.filesystem(tmp)
    rels = [str(p.relative_to(tmp)) for p in sorted(tmp.rglob("*")) if p.is_file() and p.name not in (MANIFEST, SUCCESS)]

    def put(rel: str) -> None:
        pafs.copy_files(str(tmp / rel), f"{root}/{rel}", source_filesystem=local, destination_filesystem=fs)

    with concurrent.futures.ThreadPoolExecutor(min(HASH_THREADS, len(rels) or 1)) as pool:
        list(pool.map(put, rels))
    put(MANIFEST)
    put(SUCCESS)  # last: its presence means the artifact is complete
    return True


def _verify_remote(art: Artifact) -> None:
    import pyarrow.fs as pafs

    fix = f"rebuild it with --force {art.stage}"
    fs, root = _remote(art.uri)
    try:
        files = json.loads(fs.open_input_stream(f"{root}/{MANIFEST}").read())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise StageInputError(f"artifact {art.uri}: its {MANIFEST} is unreadable ({e}); {fix}") from None
    sizes = {i.path[len(root) + 1:]: i.size for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
             if i.type == pafs.FileType.File}
    for rel, entry in files.items():
        if rel not in sizes:
            raise StageInputError(f"artifact {art.stage}/{art.id}: {art.uri}/{rel} is missing; {fix}")
        if sizes[rel] != entry["bytes"]:
            raise StageInputError(f"artifact {art.stage}/{art.id}: {art.uri}/{rel} has {sizes[rel]} bytes, its "
                                  f"manifest says {entry['bytes']} (truncated or overwritten); {fix}")


def fetch(art: Artifact, chunk: int = 4 << 20) -> None:
    """Make `art.path` this node's verified copy of the object-store artifact `art.uri` (nothing to do when it is
    there already). Every file is downloaded and hashed in one pass and must match the manifest's size and SHA-256;
    the copy is renamed into place only when all do, so a reader never sees a partial one. Processes fetching the
    same artifact at once each download, and the first rename wins."""
    if not art.uri or _complete(art.path):
        return
    fix = f"rebuild it with --force {art.stage}"
    fs, root = _remote(art.uri)
    try:
        manifest = fs.open_input_stream(f"{root}/{MANIFEST}").read()
        files = json.loads(manifest)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise StageInputError(f"artifact {art.uri}: its {MANIFEST} is unreadable ({e}); {fix}") from None
    art.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = art.path.parent / f"{FETCHING}{art.id}-{uuid.uuid4().hex[:8]}"

    def get(rel: str) -> None:
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        try:
            with fs.open_input_stream(f"{root}/{rel}") as src, open(target, "wb") as dst:
                while block := src.read(chunk):
                    h.update(block)
                    dst.write(block)
                    size += len(block)
        except FileNotFoundError:
            raise StageInputError(f"artifact {art.stage}/{art.id}: {art.uri}/{rel} is missing; {fix}") from None
        want = files[rel]
        if size != want["bytes"] or h.hexdigest() != want["sha256"]:
            what = (f"has {size} bytes, its manifest says {want['bytes']} (truncated or overwritten)"
                    if size != want["bytes"] else "does not match its manifest's sha256 (changed since it was written)")
            raise StageInputError(f"artifact {art.stage}/{art.id}: {art.uri}/{rel} {what}; {fix}")

    try:
        with concurrent.futures.ThreadPoolExecutor(min(HASH_THREADS, len(files) or 1)) as pool:
            list(pool.map(get, sorted(files)))
        (tmp / MANIFEST).write_bytes(manifest)
        (tmp / SUCCESS).write_text("")
        try:
            os.rename(tmp, art.path)
        except OSError:
            if not _complete(art.path):  # not another fetch that won the rename: an incomplete leftover
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


_WRITES: dict[str, Any] = {"watchers": {}, "hooked": False}
"""thread id -> [root, last file opened for writing under it] of each `watching_writes` open in that thread."""


def _audit(event: str, args: tuple) -> None:
    watchers = _WRITES["watchers"]
    if event != "open" or not watchers:
        return
    path, _, flags = args
    if isinstance(path, (str, bytes, os.PathLike)) and flags & (os.O_WRONLY | os.O_RDWR):
        path = os.path.abspath(os.fsdecode(path))
        own = watchers.get(threading.get_ident())  # a stage's own thread; a helper thread's write goes to every one
        for watcher in [own] if own is not None else list(watchers.values()):
            if path.startswith(watcher[0]):
                watcher[1] = path


@contextlib.contextmanager
def watching_writes(root: Path) -> Iterator[Callable[[], str | None]]:
    """Yield a function that returns the file under `root` this thread (or a thread without a watch of its own) last
    opened for writing, so a disk-full error, which carries no file name when a write() fails, can name the file;
    stages running side by side in threads each see their own. Python's audit event "open" (PEP 578) sees every
    open() and os.open() of this process; writes of C++ libraries and of Ray workers it does not see."""
    if not _WRITES["hooked"]:
        sys.addaudithook(_audit)  # a hook cannot be removed: installed once, idle outside this context
        _WRITES["hooked"] = True
    watcher = [str(Path(root).resolve()), None]
    _WRITES["watchers"][threading.get_ident()] = watcher
    try:
        yield lambda: watcher[1]
    finally:
        _WRITES["watchers"].pop(threading.get_ident(), None)


def _finish(tmp: Path, manifest: dict[str, Any]) -> None:
    paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    # hashlib and file reads release the GIL: threads hash several files at once (a stage's shards are many)
    with concurrent.futures.ThreadPoolExecutor(min(HASH_THREADS, len(paths) or 1)) as pool:
        digests = list(pool.map(file_digest, paths))
    files = {str(p.relative_to(tmp)): {"sha256": d, "bytes": p.stat().st_size} for p, d in zip(paths, digests)}
    full = dict(manifest, files=files, code_version=code_version(), created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True, default=str))
    (tmp / SUCCESS).write_text("")  # written last: its presence means the artifact is complete
