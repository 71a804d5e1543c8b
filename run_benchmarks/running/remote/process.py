"""Remote commands: the one place argv is quoted for the remote shell, and long-running processes.

``remote_command`` starts the command in its own process group with ``setsid`` and prints
``FBPGID <pgid>`` on stderr first, so a timed-out or killed command can be ended as a group.
``RemoteProcess`` streams such a command's output into a local file and waits on its real exit.
"""

from __future__ import annotations

import re
import select
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import paramiko

from .errors import CommandTimeout
from .hosts import HostSpec

PGID_MARK = "FBPGID"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BUF = 65536


def remote_command(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    merge_stderr: bool = False,
    stdin: bool = False,
) -> str:
    """The command line sent to the remote shell: the one place argv gets quoted.

    The command runs in a new session/process group; ``FBPGID <pgid>`` is printed on its
    stderr before it starts. With ``merge_stderr`` the command's stderr goes to stdout
    (only the marker stays on stderr). The outer shell waits for it and reports its exit
    status (128+signal when killed). With ``stdin`` the command reads the channel's input (a
    command started with ``&`` would read /dev/null).
    """
    if not argv:
        raise ValueError("argv is empty")
    q = shlex.quote
    parts: list[str] = []
    if cwd:
        parts.append(f"cd -- {q(str(cwd))} || exit;")
    for name, value in (env or {}).items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"invalid environment variable name {name!r}")
        parts.append(f"export {name}={q(str(value))};")
    inner = f'echo "{PGID_MARK} $$" >&2; exec "$@"' + (" 2>&1" if merge_stderr else "")
    if stdin:
        parts.append("exec 3<&0;")
    into = " 0<&3 3<&-" if stdin else ""
    parts.append(f"setsid sh -c {q(inner)} flagbench {' '.join(q(str(a)) for a in argv)}{into} & wait $!")
    return " ".join(parts)


def _split_marker(buf: bytearray) -> tuple[int | None, bool]:
    """Parse and remove the leading ``FBPGID n`` line; (pgid, complete_line_seen)."""
    nl = buf.find(b"\n")
    if nl < 0:
        return None, False
    line = bytes(buf[:nl]).decode("ascii", "replace").split()
    if len(line) == 2 and line[0] == PGID_MARK and line[1].isdigit():
        del buf[: nl + 1]
        return int(line[1]), True
    return None, True


def _pump(
    chan: paramiko.Channel,
    on_out: Callable[[bytes], None],
    on_err: Callable[[bytes], None],
    deadline: float | None,
) -> bool:
    """Read a channel until it is finished (EOF and exit status). False on deadline."""
    while True:
        got = False
        if chan.recv_ready():
            on_out(chan.recv(_BUF))
            got = True
        if chan.recv_stderr_ready():
            on_err(chan.recv_stderr(_BUF))
            got = True
        if got:
            continue
        if chan.closed or (chan.eof_received and chan.exit_status_ready()):
            return True
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        wait_for = 1.0 if remaining is None else min(remaining, 1.0)
        if chan.eof_received:
            chan.status_event.wait(wait_for)  # data done; the exit status is on its way
        else:
            select.select([chan], [], [], wait_for)


class GroupKiller(Protocol):
    """What a ``RemoteProcess`` needs of the pool that started it (``SSHPool``)."""

    def _kill_group(self, spec: HostSpec, pgid: int, chan: paramiko.Channel, grace: float) -> None: ...


class RemoteProcess:
    """A long-running remote command whose combined output streams into a local file."""

    def __init__(
        self,
        pool: GroupKiller,
        spec: HostSpec,
        argv: Sequence[str],
        chan: paramiko.Channel,
        output_path: Path,
        append: bool,
        start_timeout: float,
    ) -> None:
        self.host = spec.name
        self.argv = tuple(argv)
        self.output_path = output_path
        self.pgid: int | None = None
        self._pool = pool
        self._spec = spec
        self._chan = chan
        output_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(output_path, "ab" if append else "wb")
        self._err = bytearray()
        self.write_error: str | None = None
        self._marker_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"remote-output-{spec.name}", daemon=True)
        self._thread.start()
        if not self._marker_done.wait(start_timeout):
            self.kill()
            raise CommandTimeout(
                self.host,
                f"{shlex.join(self.argv)} did not start within {start_timeout}s",
                timeout=start_timeout,
            )

    def _on_err(self, data: bytes) -> None:
        if self._marker_done.is_set():
            self._write(data)
            return
        self._err += data
        pgid, complete = _split_marker(self._err)
        if complete:
            self.pgid = pgid
            self._write(bytes(self._err))
            self._err.clear()
            self._marker_done.set()

    def _write(self, data: bytes) -> None:
        """Into the local file; once that fails (a full disk here), the output is dropped and
        ``write_error`` names the file, while the remote command runs on."""
        if data and self.write_error is None:
            try:
                self._file.write(data)
                self._file.flush()
            except OSError as e:
                self.write_error = f"{self.output_path}: {e.strerror or e} (its output from then on is lost)"

    def _run(self) -> None:
        try:
            _pump(self._chan, self._write, self._on_err, None)
        except (OSError, EOFError, paramiko.SSHException):
            pass
        finally:
            self._write(bytes(self._err))
            self._err.clear()
            try:
                self._file.close()
            except OSError as e:
                self.write_error = self.write_error or f"{self.output_path}: {e.strerror or e}"
            self._marker_done.set()

    def send(self, data: bytes) -> None:
        """Write to the command's input (started with ``stdin``); never blocks: dropped when the
        channel cannot take it now."""
        if self._chan.send_ready():
            self._chan.send(data)

    def close_input(self) -> None:
        """End the command's input (it reads EOF)."""
        self._chan.shutdown_write()

    def poll(self) -> int | None:
        """The exit status if the command finished and its output is written, else None."""
        return None if self._thread.is_alive() else self._chan.exit_status

    def wait(self, timeout: float) -> int:
        """Wait for the remote exit status (-1 if the connection died without one)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CommandTimeout(
                self.host,
                f"{shlex.join(self.argv)} still running after {timeout}s",
                timeout=timeout,
            )
        self._chan.status_event.wait(1.0)
        return self._chan.exit_status

    def kill(self, grace: float = 5.0) -> int | None:
        """TERM the remote process group, KILL it after ``grace`` seconds; the exit status."""
        if self.poll() is not None:
            return self._chan.exit_status  # already ended: its pgid may be reused by now
        if self.pgid is not None:
            self._pool._kill_group(self._spec, self.pgid, self._chan, grace)
        else:
            self._chan.close()
        self._thread.join(grace + 5.0)
        return self._chan.exit_status if self._chan.exit_status_ready() else None

    def __enter__(self) -> RemoteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.poll() is None:
            self.kill()
