"""SSH to benchmark hosts: one reused connection per host, strict host keys, bounded calls.

``SSHPool`` opens one paramiko ``Transport`` per host (in parallel), on a socket we create
with ``TCP_NODELAY`` (without it every exec pays ~45 ms of Nagle + delayed ACK). A host
that stops answering (down, or dropping packets) is lost within ``lost_after`` seconds on
every call, whatever that call's own timeout: the transport sends a keepalive every third
of it and the kernel drops a connection whose data stays unacknowledged that long
(``TCP_USER_TIMEOUT``), which closes every channel on it. Host keys
are checked against a known_hosts file; an unknown key is accepted only when
``accept_new_host_keys=True`` is passed, and it is then written to that file. Only key
authentication is used (the SSH agent only with ``allow_agent=True``).

Every remote command goes through ``remote_command`` (``process.py``), the one place where argv is quoted
for the remote shell. It starts the command in its own process group with ``setsid`` and
prints ``FBPGID <pgid>`` on stderr first, so a timed-out or killed command can be ended
as a group (``kill -TERM -<pgid>``, then ``KILL`` after a grace period). The remote login
shell must be POSIX (sh, bash, dash, zsh).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko

from .errors import (
    AuthFailed,
    CommandTimeout,
    HostKeyMismatch,
    HostKeyUnknown,
    HostUnreachable,
    RemoteCommandFailed,
    TooFewSessions,
)
from .hosts import HostSpec
from .process import PGID_MARK, RemoteProcess, _pump, _split_marker, remote_command
from .transfer import TransferMixin, TransferStats

# paramiko logs a lost connection's late packets ("Success for unrequested channel") and
# its own tracebacks; the errors raised here name the host and the cause instead
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

#: sessions (channels) a run opens at once on one host's connection: the host's lock, the
#: node's agent, a command or a file transfer beside them, and the docker SDK's connections
#: (one ``docker system dial-stdio`` channel each). OpenSSH's default MaxSessions is 10:
#: a server allowing fewer is refused when it is connected, before anything runs there.
SESSIONS_NEEDED = 10
SESSION_RETRY_S = 2.0  # a refused session is asked for again this long (see SSHPool.session)


@dataclass(frozen=True)
class Result:
    """A finished remote command."""

    rc: int
    stdout: str
    stderr: str
    duration: float
    host: str = ""
    argv: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self) -> Result:
        """Return self, or raise ``RemoteCommandFailed`` if the command exited non-zero."""
        if self.rc != 0:
            raise RemoteCommandFailed(
                self.host,
                f"{shlex.join(self.argv)} exited {self.rc}: {self.stderr.strip()[-2000:]}",
                rc=self.rc,
                stderr=self.stderr,
            )
        return self


def _bound_silence(sock: socket.socket, seconds: float) -> None:
    """Have the kernel drop the connection once sent data stays unacknowledged, or an idle
    peer answers no probe, for ``seconds``."""
    probe = max(1, int(seconds / 3))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class SSHPool(TransferMixin):
    """One SSH connection per host, opened in parallel and reused by every call."""

    def __init__(
        self,
        hosts: Iterable[HostSpec],
        *,
        accept_new_host_keys: bool = False,
        allow_agent: bool = False,
        connect_timeout: float = 10.0,
        lost_after: float = 30.0,
        sessions_needed: int = SESSIONS_NEEDED,
    ) -> None:
        self.hosts: dict[str, HostSpec] = {}
        for spec in hosts:
            if spec.name in self.hosts:
                raise ValueError(f"duplicate host name {spec.name!r}")
            self.hosts[spec.name] = spec
        self.accept_new_host_keys = accept_new_host_keys
        self.allow_agent = allow_agent
        self.connect_timeout = connect_timeout
        self.lost_after = lost_after
        self.sessions_needed = sessions_needed
        self._conns: dict[str, paramiko.Transport] = {}
        self._host_locks = {name: threading.Lock() for name in self.hosts}
        self._known_hosts_lock = threading.Lock()
        self.reached: set[str] = set()  # the hosts connected to at least once

    # -- connections -------------------------------------------------------------------
    def _spec(self, host: str | HostSpec) -> HostSpec:
        name = host.name if isinstance(host, HostSpec) else host
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"unknown host {name!r}; known: {sorted(self.hosts)}") from None

    def connect(self, hosts: Iterable[str | HostSpec] | None = None) -> None:
        """Connect to the given hosts (default all) in parallel; raise the first failure.

        When several hosts fail, the first one's exception carries the others in
        ``.other_errors``.
        """
        specs = [self._spec(h) for h in (hosts if hosts is not None else self.hosts)]
        if not specs:
            return
        with ThreadPoolExecutor(max_workers=min(32, len(specs))) as ex:
            futures = [ex.submit(self.transport, s) for s in specs]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            first = errors[0]
            first.other_errors = errors[1:]  # type: ignore[attr-defined]
            raise first

    def transport(self, host: str | HostSpec) -> paramiko.Transport:
        """The host's live transport, connecting (or reconnecting) when needed."""
        spec = self._spec(host)
        with self._host_locks[spec.name]:
            t = self._conns.get(spec.name)
            if t is not None and t.is_active():
                return t
            if t is not None:
                t.close()
            t = self._open(spec)
            self._conns[spec.name] = t
            return t

    def _open(self, spec: HostSpec) -> paramiko.Transport:
        timeout = self.connect_timeout
        where = f"{spec.address}:{spec.port}"
        deadline = time.monotonic() + timeout  # TCP connect, banner and key exchange together
        try:
            sock = socket.create_connection((spec.address, spec.port), timeout=timeout)
        except TimeoutError:
            raise HostUnreachable(spec.name, f"connecting to {where} timed out after {timeout:g}s") from None
        except OSError as e:
            raise HostUnreachable(spec.name, f"cannot connect to {where}: {e.strerror or e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _bound_silence(sock, self.lost_after)
        transport = paramiko.Transport(sock)
        left = max(1.0, deadline - time.monotonic())
        transport.banner_timeout = left
        transport.handshake_timeout = left
        transport.auth_timeout = timeout
        try:
            known = self._load_known_hosts(spec)
            recorded = known.lookup(spec.known_hosts_name)
            if recorded:
                opts = transport.get_security_options()
                preferred = [k for k in opts.key_types if k in recorded or (k.startswith("rsa-sha2") and "ssh-rsa" in recorded)]
                opts.key_types = preferred + [k for k in opts.key_types if k not in preferred]
            try:
                transport.start_client(timeout=left)
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise HostUnreachable(spec.name, self._no_handshake(transport, where, timeout, e)) from e
            if not transport.initial_kex_done:  # start_client returns at its timeout, unfinished
                raise HostUnreachable(spec.name, self._no_handshake(transport, where, timeout, None))
            self._check_host_key(spec, transport.get_remote_server_key(), known)
            self._authenticate(spec, transport)
            self._check_sessions(spec, transport, where)
            transport.set_keepalive(max(1, int(self.lost_after / 3)))
            self.reached.add(spec.name)
            return transport
        except BaseException:
            transport.close()
            raise

    def _check_sessions(self, spec: HostSpec, transport: paramiko.Transport, where: str) -> None:
        """Open ``sessions_needed`` sessions at once (then close them): a server that refuses
        one (sshd's MaxSessions below it) is named with the number it allowed."""
        opened: list[paramiko.Channel] = []
        try:
            while len(opened) < self.sessions_needed:
                try:
                    opened.append(transport.open_session(timeout=self.connect_timeout))
                except paramiko.ChannelException as e:
                    n = len(opened)
                    raise TooFewSessions(
                        spec.name,
                        f"{where} allows {n} session{'s' * (n != 1)} at once on one SSH connection "
                        f"(the server refused the next: {e.text}; sshd_config MaxSessions {n}?); runs need "
                        f"{self.sessions_needed} (OpenSSH's default): set MaxSessions {self.sessions_needed} or more there",
                        allowed=n,
                    ) from None
                except (paramiko.SSHException, OSError, EOFError) as e:
                    raise HostUnreachable(spec.name, f"cannot open a channel: {e}") from e
        finally:
            for chan in opened:
                chan.close()

    @staticmethod
    def _no_handshake(transport: paramiko.Transport, where: str, timeout: float, exc: BaseException | None) -> str:
        """Why the SSH handshake did not finish: no banner (a listener that accepts and says
        nothing: sshd stopped or hung, or not an SSH server), or no key exchange."""
        if not transport.remote_version:
            if exc is None or "banner" in str(exc):
                return (
                    f"{where} accepts connections but sent no SSH banner within {timeout:g} s "
                    "(connect_timeout_s): its sshd is hung or stopped, or the port is not SSH"
                )
        elif exc is None:
            return f"{where} ({transport.remote_version}) did not finish the SSH key exchange within {timeout:g} s (connect_timeout_s)"
        return f"SSH handshake with {where} failed: {exc}"

    def _load_known_hosts(self, spec: HostSpec) -> paramiko.HostKeys:
        path = os.path.expanduser(spec.known_hosts)
        keys = paramiko.HostKeys()
        if os.path.exists(path):
            keys.load(path)
        return keys

    def _check_host_key(self, spec: HostSpec, key: paramiko.PKey, known: paramiko.HostKeys) -> None:
        name = spec.known_hosts_name
        path = os.path.expanduser(spec.known_hosts)
        recorded = known.lookup(name)
        if recorded is not None and key.get_name() in recorded:
            expected = recorded[key.get_name()]
            if expected != key:
                raise HostKeyMismatch(
                    spec.name,
                    f"host key for {name} has CHANGED: got {key.get_name()} "
                    f"{fingerprint(key)}, {path} has {fingerprint(expected)}. "
                    "Refusing to connect; if the host was reinstalled, remove its old "
                    "entry from the known_hosts file.",
                    key_type=key.get_name(),
                    fingerprint=fingerprint(key),
                    expected=fingerprint(expected),
                )
            return
        if not self.accept_new_host_keys:
            raise HostKeyUnknown(
                spec.name,
                f"host key for {name} ({key.get_name()} {fingerprint(key)}) is not in "
                f"{path}; verify it and add it, or connect once with "
                "accept_new_host_keys=True to record it",
                key_type=key.get_name(),
                fingerprint=fingerprint(key),
            )
        line = f"{name} {key.get_name()} {key.get_base64()}\n"
        with self._known_hosts_lock:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "r+b") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = "\n" + line
                f.write(line.encode())

    def _authenticate(self, spec: HostSpec, transport: paramiko.Transport) -> None:
        tried: list[str] = []
        if spec.key_file:
            path = os.path.expanduser(spec.key_file)
            try:
                pkey = paramiko.PKey.from_path(path)
            except (paramiko.PasswordRequiredException, TypeError) as e:  # cryptography's word for it: TypeError
                if isinstance(e, TypeError) and "password" not in str(e).lower() and "encrypted" not in str(e).lower():
                    raise
                raise AuthFailed(
                    spec.name,
                    f"key file {path} is protected by a passphrase, and runs ask for none: "
                    "give the hosts a key without one (key_file of the cluster file)",
                ) from None
            except (OSError, paramiko.SSHException, ValueError) as e:
                raise AuthFailed(spec.name, f"cannot load key file {path}: {e}") from e
            tried.append(path)
            try:
                transport.auth_publickey(spec.user, pkey)
            except paramiko.AuthenticationException:
                pass
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise HostUnreachable(spec.name, f"connection lost during auth: {e}") from e
        if not transport.is_authenticated() and self.allow_agent:
            for agent_key in paramiko.Agent().get_keys():
                tried.append(f"agent:{fingerprint(agent_key)}")
                try:
                    transport.auth_publickey(spec.user, agent_key)
                    break
                except paramiko.AuthenticationException:
                    continue
        if not transport.is_authenticated():
            what = ", ".join(tried) if tried else "no key (key_file unset, agent not allowed)"
            raise AuthFailed(spec.name, f"{spec.user}@{spec.address}:{spec.port} refused {what}")

    def session(self, host: str | HostSpec, transport: paramiko.Transport, timeout: float) -> paramiko.Channel:
        """A new session channel on the host's ``transport``. A refusal is tried again for
        ``SESSION_RETRY_S``: a session just closed here is free at the server only once its
        own close has come back; then it raises ``RemoteCommandFailed`` naming the host."""
        spec = self._spec(host)
        end = time.monotonic() + SESSION_RETRY_S
        while True:
            try:
                return transport.open_session(timeout=timeout)
            except paramiko.ChannelException as e:
                if time.monotonic() >= end:
                    raise RemoteCommandFailed(
                        spec.name, f"the server refused a channel ({e.text}): more sessions at once than its MaxSessions?"
                    ) from None
                time.sleep(0.02)

    def _open_channel(self, spec: HostSpec, timeout: float) -> paramiko.Channel:
        transport = self.transport(spec)
        try:
            return self.session(spec, transport, timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if transport.is_active():
                raise HostUnreachable(spec.name, f"cannot open a channel: {e}") from e
        try:
            return self.session(spec, self.transport(spec), timeout)  # reconnected once
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(spec.name, f"cannot open a channel: {e}") from e

    # -- commands ----------------------------------------------------------------------
    def run(
        self,
        host: str | HostSpec,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        *,
        check: bool = False,
        kill_grace: float = 2.0,
    ) -> Result:
        """Run argv on host and collect its output; the command is killed on timeout."""
        spec = self._spec(host)
        start = time.monotonic()
        deadline = start + timeout
        command = remote_command(argv, env=env, cwd=cwd)
        out, err = bytearray(), bytearray()
        chan = self._open_channel(spec, timeout)
        try:
            chan.exec_command(command)
            finished = _pump(chan, out.extend, err.extend, deadline)
        except (paramiko.SSHException, OSError, EOFError) as e:
            chan.close()
            raise HostUnreachable(spec.name, f"connection lost running {argv[0]}: {e}") from e
        pgid, _ = _split_marker(err)
        if not finished:
            if pgid is not None:
                self._kill_group(spec, pgid, chan, kill_grace)
            chan.close()
            raise CommandTimeout(spec.name, f"{shlex.join(argv)} timed out after {timeout}s", timeout=timeout)
        chan.status_event.wait(1.0)
        rc = chan.exit_status
        chan.close()
        if rc == -1 and not chan.get_transport().is_active():  # closed with the connection, no status
            raise HostUnreachable(spec.name, f"connection lost running {argv[0]} (no answer for {self.lost_after:g}s)")
        result = Result(
            rc=rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            duration=time.monotonic() - start,
            host=spec.name,
            argv=tuple(str(a) for a in argv),
        )
        return result.check() if check else result

    def run_all(
        self, argv: Sequence[str], timeout: float, hosts: Iterable[str | HostSpec] | None = None, **kwargs: object
    ) -> dict[str, Result]:
        """``run`` on several hosts in parallel; results by host name."""
        specs = [self._spec(h) for h in (hosts if hosts is not None else self.hosts)]
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(specs)))) as ex:
            futures = {s.name: ex.submit(self.run, s, argv, timeout, **kwargs) for s in specs}
        return {name: f.result() for name, f in futures.items()}

    def start(
        self,
        host: str | HostSpec,
        argv: Sequence[str],
        stdout_path_local: str | os.PathLike[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        append: bool = False,
        start_timeout: float | None = None,
        stdin: bool = False,
    ) -> RemoteProcess:
        """Start a long-running command; its stdout+stderr stream into a local file."""
        spec = self._spec(host)
        start_timeout = start_timeout or max(self.connect_timeout, 10.0)
        chan = self._open_channel(spec, start_timeout)
        try:
            chan.exec_command(remote_command(argv, env=env, cwd=cwd, merge_stderr=True, stdin=stdin))
        except (paramiko.SSHException, OSError, EOFError) as e:
            chan.close()
            raise HostUnreachable(spec.name, f"connection lost starting {argv[0]}: {e}") from e
        return RemoteProcess(self, spec, argv, chan, Path(stdout_path_local), append, start_timeout)

    def _kill_group(self, spec: HostSpec, pgid: int, chan: paramiko.Channel, grace: float) -> None:
        """TERM the group, wait up to ``grace`` for the command's exit, then KILL the rest."""
        if pgid <= 1:
            raise ValueError(f"refusing to signal process group {pgid}")
        bound = max(self.connect_timeout, 10.0)
        self._signal(spec, pgid, "TERM", bound)
        chan.status_event.wait(grace)
        self._signal(spec, pgid, "KILL", bound)

    def _signal(self, spec: HostSpec, pgid: int, sig: str, timeout: float) -> None:
        kill_chan = self._open_channel(spec, timeout)
        try:
            # A fixed, unquoted command: pgid is an int and sig one of two literals.
            kill_chan.exec_command(f"kill -{sig} -- -{int(pgid)} 2>/dev/null; exit 0")
            if not _pump(kill_chan, lambda b: None, lambda b: None, time.monotonic() + timeout):
                raise CommandTimeout(spec.name, f"kill -{sig} -{pgid} timed out", timeout=timeout)
        finally:
            kill_chan.close()

    # -- files -------------------------------------------------------------------------
    def close(self) -> None:
        """Close every connection."""
        for name in list(self._conns):
            with self._host_locks[name]:
                t = self._conns.pop(name, None)
                if t is not None:
                    t.close()

    def __enter__(self) -> SSHPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "HostSpec",
    "PGID_MARK",
    "SESSIONS_NEEDED",
    "RemoteProcess",
    "Result",
    "SSHPool",
    "TransferStats",
    "fingerprint",
    "remote_command",
]
