"""The probe forked from rank 0's own process: its framework imports and the vendor's adapter
are made already, which is most of a probe's time on a small case (megatron-core's imports
alone take 3 s of a 4 s probe on one CPU core).

A fork copies one thread and the memory of the rest, so it is made only
- for a run on the CPU (``vendor.device`` cpu): a device runtime that the rank started, even
  only by asking for its devices, cannot be used in a child;
- where the rank runs no other Python thread;
- where the case's probe module declares ``after_fork(cfg)``, which the child calls first.
Else the probe is spawned as ``flagbench conformance`` spawns it, and the verdict says why.
The module's ``before_fork(cfg)``, where it has one, first imports in the rank what the probe
imports and the rank's build would import next.

For torch (:func:`torch_after_fork`): GNU OpenMP's thread pool, once used by the parent, hangs
the child's first parallel region (seen with the CPU wheel of torch 2.x), so the child computes
on one thread, where reductions may round in another order than the run's, far inside the
check's tolerances.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


def refusal(module: Any, cfg: dict[str, Any]) -> str | None:
    """Why the probe cannot be forked from this process, or None."""
    device = str((cfg.get("vendor") or {}).get("device") or "cpu")
    if device != "cpu":
        return f"the run's device is {device}, whose runtime a forked child cannot share"
    if threading.active_count() > 1:
        return f"the rank runs {threading.active_count()} threads"
    if getattr(module, "after_fork", None) is None:
        return f"{module.__name__} declares no after_fork"
    return None


class Forked:
    """A child of this process running ``work()`` (its exit status), with the part of
    ``subprocess.Popen`` the check uses: ``communicate``, ``kill``, ``returncode``. Its output and
    errors go to two files in ``folder``."""

    POLL_S = 0.02

    def __init__(self, work: Callable[[], int], folder: str) -> None:
        self.paths = (os.path.join(folder, "probe.out"), os.path.join(folder, "probe.err"))
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                for fd, path in zip((1, 2), self.paths):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
                # the rank's own streams may be other objects than the two descriptors
                sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
                sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                code = work()
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        self.pid = pid

    def _reap(self, block: bool) -> bool:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode is not None

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._reap(block=deadline is None):
            if time.monotonic() > deadline:  # type: ignore[operator]
                raise subprocess.TimeoutExpired("conformance probe", timeout or 0)
            time.sleep(self.POLL_S)
        texts = []
        for path in self.paths:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    texts.append(fh.read())
            except OSError:
                texts.append("")
        return texts[0], texts[1]

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def torch_after_fork(cfg: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
