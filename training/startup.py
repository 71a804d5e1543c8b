"""Where a rank's time goes before its first step ends: the start-up phases.

Each phase is the seconds from the mark before it (the process's start for the first), measured
on rank 0 and sent once as the ``startup`` info record when the first step of the first phase
ends (training/case.py):

- ``imports``: the process's start (the kernel's start time of this process, /proc) to the case
  driver's start: the interpreter, torch and the framework imported, the resolved config read,
  the vendor's adapter and hooks applied (on rank 0 also what its build imports next, where
  the conformance probe is forked from it: training/conformance/forking.py);
- ``conformance``: the conformance check (training/conformance/), timed apart: the issue of a
  first step's time does not count it;
- ``build``: the trainer's build (the framework's process groups, the model, its layout-free
  starting weights, the optimizer, the data), split further where the case marks its own parts
  (:func:`mark` inside ``build``: ``weights``, ``optimizer``, ...);
- ``first_step``: the first optimizer step (compilation, the first allocations, autotuning).

``to_first_step_s`` is the process's start to the end of the first step, ``conformance`` left out.
Standard library only.
"""

from __future__ import annotations

import os
import time
from typing import Any

_marks: list[tuple[str, float]] = []  # (phase, CLOCK_BOOTTIME at its end)


def process_started() -> float | None:
    """This process's start on CLOCK_BOOTTIME (seconds since boot), from /proc/self/stat; None
    where there is no /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def mark(phase: str) -> None:
    """The end of a start-up phase (or of a case's own part of ``build``), now."""
    _marks.append((phase, now()))


def record() -> dict[str, Any]:
    """The phases as seconds each, in order, and the process's start to the last mark, the
    conformance check left out."""
    start = process_started()
    prev = start if start is not None else (_marks[0][1] if _marks else now())
    phases: dict[str, float] = {}
    for phase, t in _marks:
        phases[phase] = round(phases.get(phase, 0.0) + t - prev, 3)
        prev = t
    total = None if start is None or not _marks else round(_marks[-1][1] - start - phases.get("conformance", 0.0), 3)
    return {"phases": phases, "to_first_step_s": total, "process_start": "proc" if start is not None else "unknown"}
