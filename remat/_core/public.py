"""remat's public names are the imports of `remat/__init__.py`; this module reads them for what needs them at run time.

NOTE [ The public surface ]
1. A public name is one line of `remat/__init__.py`: `from ._x import y as y`, at module level where
   `import remat` loads it, under `if TYPE_CHECKING:` where it loads on first use (the measuring, planning and
   estimating wings: `import remat` stays cheap). `remat.__all__` is those names.
2. The package is callable (`import remat; @remat`), and a name of the `TYPE_CHECKING` block is imported from where
   its line says the first time it is looked up on the package (`serve`).
3. Public classes and functions carry ``__module__ = "remat"``, so that they show as ``remat.Tracker`` in reprs,
   help and tracebacks, however their module is reached: each module that defines one ends with
   ``claim(__name__)``.
4. The decorator object (`from remat import remat`) carries the same names: it looks up on the package what it
   lacks (remat/_api.py), and declares them for the type checker, which runs no code (tests/test_public.py says
   which declaration is missing).
5. A public name that was renamed keeps working under its old name (`DEPRECATED`), on the package and on the
   decorator object alike, with a `DeprecationWarning` at the user's line on every access; it is in no `__all__`.

Implementation notes:
1. (rules 1-3) The lines are read from the file's syntax tree (`names`), once per process, not from the package's
   namespace: `claim` runs while `remat/__init__.py` is still importing the modules it names.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEPRECATED", "Public", "claim", "deprecated", "names", "serve"]

# Public names that were renamed: the old name -> the new one. The old name still works, with a DeprecationWarning
# on every access (rule 5), and is listed in CHANGELOG.md as renamed.
DEPRECATED = {"Plan": "Schedule"}

_INIT = Path(__file__).resolve().parent.parent / "__init__.py"


@dataclass(frozen=True)
class Public:
    """Where a public name comes from: one import line of `remat/__init__.py`."""

    module: str  # relative to the package, as `importlib.import_module(module, "remat")` takes it
    attribute: str  # "" for the module itself (`from . import policies as policies`)
    lazy: bool  # imported under `TYPE_CHECKING`: loaded on first use

    @property
    def path(self) -> str:
        """The dotted path of its definition (what the API reference documents)."""
        return f"remat{self.module}.{self.attribute}".rstrip(".")


@functools.cache
def names() -> dict[str, Public]:
    """The public names (NOTE [ The public surface ], rule 1), read from `remat/__init__.py`."""
    tree = ast.parse(_INIT.read_text(encoding="utf-8"))
    found: dict[str, Public] = {}

    def read(statements: list[ast.stmt], lazy: bool) -> None:
        for node in statements:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                for alias in node.names:
                    if alias.asname == alias.name:  # an explicit re-export
                        module, attribute = (f".{node.module}", alias.name) if node.module else (f".{alias.name}", "")
                        found[alias.name] = Public(module, attribute, lazy)
            elif isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                read(node.body, lazy=True)

    read(tree.body, lazy=False)
    return found


def _load(entry: Public) -> Any:
    value: Any = importlib.import_module(entry.module, "remat")
    return getattr(value, entry.attribute) if entry.attribute else value


class _Package(types.ModuleType):
    """The package's class (NOTE [ The public surface ], rule 2)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remat(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in DEPRECATED:
            return deprecated(name, stacklevel=3)
        entry = names().get(name)
        if entry is None or not entry.lazy:
            raise AttributeError(f"module 'remat' has no attribute {name!r}")
        value = _load(entry)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *names()})


def deprecated(name: str, stacklevel: int = 2) -> Any:
    """The object a renamed public name (`DEPRECATED`) now has, with a DeprecationWarning at the caller's line."""
    new = DEPRECATED[name]
    warnings.warn(f"remat: `remat.{name}` is renamed `remat.{new}`; `remat.{name}` will be removed.",
                  DeprecationWarning, stacklevel=stacklevel)
    return getattr(sys.modules["remat"], new)


def serve(package: types.ModuleType) -> None:
    """Make `package` (remat) callable and its lazy names load on first use."""
    package.__class__ = _Package


def claim(module: str) -> None:
    """Give the public classes and functions that `module` defines ``__module__ = "remat"`` (rule 3)."""
    namespace = vars(sys.modules[module])
    for entry in names().values():
        if f"remat{entry.module}" == module and entry.attribute:
            value = namespace[entry.attribute]
            if inspect.isclass(value) or inspect.isfunction(value):
                value.__module__ = "remat"
