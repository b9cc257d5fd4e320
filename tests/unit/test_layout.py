"""The house's layout rule: one layer per folder, each importing only the folders below it, and no file cycles.

Imports are read with `ast` from every project file (function-local imports included, `TYPE_CHECKING` ones
too: a cycle a type checker walks is a cycle a reader walks). Written here rather than taken from a linter
because the rule is this repository's own (its folder order), and import-linter would be one more dependency
for twenty lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("pipeline", "stages", "training", "cluster", "core", "deberta")
"""Top to bottom: a folder may import the folders after it, never one before it (bench/ and tests/ sit above all)."""
PACKAGES = (*LAYERS, "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts a.b.c when that is a module, else a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` runs pkg/__init__.py too: a submodule importing its own package that way is a
            # cycle (import the submodule by its full name instead)
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_files()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative enough for this tree's depth)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_file_import_cycles():
    assert cycles(import_graph()) == []


def test_each_folder_imports_only_the_folders_below_it():
    wrong = []
    for module, imports in import_graph().items():
        top = module.split(".")[0]
        if top not in LAYERS:
            continue
        for imported in imports:
            other = imported.split(".")[0]
            if other != top and (other not in LAYERS or LAYERS.index(other) < LAYERS.index(top)):
                wrong.append(f"{module} -> {imported}")
    assert not wrong, f"layer order {' > '.join(LAYERS)} broken by: {wrong}"


@pytest.mark.parametrize("package", ["core", "deberta"])
def test_ground_layers_import_no_framework(package):
    """core/ imports no torch, Ray or DeepSpeed at module level (the command line and the data stages stand on it;
    `core/hf_pyfunc.py` loads torch inside the served model); deberta/ imports nothing of Ray, DeepSpeed or MLflow,
    anywhere."""
    banned = {"core": ("torch", "deepspeed", "ray"), "deberta": ("ray", "deepspeed", "mlflow")}[package]
    hits = []
    for path in sorted((REPO / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = tree.body if package == "core" else list(ast.walk(tree))
        for node in nodes:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            hits += [f"{path.name}: {n}" for n in names if n.split(".")[0] in banned]
    assert not hits
