"""A second stop signal ends the run at once, saying what may be left on which host.
A real process whose teardown hangs; no mocks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from run_benchmarks.planning.registry import ROOT

HANGING_TEARDOWN = """
import time
from run_benchmarks.running.runtimes.base import stop_on_signals
with stop_on_signals(left_behind=lambda: ["h2: containers marked FLAGBENCH_RUN_ID=r1"]):
    try:
        print("running", flush=True)
        time.sleep(60)
    finally:
        print("tearing down", flush=True)
        time.sleep(60)  # a teardown that waits on a host that does not answer
"""


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_ends_a_hanging_teardown_within_seconds(second):
    p = subprocess.Popen([sys.executable, "-c", HANGING_TEARDOWN], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "running\n"
    p.send_signal(signal.SIGINT)
    assert p.stdout.readline() == "tearing down\n"
    t0 = time.monotonic()
    p.send_signal(second)
    try:
        rc = p.wait(timeout=10)
    finally:
        p.kill()
    assert time.monotonic() - t0 < 5
    assert rc == 130  # the first signal's status
    err = p.stderr.read()
    assert f"{signal.Signals(second).name} again: stopped without finishing the teardown" in err
    assert "may be left: h2: containers marked FLAGBENCH_RUN_ID=r1" in err


def test_the_ssh_runtime_names_each_host_and_what_may_be_left_there():
    from run_benchmarks.planning.config import ClusterConfig
    from run_benchmarks.running.runtimes.ssh import SSHRuntime

    cluster = ClusterConfig(
        backend="ssh",
        runtime="container",
        work_dir="/w",
        hosts=[{"name": "h1", "address": "10.0.0.1"}, {"name": "h2", "address": "10.0.0.2"}],
    )
    rt = SSHRuntime(cluster)
    assert rt.left_behind() == []  # nothing reached yet
    rt.run_id, rt.hosts = "r1", list(cluster.hosts)
    lines = rt.left_behind()
    assert [ln.split(":")[0] for ln in lines] == ["h1", "h2"]
    assert "containers marked FLAGBENCH_RUN_ID=r1" in lines[1] and lines[1].endswith("/w/runs/r1")
