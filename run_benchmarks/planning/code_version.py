"""Which code a run ran: the commit the harness runs from, or the one a copied tree names.

results.json names it, so a committed result can be re-run from the code that made it.
"""

from __future__ import annotations

import os
import re
import subprocess

from run_benchmarks.errors import InputError
from run_benchmarks.planning.registry import ROOT


def git(*args: str) -> str | None:
    """``git <args>`` in the harness's own checkout: its output, stripped, or None where git is
    missing, fails or takes over 10 s."""
    try:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


SENT_VERSION = re.compile(r"[0-9a-f]{40}(\+changes)?")


def sent_code_version() -> str | None:
    """``FLAGBENCH_CODE_VERSION`` (a tree copied to another machine names the commit it came
    from), None when unset. A value that is not a full commit id is bad input (InputError): a
    short or mistyped one names code nobody can check out. Checked before anything runs."""
    sent = os.environ.get("FLAGBENCH_CODE_VERSION")
    if sent and not SENT_VERSION.fullmatch(sent):
        raise InputError(
            f"FLAGBENCH_CODE_VERSION={sent!r} is not a full commit id (40 lowercase hex digits, '+changes' allowed after "
            "them): results.json names the code that made it; set it to `git rev-parse HEAD` of the tree that was sent"
        )
    return sent or None


def code_version() -> str | None:
    """The commit the harness runs from (``+changes`` when files differ from it), so a committed
    result names the code that made it; :func:`sent_code_version` when set, else None outside a
    git checkout."""
    sent = sent_code_version()
    if sent:  # a copied tree whose own git (if any) is not the code's: as its sender said
        return sent
    head = git("rev-parse", "HEAD")
    if not head:
        return None
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
