"""Remote execution for real clusters: SSH to hosts and container engines on them.

``ssh`` holds the connection pool (exec, long-running processes, file trees), ``containers``
the docker engine helpers, ``errors`` one exception class per failure cause.
"""

from .errors import (
    AuthFailed,
    CommandTimeout,
    ContainerError,
    ContainerTimeout,
    EngineUnreachable,
    HostBusy,
    HostKeyMismatch,
    HostKeyUnknown,
    HostUnreachable,
    ImageBuildFailed,
    RemoteCommandFailed,
    RemoteError,
)
from .ssh import HostSpec, RemoteProcess, Result, SSHPool, TransferStats, remote_command

__all__ = [
    "AuthFailed",
    "CommandTimeout",
    "ContainerError",
    "ContainerTimeout",
    "EngineUnreachable",
    "HostBusy",
    "HostKeyMismatch",
    "HostKeyUnknown",
    "HostSpec",
    "HostUnreachable",
    "ImageBuildFailed",
    "RemoteCommandFailed",
    "RemoteError",
    "RemoteProcess",
    "Result",
    "SSHPool",
    "TransferStats",
    "remote_command",
]
