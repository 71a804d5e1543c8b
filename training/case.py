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

It also keeps a watch on each call: where the harness sets ``FB_STALL_TIMEOUT_S`` and
``FB_STACKS_DIR``, a ``build()``, ``step(k)`` or ``finish()`` still running after that many
seconds has every thread's stack written to ``FB_STACKS_DIR/rank<RANK>.txt`` (by a thread of
its own, in faulthandler's format; faulthandler itself only where the call holds the
interpreter lock: :class:`StallWatch`; not the conformance check, whose probe is forked from a
rank of one thread). Before the first step ends, where the harness also sets
``FB_STARTUP_TIMEOUT_S``, the stacks come a tenth of that timeout (at least
:data:`STARTUP_LEAD_MIN_S`, at most half) before it, from the process's start, if that is sooner. The harness stops a round whose ranks report nothing for
that long (or never start training) and names, from these files, where each rank waited
(run_benchmarks/running/causes.py); the process groups outlast both (:func:`training.runtime.
process_group_timeout`), so a collective's own timeout never ends a hang before its stacks are
written.

Case modules are imported by their package path, ``cases.<family>.<framework>.<module>``
(the repository root is on ``PYTHONPATH``); :func:`isolate` takes the entry point's own
folder off ``sys.path`` first, so a case module named like a library (``kernels``,
``model``, ``data``) never shadows it.  Standard library only.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import threading
import time
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


class LoopHooks:
    """What a case gives a framework's shared loop (training/megatron_loop.py, paddle_loop.py),
    whatever the framework: its settings, model, data and run_meta fields; the parameter count
    its model must have (training/flops.py's of case.yaml's shape, unless it says otherwise)."""

    cfg: dict[str, Any]

    def read_settings(self, cfg: dict[str, Any], world_size: int) -> Any:
        raise NotImplementedError

    def build_model(self) -> Any:
        raise NotImplementedError

    def make_batches(self) -> tuple[Any, Any]:
        """The data (the step's micro-batches, by the loop's protocol) and run_meta's ``data``."""
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        return {}

    def parallel_meta(self) -> dict[str, Any]:
        return {}

    def expected_params(self) -> int:
        from training import flops, settings

        return int(flops.param_counts(flops.decoder_shape(settings.shape_source(self.cfg["model"])))["total"])


#: written after a stack dump when the call it caught returns after all: that dump is no hang
STACK_DONE = "Finished after"
#: written after a stack dump that came long after its deadline: the process was not running
#: then (stopped by SIGSTOP, resumed by a cancel's SIGCONT), so the stacks are not where it hung
STACK_LATE = "Written late:"
LATE_S = 5.0
#: the stacks of a call before the first step are written this long (at most a tenth of the
#: timeout, at least STARTUP_LEAD_MIN_S) before the harness's startup timeout, measured from the
#: process's start: the launcher's own start-up comes before it
STARTUP_LEAD_MIN_S = 20.0


class StallWatch:
    """Each watched call still running after ``timeout_s`` appends every thread's stack to
    ``path``, in faulthandler's format; a call that ends after its dump adds a line saying so
    (``STACK_DONE``), so only a last dump without one shows where the rank is stuck. Off
    without a timeout.

    The stacks are read by a thread of the watch's own, holding the interpreter lock
    (``sys._current_frames``): while it reads, no Python code runs, so no frame it walks is
    freed under it. faulthandler's watchdog reads them without that lock; with a call still
    busy in Python and threads starting or ending, that crashes the rank it watches
    (CPython issues 116008 and 131580; tests/test_failures_causes.py has such a call). It is
    kept for the one case the watch's thread cannot serve: a call that holds the lock in C
    code. Armed ``FALLBACK_S`` after the timeout, it is cancelled by the first thing the
    watch's thread does once it has the lock, so it fires only on a call that held the lock
    that long, whose frames do not move."""

    FALLBACK_S = 2.0

    def __init__(self, timeout_s: float | None, path: str | None, startup_by: float | None = None) -> None:
        self.timeout_s, self.path = timeout_s, path
        #: time.monotonic() by which a call before the first step has its stacks written (None: no cap)
        self.startup_by = startup_by
        self._file: Any = None
        self._cond = threading.Condition()
        self._deadline: float | None = None  # of the call being watched; None between calls
        self._limit = 0.0  # the seconds the call being watched was given, for the dump's header

    @classmethod
    def from_env(cls) -> StallWatch:
        t, folder = os.environ.get("FB_STALL_TIMEOUT_S"), os.environ.get("FB_STACKS_DIR")
        if not t or not folder:
            return cls(None, None)
        from training import startup
        from training.runtime import dist_info

        by, first = None, os.environ.get("FB_STARTUP_TIMEOUT_S")
        started = startup.process_started()
        if first and started is not None:
            s = float(first)
            lead = min(max(STARTUP_LEAD_MIN_S, 0.1 * s), 0.5 * s)
            by = time.monotonic() + (started + s - lead - startup.now())
        return cls(float(t), os.path.join(folder, f"rank{dist_info().rank}.txt"), by)

    @contextlib.contextmanager
    def watch(self, what: str, before_first_step: bool = False) -> Any:
        """Watch the call in the ``with`` block, named ``what`` (``step 12``) in its end line; a
        call ``before_first_step`` is also given no longer than ``startup_by``."""
        if self.timeout_s is None or self.path is None:
            yield
            return
        if self._file is None:  # opened once and kept: faulthandler writes to its descriptor
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            threading.Thread(target=self._watcher, name="flagbench-stall-watch", daemon=True).start()
        size, t0 = os.fstat(self._file.fileno()).st_size, time.monotonic()
        limit = self.timeout_s
        if before_first_step and self.startup_by is not None:
            limit = max(0.0, min(limit, self.startup_by - t0))
        with self._cond:  # the fallback armed before the deadline, both under the lock the watcher dumps in
            faulthandler.dump_traceback_later(limit + self.FALLBACK_S, repeat=False, file=self._file, exit=False)
            self._deadline, self._limit = t0 + limit, limit
            self._cond.notify()
        try:
            yield
        finally:  # also when ended by an error (a peer stopped as hung resets the connection it
            # waited on): its dump, if any, still shows where it waited
            with self._cond:
                self._deadline = None
                faulthandler.cancel_dump_traceback_later()
        if os.fstat(self._file.fileno()).st_size > size:  # the dump came, then the call returned: slow, not stuck
            self._file.write(f"{STACK_DONE} {time.monotonic() - t0:.1f} s: {what}\n")
            self._file.flush()

    def _watcher(self) -> None:
        with self._cond:
            while True:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                faulthandler.cancel_dump_traceback_later()  # the lock is had: no fallback needed
                late, self._deadline = -left, None
                self._dump()
                if late > LATE_S:
                    self._file.write(f"{STACK_LATE} {late:.1f} s after the deadline (the process was stopped)\n")
                    self._file.flush()

    def _dump(self) -> None:
        """Every other thread's stack, innermost frame first, as faulthandler writes them."""
        me = threading.get_ident()
        lines = [f"Timeout ({datetime.timedelta(seconds=round(self._limit, 3))})!"]
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            lines.append(f"Thread 0x{ident:016x} (most recent call first):")
            f: Any = frame
            while f is not None:
                lines.append(f'  File "{f.f_code.co_filename}", line {f.f_lineno} in {f.f_code.co_name}')
                f = f.f_back
            lines.append("")
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()


def run(
    make: Callable[[str | None], Trainer], log: Any, phases: Sequence[str | None] = (None,), cfg: dict[str, Any] | None = None
) -> list[Trainer]:
    """Drive ``make(phase)`` for each phase in order through build, steps, finish; write
    ``run_end`` (and on failure ``run_error``). Returns the trainers. With the run's ``cfg``,
    rank 0 first runs the conformance check (:func:`conformance_gate`)."""
    from training import startup
    from training.metriclog import K_STARTUP

    done = []
    stall = StallWatch.from_env()
    startup.mark("imports")
    if cfg is not None:
        try:  # not watched: the probe is forked from this rank, which must run one thread then
            conformance_gate(cfg, log)
        except BaseException as exc:
            log.error(f"{type(exc).__name__}: {exc}", phase=phases[0])
            log.end("failed", 0, phase=phases[0])
            raise
        startup.mark("conformance")
    for k, phase in enumerate(phases):
        steps_done = 0
        named = f"{phase} " if phase is not None else ""
        try:
            trainer = make(phase)
            with stall.watch(f"{named}build", before_first_step=k == 0):
                trainer.build()
            if k == 0:
                startup.mark("build")
            for step in range(1, trainer.steps + 1):
                with stall.watch(f"{named}step {step}", before_first_step=k == 0 and step == 1):
                    trainer.step(step)
                steps_done = step
                if k == 0 and step == 1:
                    startup.mark("first_step")
                    if getattr(trainer, "reporting", False):
                        log.info(K_STARTUP, startup.record(), phase=phase)
            with stall.watch(f"{named}finish"):
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


def conformance_gate(cfg: dict[str, Any], log: Any) -> None:
    """On rank 0, the conformance check of the run's stack (training/conformance/), its verdict
    sent as the ``conformance`` record; a failed check ends the run before training
    (``NonConformant``), as does a probe that cannot finish. The other ranks go on to build and
    wait for rank 0 in the process group's start."""
    from training import conformance, runtime, startup
    from training.metriclog import K_CONFORMANCE

    if runtime.dist_info().rank != 0:
        return
    conformance.preload(cfg)
    startup.mark("imports")
    path = runtime.CONFIG_PATH
    if path is None:
        raise RuntimeError("the conformance check needs the run's resolved.json: training.runtime.setup() reads it")
    try:
        verdict = conformance.check(cfg, path, in_rank=True)
    except conformance.ProbeError as exc:
        log.info(K_CONFORMANCE, {"verdict": "error", "message": str(exc), "cached": False})
        print(exc.tail, file=sys.stderr, flush=True)
        raise
    log.info(K_CONFORMANCE, verdict)
    if verdict["verdict"] == "failed":
        raise conformance.NonConformant(f"conformance check failed: {verdict['message']}")


def isolate(entry_file: str) -> None:
    """Take the entry point's folder (Python put it first on ``sys.path``) off the path:
    the case's modules are imported as ``cases.<family>.<framework>.<module>``."""
    here = os.path.dirname(os.path.abspath(entry_file))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
