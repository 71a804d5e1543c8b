"""The case contract: the lifecycle every case's ``train.py`` implements, and its driver.

A case's entry point reads the resolved config, then hands :func:`run` a factory of
trainers, one per phase (a case without phases has one, whose ``phase`` is None and
whose records carry no ``"phase"``)::

    cfg = runtime.setup()                      # vendor adapter, seeds; before the framework
    log = MetricLogger()
    case.run(lambda phase: MyTrainer(cfg, log, phase), log)

A trainer (:class:`Trainer`) is driven as ``build()``, then ``step(k)`` for k = 1 ..
``steps``, then ``finish()``:

``build()``   what comes before the first step: the process group (its first phase),
              the settings (training/settings.py and the case's own reader), model,
              optimizer and data; the reporting rank sends ``run_meta``
              (training/metriclog.py: ``REQUIRED_META``).
``step(k)``   optimizer step k, timed by training/steptimer.py; the reporting rank
              sends its ``train_step``.
``finish()``  after the last step: every rank sends ``peak_memory``, then the phase's
              own records; memory the next phase needs freed.

The driver writes the rest of the protocol: ``run_end`` ``ok`` from the reporting rank
after ``finish()``; on any failure, on the rank where it happened, ``run_error`` (the
exception and its traceback) and ``run_end`` ``failed``, and the exception goes on up
(the launcher stops the other ranks; no collective teardown that could hang).

Case modules are imported by their package path, ``cases.<family>.<framework>.<module>``
(the repository root is on ``PYTHONPATH``); :func:`isolate` takes the entry point's own
folder off ``sys.path`` first, so a case module named like a library (``kernels``,
``model``, ``data``) never shadows it.  Standard library only.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Trainer(Protocol):
    """One phase of a case's round (see the module docstring)."""

    phase: str | None  # None: a case without phases (its records carry no "phase")
    steps: int  # optimizer steps; set by build() at the latest
    reporting: bool  # this rank sends run_meta, train_step and run_end; set by build() at the latest

    def build(self) -> None: ...

    def step(self, step: int) -> None: ...

    def finish(self) -> None: ...


def run(make: Callable[[str | None], Trainer], log: Any, phases: Sequence[str | None] = (None,)) -> list[Trainer]:
    """Drive ``make(phase)`` for each phase in order through build, steps, finish; write
    ``run_end`` (and on failure ``run_error``). Returns the trainers."""
    done = []
    for phase in phases:
        steps_done = 0
        try:
            trainer = make(phase)
            trainer.build()
            for step in range(1, trainer.steps + 1):
                trainer.step(step)
                steps_done = step
            trainer.finish()
            if trainer.reporting:
                log.end("ok", steps_done, phase=phase)
        except BaseException as exc:
            where = f"{phase}: " if phase is not None else ""
            log.error(f"{where}{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}", phase=phase)
            log.end("failed", steps_done, phase=phase)
            raise
        done.append(trainer)
    return done


def isolate(entry_file: str) -> None:
    """Take the entry point's folder (Python put it first on ``sys.path``) off the path:
    the case's modules are imported as ``cases.<family>.<framework>.<module>``."""
    here = os.path.dirname(os.path.abspath(entry_file))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
