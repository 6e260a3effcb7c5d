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
    out: list[str] = []
    name = None  # the public name of the directive on the line before
    for line in markdown.splitlines():
        if name is None or line.strip() != "options:":  # a directive's own `options:` is written with the heading
            out.append(line)
        match = _DIRECTIVE.match(line)
        name = match[1] if match is not None and match[1] in PUBLIC else None
        if name is not None:
            out[-1:] = [f"::: {PUBLIC[name].path}", "    options:", f"      heading: remat.{name}"]
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return expand(markdown) if page.file.src_uri == "api.md" else markdown
