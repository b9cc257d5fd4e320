"""Content-addressed stage artifacts.

An artifact lives at `workdir/artifacts/<stage>/<id>/`, where `<id>` is a hash of
(stage name, stage version, the stage's config sections, its inputs' ids). It is built in a
temporary sibling directory and renamed into place only after `manifest.json` and the
success marker `_SUCCESS` (written last) are there, so a partial artifact is never visible
and a finished one is never recomputed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

SUCCESS = "_SUCCESS"
MANIFEST = "manifest.json"
ID_LENGTH = 16


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal configs hash equally."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(stage: str, version: str, config: Any, input_ids: dict[str, str]) -> str:
    """Hash of everything that determines a stage's output; any change gives a new id."""
    payload = canonical_json({"stage": stage, "version": version, "config": config, "inputs": input_ids})
    return hashlib.sha256(payload.encode()).hexdigest()[:ID_LENGTH]


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
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
    def building(self, stage: str, art_id: str, manifest: dict[str, Any]) -> Iterator[Path]:
        """Yield a temp dir to write into; on success add manifest + marker and rename into place.

        On any exception the temp dir is removed and nothing appears at the final path.
        """
        final = self.path(stage, art_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{art_id}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            yield tmp
            _finish(tmp, manifest)
            if final.exists():  # an incomplete leftover (no marker): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _finish(tmp: Path, manifest: dict[str, Any]) -> None:
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(tmp))] = {"sha256": file_digest(p), "bytes": p.stat().st_size}
    full = dict(manifest, files=files, code_version=code_version(), created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True, default=str))
    (tmp / SUCCESS).write_text("")  # written last: its presence means the artifact is complete
