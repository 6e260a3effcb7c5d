"""remat's import graph: no cycle (imports inside functions count too), and folders that are layers.

Each folder of remat/ imports only the folders below it in `LAYERS` (bottom first); `_api.py`, `policies.py`,
`__init__.py` and the command line (`__main__.py`, `_estimate_cli.py`, `_demo.py`) sit on top. An import under
``TYPE_CHECKING`` names a type and loads nothing, so it may point up (the table of `remat.plan` names a budget's
type); it still counts for cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import remat

ROOT = Path(remat.__file__).parent
LAYERS = ("_core", "_engine", "_measure", "_chain", "_sites", "_budget", "_estimate", "_apply")


def _name(path: Path) -> str:
    parts = ("remat", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements of ``tree`` under ``if TYPE_CHECKING:``."""
    return {
        node
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for statement in block.body
        for node in ast.walk(statement)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }


def import_graph(*, typing: bool = True) -> dict[str, set[str]]:
    """Module -> the remat modules it imports: at module level, inside functions, and under TYPE_CHECKING."""
    files = {_name(path): path for path in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if typing else _typing_only(tree)
        for node in ast.walk(tree):
            if node in skipped:
                continue
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
    assert "remat._budget.driver" in edges["remat._apply.drive"]  # imported inside `drive` only
    assert "remat._core.torch_compat" in edges["remat._engine.hooks"]


def test_no_import_cycle() -> None:
    assert _cycle(import_graph()) is None


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _layer(module: str) -> int:
    """The index of ``module``'s folder in `LAYERS`; the modules on top (`_api`, `policies`, `remat`) come after."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def test_every_module_lives_in_a_layer_or_on_top() -> None:
    # the command line (`python -m remat`, its estimate, its built-in models) uses everything below
    on_top = {"remat", "remat.__main__", "remat._api", "remat.policies", "remat._demo", "remat._estimate_cli"}
    assert {name for name in import_graph() if _layer(name) == len(LAYERS)} <= on_top


def test_each_folder_imports_only_the_folders_below_it() -> None:
    upward = {
        (name, target)
        for name, targets in import_graph(typing=False).items()
        for target in targets
        if _layer(target) > _layer(name)
    }
    assert upward == set()


def test_the_engine_imports_only_itself_and_the_core() -> None:
    edges = import_graph()
    assert {t for name, targets in edges.items() if name.startswith("remat._engine.") for t in targets
            if not t.startswith(("remat._engine", "remat._core"))} == set()
    assert {t for name, targets in edges.items() if name.startswith("remat._core.") for t in targets
            if not t.startswith("remat._core")} == set()
