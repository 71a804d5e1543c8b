"""A host of the cluster as the SSH layer sees it: its address and how it is trusted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostSpec:
    """One host: how to reach it and how to trust it."""

    name: str
    address: str
    port: int = 22
    user: str = "root"
    key_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"

    @property
    def known_hosts_name(self) -> str:
        """The name under which the host's key is recorded (OpenSSH's form)."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"
