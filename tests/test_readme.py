"""The README's Python blocks run as written, each on its own (a fresh namespace); so do the docs pages whose
examples are complete (each page's blocks in order, in one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import remat

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE_PAGES = ("docs/index.md", "docs/quickstart.md", "docs/guides/sites.md", "docs/guides/policies.md",
                  "docs/guides/measuring.md")


def _blocks(path: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / path).read_text(), flags=re.MULTILINE | re.DOTALL)


README_BLOCKS = _blocks("README.md")


def _run(source: str, name: str, namespace: dict[str, object]) -> None:
    torch.manual_seed(0)
    was = remat.is_enabled()
    try:
        exec(compile(source, name, "exec"), namespace)
    finally:
        remat.set_enabled(was)


def test_the_readme_has_python_blocks() -> None:
    assert len(README_BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_block_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    _run(README_BLOCKS[index], f"README.md, python block {index + 1}", {"__name__": "__readme__"})


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_docs_page_blocks_run(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _blocks(page)
    assert blocks, f"{page} has no python block"
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for index, block in enumerate(blocks):
        _run(block, f"{page}, python block {index + 1}", namespace)
