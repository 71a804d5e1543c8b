"""Errors of the remote layer: one class per cause, each naming the host it concerns."""

from __future__ import annotations


class RemoteError(Exception):
    """Base class. ``host`` is the host's name as given in its ``HostSpec``."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.detail = message


class HostUnreachable(RemoteError):
    """No SSH session could be set up: refused, no route, timed out, or the peer hung up."""


class AuthFailed(RemoteError):
    """The server refused our key, or the key file cannot be read."""


class HostKeyUnknown(RemoteError):
    """The host's key is not in the known_hosts file and accepting new keys was not asked for."""

    def __init__(self, host: str, message: str, *, key_type: str, fingerprint: str) -> None:
        super().__init__(host, message)
        self.key_type = key_type
        self.fingerprint = fingerprint


class HostKeyMismatch(RemoteError):
    """The host presented a key that differs from the one recorded in known_hosts."""

    def __init__(self, host: str, message: str, *, key_type: str, fingerprint: str, expected: str) -> None:
        super().__init__(host, message)
        self.key_type = key_type
        self.fingerprint = fingerprint
        self.expected = expected


class TooFewSessions(RemoteError):
    """The server allows fewer sessions (channels) at once on one connection than a run opens
    (sshd's MaxSessions); ``allowed`` is how many it opened."""

    def __init__(self, host: str, message: str, *, allowed: int) -> None:
        super().__init__(host, message)
        self.allowed = allowed


class CommandTimeout(RemoteError):
    """A remote call did not finish within its timeout (the command was killed where we could)."""

    def __init__(self, host: str, message: str, *, timeout: float) -> None:
        super().__init__(host, message)
        self.timeout = timeout


class RemoteCommandFailed(RemoteError):
    """A remote command exited non-zero where success was required, or a transfer failed."""

    def __init__(self, host: str, message: str, *, rc: int | None = None, stderr: str = "") -> None:
        super().__init__(host, message)
        self.rc = rc
        self.stderr = stderr


class LocalWriteFailed(RemoteError):
    """What came from the host could not be written here (this machine's disk full, read-only);
    the message names the local path."""


class ContainerError(RemoteError):
    """Base class of the container-engine errors; ``engine`` names the engine (host or socket).

    A remote error like the others, so that a runtime that handles a lost host also handles
    a lost engine (``host`` is the engine's name: the host's over SSH, else the socket)."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(engine, message)
        self.engine = engine


class EngineUnreachable(ContainerError):
    """The container engine did not answer."""


class HostBusy(RemoteError):
    """Another run holds the host's lock; ``holder`` is what that run recorded in it."""

    refused = True  # the run did not start: its status is "refused", not "failed" (typed_results.run_outcome)

    def __init__(self, host: str, message: str, *, holder: str = "") -> None:
        super().__init__(host, message)
        self.holder = holder


class ImageBuildFailed(ContainerError):
    """``docker build`` failed; ``log`` holds the build output."""

    def __init__(self, engine: str, message: str, *, log: str = "") -> None:
        super().__init__(engine, message)
        self.log = log


class ContainerTimeout(ContainerError):
    """A container did not exit within its timeout."""

    def __init__(self, engine: str, message: str, *, timeout: float) -> None:
        super().__init__(engine, message)
        self.timeout = timeout


__all__ = [
    "AuthFailed",
    "CommandTimeout",
    "ContainerError",
    "ContainerTimeout",
    "EngineUnreachable",
    "HostBusy",
    "HostKeyMismatch",
    "HostKeyUnknown",
    "HostUnreachable",
    "ImageBuildFailed",
    "RemoteCommandFailed",
    "RemoteError",
    "TooFewSessions",
]
