"""A host that silently drops packets is lost within ``lost_after``, whatever the call:
a running command, a long-running process, a transfer. Real sshd hosts of the test
cluster; the drop is an iptables rule inside the host's own network namespace."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from run_benchmarks.running.remote.errors import RemoteError
from run_benchmarks.running.remote.ssh import SSHPool
from tests.cluster import netns

LOST_AFTER = 6.0


def _drop(host: netns.HostInfo, on: bool) -> None:
    for chain in ("INPUT", "OUTPUT"):
        argv = ["ip", "netns", "exec", host.netns, "iptables", "-I" if on else "-D", chain, "-j", "DROP"]
        subprocess.run(argv, check=on, capture_output=True, timeout=10)


@pytest.fixture
def silent_h2(cluster: netns.Cluster) -> Iterator[netns.HostInfo]:
    h2 = cluster.host("h2")
    yield h2
    _drop(h2, False)


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.cluster
def test_a_host_dropping_packets_is_lost_within_lost_after_in_every_call(cluster, silent_h2, tmp_path):
    with SSHPool(cluster.host_specs(), connect_timeout=3, lost_after=LOST_AFTER) as pool:
        pool.connect()
        proc = pool.start("h2", ["sleep", "300"], tmp_path / "out.log")
        threading.Timer(1.0, _drop, (silent_h2, True)).start()
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="^h2: "):
            pool.run("h2", ["sleep", "120"], timeout=120)  # its own timeout does not matter
        assert time.monotonic() - t0 < LOST_AFTER + 8
        while proc.poll() is None:  # the long-running process ends with the connection
            assert time.monotonic() - t0 < LOST_AFTER + 10, "the process still looks alive"
            time.sleep(0.2)
        t1 = time.monotonic()
        with pytest.raises(RemoteError, match="^h2: "):
            pool.get_tree("h2", "/tmp", tmp_path / "logs", timeout=600)
        assert time.monotonic() - t1 < 3 + 5  # one reconnect, bounded by connect_timeout
        assert pool.run("h1", ["true"], timeout=10).ok  # the other host is unaffected
