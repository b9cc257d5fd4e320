"""core.storage builds paths under a local directory or a URI; nothing builds a storage path with pathlib."""
import ast
from pathlib import Path

import pytest

from core.storage import is_uri, join

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
