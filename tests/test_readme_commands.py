"""The README's two commands: the second is what CI runs, word for word (``.ci/run``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    """The command lines of README.md's first two ``bash`` blocks (their comments left out)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[:2]
    return [next(ln for ln in b.splitlines() if ln.strip() and not ln.startswith("#")) for b in blocks]


def test_ci_runs_the_readmes_second_command_verbatim():
    first, second = _commands()
    assert first.startswith("python3 -m pip install -e . && ") and "start_task.py" in first, first
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[-1] == second, (lines[-1], second)
