"""One run at a time on a host: a lock held on the host for as long as the run's SSH connection lives.

Two runs on the same hosts would share devices and ports and falsify each other's figures,
so a run takes every host's lock before it touches anything there, and a second run is
refused with a line naming the host and the run that holds it.

The lock is ``flock`` on ``flagbench.lock`` in the first writable directory of
``LOCK_DIRS`` (``/run/lock`` on Debian and Ubuntu: per boot, shared by all users). A small
Python process on the host takes it and holds it: it writes the holder's description into
the file, then waits until its stdout reports a hang-up, which happens when the SSH
channel it runs in closes (the run released it, ended, or died and its connection with
it). So a run killed without any teardown does not block the host for long. It writes a
byte every 2 s, so that sshd learns of a client that went while the host's packets were
dropped (the reset its next write meets) once they flow again.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .errors import HostBusy, RemoteCommandFailed
from .ssh import SSHPool

LOCK_DIRS = ("/run/lock", "/var/lock", "/tmp")
BUSY_EXIT = 75  # EX_TEMPFAIL
WAIT_POLL_S = 5.0  # how often a run that waits for a busy host tries again
# Runs on the host under its python3 (the harness's code may not be there yet).
HOLDER = r"""
import fcntl, os, select, sys
info, dirs = sys.argv[1], sys.argv[2:]
where = next(d for d in dirs if os.path.isdir(d) and os.access(d, os.W_OK))
path = os.path.join(where, "flagbench.lock")
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print("BUSY", os.pread(fd, 4096, 0).decode(errors="replace").strip() or "{}", flush=True)
    sys.exit(75)
os.ftruncate(fd, 0)
os.pwrite(fd, info.encode(), 0)
print("LOCKED", path, flush=True)
poller = select.poll()
poller.register(sys.stdout.fileno(), 0)  # only errors and hang-ups: the channel is gone
while not poller.poll(2000):
    try:  # a byte now and then: sshd finds a client that vanished unheard (its packets dropped)
        os.write(sys.stdout.fileno(), b".")
    except OSError:
        break
"""


def holder_info(run_id: str) -> str:
    """What a run records in the lock: who to ask about it."""
    return json.dumps(
        {
            "run_id": run_id,
            "by": f"{getpass.getuser()}@{socket.gethostname()}",
            "pid": os.getpid(),
            "since": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
    )


def describe_holder(text: str) -> str:
    try:
        h: dict[str, Any] = json.loads(text)
    except ValueError:
        return "another run"
    return f"run {h.get('run_id', '?')} ({h.get('by', '?')}, pid {h.get('pid', '?')}, since {h.get('since', '?')})"


class HostLock:
    """The lock of one host; ``release`` (or the connection's end) frees it."""

    def __init__(self, pool: SSHPool, host: str, run_id: str, timeout: float) -> None:
        self.host = host
        fd, out = tempfile.mkstemp(prefix=f"flagbench-lock-{host}-")
        os.close(fd)
        self._out = Path(out)
        self._proc = pool.start(host, ["python3", "-c", HOLDER, holder_info(run_id), *LOCK_DIRS], self._out, start_timeout=timeout)
        try:
            self._wait_answer(timeout)
        except BaseException:
            self.release()
            raise

    def _wait_answer(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self._out.read_text(errors="replace").partition("\n")
            if line[1]:  # a whole first line
                word, _, rest = line[0].partition(" ")
                if word == "LOCKED":
                    self.path = rest
                    return
                if word == "BUSY":
                    raise HostBusy(
                        self.host,
                        f"in use by {describe_holder(rest)}: one run at a time per host; wait for it to end (--wait DURATION queues behind it), or stop it first",
                        holder=rest,
                    )
                break
            if self._proc.poll() is not None:
                break
            time.sleep(0.05)
        text = self._out.read_text(errors="replace").strip()
        raise RemoteCommandFailed(self.host, f"could not take the host's lock: {text[-300:] or 'no answer from python3'}")

    def release(self) -> None:
        """Free the lock (ends the holder); safe to call more than once."""
        try:
            if self._proc.poll() is None:
                self._proc.kill(grace=2.0)
        except Exception:
            pass
        self._out.unlink(missing_ok=True)


def lock_hosts(
    pool: SSHPool,
    hosts: list[str],
    run_id: str,
    timeout: float,
    wait_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> list[HostLock]:
    """Take every host's lock, in parallel; if one is refused, free the others. Then, with
    ``wait_s``, try again every ``WAIT_POLL_S`` until that bound (saying once per holder
    who is waited for), else raise (the first host's error in the given order). All or
    none at each try, so two runs waiting for the same hosts cannot block each other."""
    end = time.monotonic() + wait_s
    said = None
    while True:
        try:
            return _lock_all(pool, hosts, run_id, timeout)
        except HostBusy as exc:
            left = end - time.monotonic()
            if wait_s <= 0:
                raise
            if left <= 0:
                why = f"in use by {describe_holder(exc.holder)} still, after waiting {wait_s:g}s (--wait)"
                raise HostBusy(exc.host, why, holder=exc.holder) from None
            if say is not None and (exc.host, exc.holder) != said:
                said = (exc.host, exc.holder)
                say(f"waiting for {exc}; up to {left:.0f}s more")
            time.sleep(min(WAIT_POLL_S, left))


def _lock_all(pool: SSHPool, hosts: list[str], run_id: str, timeout: float) -> list[HostLock]:
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts)))) as ex:
        futures = [ex.submit(HostLock, pool, h, run_id, timeout) for h in hosts]
    locks = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for lock in locks:
            lock.release()
        raise errors[0]
    return locks


__all__ = ["BUSY_EXIT", "HOLDER", "LOCK_DIRS", "HostLock", "describe_holder", "holder_info", "lock_hosts"]
