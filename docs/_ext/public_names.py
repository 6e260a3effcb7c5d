"""A MkDocs hook for the API reference: ``::: remat.NAME`` documents the object remat's table of public names
(remat/_core/public.py) says NAME is, under the heading ``remat.NAME``.

docs/api.md names only public paths; where each is defined, which moves with the package's layout, is read from
the same table that `remat/__init__.py` re-exports from.
"""

from __future__ import annotations

import re
from typing import Any

from remat._core.public import PUBLIC

_DIRECTIVE = re.compile(r"^::: remat\.(\w+)\s*$")


def expand(markdown: str) -> str:
    """Each ``::: remat.NAME`` of the table pointed at its definition, with ``heading: remat.NAME``."""
    lines = markdown.splitlines()
    out: list[str] = []
    for index, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if match is None or match[1] not in PUBLIC:
            out.append(line)
            continue
        out.append(f"::: {PUBLIC[match[1]].path}")
        has_options = index + 1 < len(lines) and lines[index + 1].strip() == "options:"
        if not has_options:
            out.append("    options:")
        out.append(f"      heading: remat.{match[1]}")
    for index in range(len(out) - 1):  # the heading goes after the page's own `options:` line
        if out[index].startswith("      heading: remat.") and out[index + 1].strip() == "options:":
            out[index], out[index + 1] = out[index + 1], out[index]
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return expand(markdown) if page.file.src_uri == "api.md" else markdown
