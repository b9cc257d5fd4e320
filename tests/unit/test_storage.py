"""core.storage builds paths under a local directory or a URI; nothing builds a storage path with pathlib."""
import ast
import re
from pathlib import Path

import pytest

from core.storage import is_uri, join, split_uri

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("base, parts, want", [
    ("s3://bucket/ray", ("sweep-train",), "s3://bucket/ray/sweep-train"),
    ("s3://bucket/ray/", ("a/", "/b"), "s3://bucket/ray/a/b"),
    ("gs://bucket", ("x",), "gs://bucket/x"),
    ("/tmp/work", ("a", "b"), "/tmp/work/a/b"),
])
def test_join_keeps_the_uri_scheme(base, parts, want):
    assert join(base, *parts) == want
    assert is_uri(want) == ("://" in base)


@pytest.mark.parametrize("location, want", [("s3://bucket/a/b", ("s3", "bucket/a/b")),
                                            ("file:///tmp/x", ("file", "/tmp/x")), ("/tmp/x", ("", "/tmp/x"))])
def test_split_uri_gives_the_scheme_and_the_rest(location, want):
    assert split_uri(location) == want


SEAM = re.compile(r'"://"|FileSystem\(|FileSystem\.from_uri|import (fsspec|s3fs|boto3)')
"""A scheme parsed or tested by hand, or a file system opened: core/storage.py's job alone."""


def test_locations_are_opened_and_parsed_in_core_storage_alone():
    found = [f"{py.relative_to(ROOT)}:{n}" for folder in ("pipeline", "stages", "training", "core", "cluster", "bench")
             for py in sorted((ROOT / folder).rglob("*.py")) if py != ROOT / "core" / "storage.py"
             for n, line in enumerate(py.read_text().splitlines(), 1) if SEAM.search(line)]
    assert found == [], f"use core.storage (filesystem, split_uri, is_uri, s3_filesystem) instead: {found}"


def _pathlib_on_storage_path(tree: ast.AST) -> list[int]:
    """Lines where `Path(...)` is called on something named `storage_path` (a local path or a URI)."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Path":
            for arg in node.args:
                names = {getattr(n, "id", None) for n in ast.walk(arg)} | {getattr(n, "attr", None) for n in ast.walk(arg)}
                if "storage_path" in names:
                    hits.append(node.lineno)
    return hits


def test_no_storage_path_is_built_with_pathlib():
    found = {}
    for folder in ("pipeline", "stages", "training", "core", "cluster"):
        for py in (ROOT / folder).rglob("*.py"):
            lines = _pathlib_on_storage_path(ast.parse(py.read_text()))
            if lines:
                found[str(py.relative_to(ROOT))] = lines
    assert not found, f"pathlib on a storage path that may be a URI (use core.storage.join): {found}"
