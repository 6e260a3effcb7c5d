"""The docs site: the API reference covers every public name, and the site builds with warnings as errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import remat

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_covers_every_public_name() -> None:
    """docs/api.md documents each name of `remat.__all__` once, by its public path (mkdocstrings follows
    remat/__init__.py's imports to the definition) or a heading of its own, and nothing by a private path."""
    text = (ROOT / "docs" / "api.md").read_text()
    documented = re.findall(r"^(?:::: |#+ )remat\.(\w+)\s*$", text, flags=re.MULTILINE)
    assert sorted(documented) == sorted(remat.__all__), "docs/api.md and remat.__all__ differ"
    assert not re.findall(r"^::: remat\._", text, flags=re.MULTILINE)


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert pages and all(page in nav for page in pages), [p for p in pages if p not in nav]


@pytest.mark.slow  # `mkdocs build` in a subprocess: NOTE [ Slow tests ] in tests/conftest.py
def test_site_builds_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "api" / "index.html").exists()


_MODULE_REF = re.compile(r"`(?:remat/)?(_[a-z_]+(?:/[a-z_]+)*)(?:\.py)?((?:\.[A-Za-z_]+)?)`")


def test_module_paths_in_the_docs_name_files_that_exist() -> None:
    """A docs page that points into the package (`_budget/first_step.py`, `_engine/rerun._RETURNS`) names a module
    that exists and, where it names one, a name defined in it: a move of modules updates the pages."""
    package = Path(remat.__file__).parent
    missing = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for match in _MODULE_REF.finditer(page.read_text(encoding="utf-8")):
            module, name = package / f"{match[1]}.py", match[2].lstrip(".")
            if "/" not in match[1] and not (match[0].endswith('.py`') or name):
                continue  # a bare `_name` is not a module reference
            if not module.is_file():
                missing.append(f"{page.name}: {match[0]} (no {module.relative_to(package.parent)})")
            elif name and not re.search(rf"^(?:def |class )?{name}\b", module.read_text(encoding="utf-8"), re.M):
                missing.append(f"{page.name}: {match[0]} (no {name} in it)")
    assert not missing, "\n".join(missing)
