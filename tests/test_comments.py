"""What remat's comments and docstrings say: no measured figures, no spec citations, NOTE references that resolve.

Tests cite the docs in the repository (docs/*.md, docs/guides/*.md) or a NOTE in remat/, never the sections of a
design document the repository does not hold: no file under remat/ or tests/ has a section sign.

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
    r"|x|\u00d7)(?!\w)"
)

# A comparison in words ("four times cheaper"): a ratio measured somewhere, as `FIGURE`'s "4x" is.
COMPARISON = re.compile(
    r"(?i)\b(?:\d+(?:\.\d+)?|two|three|four|five|six|seven|eight|nine|ten|twenty|a hundred) times "
    r"(?:cheaper|faster|slower|smaller|larger|more|less|fewer|as)\b"
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
    """The Python files under `folder`."""
    return sorted(folder.rglob("*.py"))


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
    >>> figures("finalize (four times cheaper); runs three times, many times slower")
    ['four times cheaper']
    """
    found = [
        match.group(0)
        for match in FIGURE.finditer(line)
        if line[max(match.start() - 1, 0) : match.end() + 1] not in ALLOWED
    ]
    return found + [match.group(0) for match in COMPARISON.finditer(line)]


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


# NOTE references: a block is defined by a line that holds only "NOTE" and its bracketed name (a comment or a
# docstring line), and cited by the same words, optionally followed by "in path.py" naming the file that defines it.
DEFINITION = re.compile(r"^\s*(?:#\s*)?NOTE \[ (.+?) \](?:\s*$|\s+\(for users)")
REFERENCE = re.compile(r"NOTE \[ (.+?) \](?:\s+in\s+((?:[\w.]+/)*\w+\.py)\b)?")


def _flat(path: Path) -> tuple[str, list[tuple[int, int]]]:
    """The comments and docstrings of `path` in line order, comment markers and indentation dropped, joined by
    spaces (a citation may wrap), and (offset, line number) where each line starts."""
    starts, parts, offset = [], [], 0
    for number, line in sorted(prose(path)):
        text = re.sub(r"^\s*#*\s*", "", line)
        starts.append((offset, number))
        parts.append(text)
        offset += len(text) + 1
    return " ".join(parts), starts


def definitions() -> dict[str, list[Path]]:
    """Every NOTE's name -> the files that define it, in remat/, tests/ and benchmarks/."""
    found: dict[str, list[Path]] = {}
    for folder in (PACKAGE, TESTS, ROOT / "benchmarks"):
        for path in sorted(folder.rglob("*.py")):
            for line in path.read_text(encoding="utf-8").splitlines():
                if match := DEFINITION.match(line):
                    found.setdefault(match.group(1), []).append(path)
    return found


def references() -> Iterator[tuple[Path, int, str, str | None]]:
    """(file, line, name, the file named after "in", if any) for every NOTE citation in remat/, tests/,
    benchmarks/ and examples/."""
    others = (TESTS, ROOT / "benchmarks", ROOT / "examples")
    for path in [*_sources(PACKAGE), *(p for folder in others for p in sorted(folder.rglob("*.py")))]:
        text, starts = _flat(path)
        for match in REFERENCE.finditer(text):
            line = next(number for offset, number in reversed(starts) if offset <= match.start())
            yield path, line, re.sub(r"\s+", " ", match.group(1)), match.group(2)


def _resolve(named: str, citing: Path) -> list[Path]:
    """The files `named` ("track.py", "_measure/track.py", "remat/_measure/track.py") can mean from `citing`:
    the one in the citing file's folder where there is one, else every file whose path ends so."""
    files = [*PACKAGE.rglob("*.py"), *TESTS.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    found = [f for f in files if f.as_posix().endswith("/" + named)]
    here = [f for f in found if f.parent == citing.parent]
    return here or found


def test_each_note_is_defined_once() -> None:
    twice = {name: [str(p.relative_to(ROOT)) for p in paths] for name, paths in definitions().items() if len(paths) > 1}
    assert not twice, twice


def test_every_cited_note_is_defined() -> None:
    defined = definitions()
    missing = [
        f"{path.relative_to(ROOT)}:{line}: NOTE [ {name} ]"
        for path, line, name, _ in references()
        if name not in defined
    ]
    assert not missing, "\n".join(missing)


def test_a_note_cited_in_a_file_is_defined_there() -> None:
    defined = definitions()
    wrong = []
    for path, line, name, named in references():
        if named is None:
            continue
        files = _resolve(named, path)
        if len(files) != 1 or files[0] not in defined.get(name, []):
            where = ", ".join(str(p.relative_to(ROOT)) for p in defined.get(name, [])) or "nowhere"
            wrong.append(f"{path.relative_to(ROOT)}:{line}: NOTE [ {name} ] in {named}: it is defined in {where}")
    assert not wrong, "\n".join(wrong)


def test_no_section_signs_in_the_package_or_the_tests() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in (PACKAGE, TESTS)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in {".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".rst", ".yml", ".yaml"}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SECTION in line
    ]
    assert not hits, "cite docs/ or a NOTE instead:\n" + "\n".join(hits)
