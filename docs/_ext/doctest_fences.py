"""A griffe extension for the docs build: a docstring's bare `>>>` examples become fenced `pycon` code.

remat's docstrings end with runnable `>>>` examples (pytest runs them as doctests), often outside an
`Examples:` section, where Markdown would read them as a paragraph. This wraps each such run of lines (the
`>>>`/`...` lines and the output after them, up to a blank line) in a fence. Examples inside an `Examples:`
section are left to griffe's own parser.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence(text: str) -> str:
    """Wrap every block of doctest lines of `text` in a ```pycon fence, except in an `Examples:` section."""
    out: list[str] = []
    indent: str | None = None  # the indentation of the open fence, None outside one
    examples: int | None = None  # the indentation of an `Examples:` header whose section we are in
    for line in text.splitlines():
        stripped = line.lstrip()
        depth = len(line) - len(stripped)
        if stripped and examples is not None and depth <= examples:
            examples = None
        if stripped == "Examples:":
            examples = depth
        if indent is None and examples is None and stripped.startswith(">>>"):
            indent = line[:depth]
            out.append(f"{indent}```pycon")
        elif indent is not None and not stripped:
            out.append(f"{indent}```")
            indent = None
        out.append(line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence bare doctest blocks in every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence(obj.docstring.value)
