"""What remat's comments and docstrings say: no measured figures, no spec citations, NOTE references that resolve.

NOTE [ Figures live in docs/benchmarks.md ]
1. No comment or docstring in remat/ quotes a measurement: a time ("15 us", "3.2 ms"), a byte count ("85.7 MiB"),
   a ratio or a share measured on some machine ("8x", "14%").
2. A comment states what holds and why; the figure behind it goes to docs/benchmarks.md ("Figures behind the
   design notes") with the command that produces it, where it can be measured again.
3. Constants that are the model (`_DEVICES`' rates, `CUDA_BLOCK`, `SLACK`) are code, and prose names them rather
   than repeating their values.

Implementation notes:
1. Comments are read with `tokenize`, docstrings (and any other bare string statement, such as an attribute's
   docstring) with `ast`; code is not read, so a number in code or in a message is not a figure here. Doctest
   lines (``>>>``, ``...``) and their output are code too.
2. A figure is a number followed by a unit of time or bytes, a percent sign or an "x" (`FIGURE`). The few
   literals a user writes that look like one are listed in `ALLOWED`, each with its reason.
3. remat/bench/ is the benchmark harness itself, on its way out of the package to benchmarks/: its comments
   describe what it measures and are not checked here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import remat

PACKAGE = Path(remat.__file__).resolve().parent
ROOT = PACKAGE.parent
TESTS = ROOT / "tests"
SECTION = "\N{SECTION SIGN}"

FIGURE = re.compile(
    r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?"
    r"(?:\s?(?:µs|μs|us|ns|ms|s|secs?|seconds?|minutes?|mins?|hours?|KiB|MiB|GiB|TiB|KB|MB|GB|TB|bytes|%|percent)"
    r"|x|×)(?!\w)"
)

# Literals a user writes, shown in argument docs, that the pattern reads as figures. Each is matched with the
# characters around it, so the same number elsewhere is still caught.
ALLOWED = {
    '"1.5GiB"',  # a budget as a string, the example units.py parses
    '"800MB"',  # the same, in decimal units
    '"80GiB"',  # a device's memory as a string (`memory=`, `track(limit=)`)
    "(32x)",  # the estimate report's folded line for 32 repeated blocks (``layers.*.mlp (32x)``)
}


def _sources(folder: Path) -> list[Path]:
    """The Python files under `folder`, remat/bench/ left out (implementation note 3)."""
    return sorted(p for p in folder.rglob("*.py") if not p.is_relative_to(PACKAGE / "bench"))


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of `path`, doctests left out."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doctest = False
            for offset, line in enumerate(node.value.value.split("\n")):
                stripped = line.strip()
                doctest = stripped.startswith(">>>") or (doctest and bool(stripped))
                if not doctest:
                    yield node.lineno + offset, line


def figures(line: str) -> list[str]:
    """The measured figures `line` quotes.

    >>> figures("the hooks cost 0.35 us against 2.7 us, 8x cheaper (14% of a step)")
    ['0.35 us', '2.7 us', '8x', '14%']
    >>> figures('a budget such as "1.5GiB"; float32, a 3x3 conv, layers.*.mlp (32x), 1000, KiB')
    []
    """
    return [
        match.group(0)
        for match in FIGURE.finditer(line)
        if line[max(match.start() - 1, 0) : match.end() + 1] not in ALLOWED
    ]


def test_no_measured_figures_in_comments() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {found}: {line.strip()}"
        for path in _sources(PACKAGE)
        for number, line in prose(path)
        if (found := figures(line))
    ]
    assert not hits, "figures belong in docs/benchmarks.md (NOTE [ Figures live in docs/benchmarks.md ]):\n" + (
        "\n".join(sorted(hits))
    )
