"""The lease that ends a Slurm job's ranks once the orchestrator that follows the job is gone.

The orchestrator (the slurm runtime, on the submit host) holds one lease per round, a small
file in the round's folder, ``<round_dir>/slurm/lease``, on the filesystem the submit host
and the nodes share: ``Renewer`` rewrites it every ``RENEW_S`` seconds with a new count. On
every node the node wrapper (slurm_node) runs ``watch`` beside its launcher: it reads the
file every ``CHECK_S`` seconds and, when the text has not changed for ``lease_s`` seconds
(the orchestrator SIGKILLed, its machine lost), or says ``end`` (the orchestrator gave the
job up, e.g. Slurm no longer answers it), stops its launcher as scancel would: SIGTERM,
SIGKILL after the node wrapper's grace, and exits. ``srun --kill-on-bad-exit`` then ends the
step and the batch script, and the job ends by itself.

Why a file and not the job's time limit pushed forward with ``scontrol update``: raising a
job's time limit is an operator's right in Slurm (a user may only lower it), and it needs the
controller and munge on both sides, which is what fails when munge is lost; the run folder
is shared already (the runtime needs it) and reading it needs neither. Only a change of the
text counts, timed by the node's own clock, so the clocks of the submit host and the nodes
need not agree; the file is written in place (not replaced), so an NFS client's open sees
the new text (close-to-open) rather than a cached name. A hung shared filesystem holds the
reads too: then only the job's time limit ends it. Standard library only (it runs on the
nodes).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

RENEW_S = 2.0  # how often the orchestrator rewrites the lease
CHECK_S = 1.0  # how often a node reads it
END = "end"  # the first word of a lease the orchestrator ended


class Renewer(threading.Thread):
    """Rewrites ``path`` every ``every`` seconds until ``stop()``; ``end(why)`` tells the
    nodes to stop their ranks now. A failed write (a full disk) is tried again next time."""

    def __init__(self, path: Path, every: float = RENEW_S) -> None:
        super().__init__(name="slurm-lease", daemon=True)
        self.path, self.every, self.count = path, every, 0
        self._halt = threading.Event()
        self._write(f"{self.count} renewed")

    def _write(self, text: str) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, f"{text} {time.time():.3f}\n".encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.count += 1
            self._write(f"{self.count} renewed")

    def stop(self) -> None:
        self._halt.set()

    def end(self, why: str) -> None:
        """No more renewals, and the nodes told to stop their ranks at their next read."""
        self.stop()
        self._write(f"{END} {' '.join(why.split())}")


def read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def watch(path: Path, lease_s: float, on_lapse: Callable[[str], None], check_s: float = CHECK_S) -> threading.Thread:
    """A daemon thread calling ``on_lapse(why)`` once, when the lease at ``path`` has not
    changed for ``lease_s`` seconds or was ended. An unreadable file counts as unchanged."""

    def run() -> None:
        last, changed_at = read(path), time.monotonic()
        while True:
            time.sleep(check_s)
            text = read(path)
            if text is not None and text.startswith(END + " "):
                why = text[len(END) + 1 :].rsplit(" ", 1)[0].strip()
                on_lapse(f"the orchestrator ended the run's lease ({why})")
                return
            now = time.monotonic()
            if text is not None and text != last:
                last, changed_at = text, now
            elif now - changed_at > lease_s:
                on_lapse(f"the run's lease {path} was not renewed for {lease_s:g} s: its orchestrator (start_task.py) is gone")
                return

    thread = threading.Thread(target=run, name="lease-watch", daemon=True)
    thread.start()
    return thread
