"""The tree is as ruff leaves it: lint (the rules in pyproject.toml) and format.

Both run on the whole repository, as a contributor runs them before committing:
``ruff check . && ruff format --check .`` (``ruff check --fix . && ruff format .`` mends most).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from run_benchmarks.planning.registry import ROOT


def ruff() -> list[str]:
    exe = shutil.which("ruff")
    if exe is None:  # installed with the test extra (setup.cfg); a missing one is a broken setup
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return [exe]


@pytest.mark.parametrize("command", [["check", "--no-fix"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run([*ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff {' '.join(command)} .:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"


def test_no_formatter_pragmas():
    """The formatter's layout is the project's: no islands it is told to skip."""
    proc = subprocess.run(["git", "grep", "-n", "-E", "fmt: (skip|off)", "--", "*.py"], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout == "", proc.stdout[:3000]
