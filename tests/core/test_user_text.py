"""What a user reads cites nothing they do not have: no section sign (the mark of the design document's sections,
which is not in the repository) in the package, the README, the examples, the docs, or the command line's help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "\N{SECTION SIGN}"
TEXT = {".py", ".md", ".txt", ".yml", ".yaml", ".toml", ".cfg", ".ini", ".rst"}


def _files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in ("remat", "examples", "docs"):
        found += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT]
    return found


def test_no_section_sign_in_what_users_read() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SECTION in line
    ]
    assert not hits, "\n".join(hits)


@pytest.mark.slow  # starts a subprocess: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("args", [["--help"], ["estimate", "--help"]])
def test_no_section_sign_in_command_line_help(args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "remat", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and SECTION not in result.stdout + result.stderr
