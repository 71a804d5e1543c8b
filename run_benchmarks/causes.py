"""The root cause of a failed round, in one line, first.

A rank that dies takes its peers down with it: they report connection errors, their
launcher a traceback of its own, and a healthy node says it was stopped. What people need
is the first failure: the rank that was killed (and by what), or the exception it raised.
Sources, in order of trust: the launcher's own "Root Cause (first observed failure)" record
(torchrun), the ranks' ``run_error`` records (earliest first), a signal or exception line in
the node's logs.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

_ROOT = re.compile(r"Root Cause \(first observed failure\):(?P<block>.*?)(?:={10,}|\Z)", re.S)
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RETURN_CODE = re.compile(r"(?:exits with return code|return code)\s*=\s*(-\d+)")
_EXCEPTION = re.compile(r"^(?:\[[^\]]*\]:?\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::.*)?)\s*$")
_ADDRESS = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def launcher_root_cause(text: str) -> tuple[int | None, str] | None:
    """(rank, "killed by SIGKILL" / "exit status 1") from a launcher's summary, if it printed one."""
    m = _ROOT.search(text)
    if m:
        rank, code = _RANK.search(m["block"]), _EXIT.search(m["block"])
        if code:
            c = int(code[1])
            return (int(rank[1]) if rank else None), (f"killed by {_signal_name(c)}" if c < 0 else f"exit status {c}")
    m2 = _RETURN_CODE.search(text)
    if m2:  # DeepSpeed's launcher: "... exits with return code = -9"
        return None, f"killed by {_signal_name(int(m2[1]))}"
    return None


def log_cause(text: str) -> str | None:
    """The last exception line of a log, else an address-in-use line."""
    found = None
    for line in text.splitlines():
        m = _EXCEPTION.match(line.strip())
        if m and not m[1].startswith("torch.distributed.elastic"):  # the launcher's own wrapper
            found = m[1]
    if found:
        return found
    addr = next((ln.strip() for ln in text.splitlines() if _ADDRESS.search(ln)), None)
    return addr


def memory_hint(monitor: dict[str, Any] | None) -> str:
    """ "; likely out of host memory (peak X of Y GiB)" when the host was nearly full."""
    if not monitor or not monitor.get("host_mem_total_gib"):
        return ""
    peak, total = monitor["host_mem_peak_gib"], monitor["host_mem_total_gib"]
    return f"; likely out of host memory (peak {peak:.1f} of {total:.1f} GiB)" if peak >= 0.9 * total else ""


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
