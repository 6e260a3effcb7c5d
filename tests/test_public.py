"""remat's public names are the imports of remat/__init__.py (NOTE [ The public surface ] in remat/_core/public.py):
the package and the decorator object carry them, the type checker sees them on the decorator, public objects carry
``__module__ = "remat"`` however their module is reached, and their docstrings' examples run here, once each
(pytest's module scan skips them: see tests/conftest.py)."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import remat
from remat._core.public import names

PACKAGE = Path(remat.__file__).parent


def _typing_names(tree: ast.AST) -> dict[str, str]:
    """Name -> what it is bound to, for the statements under the first ``if TYPE_CHECKING:`` of `tree`'s body."""
    block = next(
        node for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
    )
    names: dict[str, str] = {}
    for statement in block.body:
        if isinstance(statement, ast.ImportFrom):
            for alias in statement.names:
                names[alias.asname or alias.name] = f"{'.' * statement.level}{statement.module or ''}:{alias.name}"
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            target = statement.targets[0] if isinstance(statement, ast.Assign) else statement.target
            assert isinstance(target, ast.Name) and statement.value is not None
            names[target.id] = ast.unparse(statement.value)
    return names


def test_the_package_lists_its_imports() -> None:
    public = names()
    assert remat.__all__ == sorted(public)
    assert {"apply", "estimate", "track", "policies", "remat"} <= set(public)  # eager, lazy, a module, the decorator
    assert set(public) <= set(dir(remat))
    for name, entry in public.items():
        assert getattr(remat, name) is not None
        assert entry.lazy == (name in {"chain", "Chain", "solve", "Schedule", "StageCost", "estimate", "EstimateReport",
                                       "ConfigEstimate", "track", "Tracker", "measure", "Report", "Measurement",
                                       "linear_cross_entropy", "tiled"}), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        remat.nothing  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        remat.remat.nothing  # noqa: B018


def test_the_decorator_carries_every_name_for_the_type_checker_too() -> None:
    """At run time the decorator looks up on the package what it lacks; the type checker runs no code, so the
    decorator declares every other public name (NOTE [ The public surface ], rule 4)."""
    from remat import remat as decorator

    tree = ast.parse((PACKAGE / "_api.py").read_text(encoding="utf-8"))
    remat_class = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Remat")
    own = {node.name for node in remat_class.body if isinstance(node, ast.FunctionDef)}
    own |= {target.id for node in remat_class.body if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Name)}
    declared_names = set(_typing_names(remat_class))
    wanted = set(remat.__all__) - own
    assert declared_names == wanted, (
        "the decorator's TYPE_CHECKING block in remat/_api.py lacks "
        f"{sorted(wanted - declared_names)} and has {sorted(declared_names - wanted)} besides"
    )
    for name in remat.__all__:
        assert getattr(decorator, name) is getattr(remat, name) or name in own, name
    assert set(remat.__all__) <= set(dir(decorator))


def test_public_objects_belong_to_remat_however_their_module_is_reached() -> None:
    """In a fresh process, each defining module imported directly (no `remat.NAME` looked up) has claimed its
    names."""
    script = "\n".join(
        [
            "import importlib, inspect",
            "from remat._core.public import names",
            "for name, entry in names().items():",
            "    if not entry.attribute:",
            "        continue",
            "    value = getattr(importlib.import_module('remat' + entry.module), entry.attribute)",
            "    if inspect.isclass(value) or inspect.isfunction(value):",
            "        assert value.__module__ == 'remat', (name, value.__module__)",
            "print('ok')",
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
    assert repr(remat.Tracker) == "<class 'remat.Tracker'>"
    assert f"{remat.RematError.__module__}.{remat.RematError.__qualname__}" == "remat.RematError"


def _public_doctests() -> list[doctest.DocTest]:
    """The examples in the docstrings of every public class and function and their members, once each."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: dict[tuple[str | None, str | None], doctest.DocTest] = {}
    for name, entry in names().items():
        value: Any = remat if name == "remat" else getattr(remat, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue  # the decorator object (its class is `Remat`), its bound methods, the policies module
        home = importlib.import_module(entry.module, "remat")
        for test in finder.find(value, f"remat.{name}", module=home, globs=dict(vars(home))):
            if not test.examples:
                continue
            key = (test.filename, test.docstring)
            if key not in found or len(test.name) < len(found[key].name):  # remat.checkpoint, not Remat.checkpoint
                found[key] = test
    return sorted(found.values(), key=lambda test: test.name)


@pytest.mark.parametrize("test", _public_doctests(), ids=lambda test: test.name)
def test_public_docstring_examples(test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
    assert result.attempted > 0 and result.failed == 0
