"""The library stays linted and typed: ruff and mypy over lib/ddlab, with the settings in lib/pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib"
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=LIB, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    done = run("ruff", "check", "ddlab")
    assert done.returncode == 0, f"ruff check (run `ruff check --fix ddlab` in lib/):\n{done.stdout}{done.stderr}"


def test_mypy_finds_nothing():
    done = run("mypy")
    assert done.returncode == 0, f"mypy (run `mypy` in lib/):\n{done.stdout}{done.stderr}"
