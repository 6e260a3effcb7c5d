"""remat's import graph: no cycle (imports inside functions count too) and an engine that imports nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path

import remat

ROOT = Path(remat.__file__).parent
LEAVES = {"remat._options", "remat._policies", "remat._switch", "remat._errors", "remat._torch_compat"}


def _name(path: Path) -> str:
    parts = ("remat", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the remat modules it imports, at module level, under TYPE_CHECKING or inside functions."""
    files = {_name(path): path for path in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    stem = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    stem = f"{stem}.{node.module}" if node.module else stem
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != name and target != "remat" and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_sees_imports_inside_functions() -> None:
    edges = import_graph()
    assert "remat._planned" in edges["remat._api"]  # imported inside `Remat.apply` only
    assert "remat._torch_compat" in edges["remat._engine.hooks"]


def test_no_import_cycle() -> None:
    assert _cycle(import_graph()) is None


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_engine_imports_only_itself_and_the_leaves() -> None:
    upward = {
        (name, target)
        for name, targets in import_graph().items()
        if name.startswith("remat._engine")
        for target in targets
        if not target.startswith("remat._engine") and target not in LEAVES
    }
    assert upward == set()


def test_the_leaves_import_no_other_part_of_remat() -> None:
    edges = import_graph()
    assert {(leaf, target) for leaf in LEAVES for target in edges[leaf] if target not in LEAVES} == set()
