"""--wait: a run queues behind the run that holds its host, says so once, and gives up at
its bound. Real runs of start_task.py against a lock held by this test (local runtime),
and real host locks on the test cluster's sshd hosts (SSH runtime)."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time

import pytest

from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running.remote import hostlock
from run_benchmarks.running.remote.errors import HostBusy
from run_benchmarks.running.remote.ssh import SSHPool

START = [sys.executable, str(ROOT / "run_benchmarks" / "start_task.py"), "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:1"]


def _hold(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fh.write("run other-run (pid 1, since then)\n")
    fh.flush()
    return fh


def _env(tmp_path):
    import os

    return {**os.environ, "FLAGBENCH_LOCK_DIR": str(tmp_path / "locks")}


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_local_run_waits_at_most_its_bound(tmp_path):
    held = _hold(tmp_path / "locks" / "local.lock")
    argv = [*START, "--log-dir", str(tmp_path / "logs"), "--python", sys.executable, "--wait", "3s"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    held.close()
    assert res.returncode == 2, res.stderr
    waiting = [ln for ln in res.stderr.splitlines() if ln.startswith("waiting: this host is busy: run other-run")]
    assert len(waiting) == 1, res.stderr  # said once, not at every try
    assert res.stderr.strip().splitlines()[-1].endswith("(still, after waiting 3s: --wait)")


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_local_run_takes_the_host_once_it_is_free(tmp_path):
    path = tmp_path / "locks" / "local.lock"
    held = _hold(path)
    argv = [*START, "--log-dir", str(tmp_path / "logs"), "--python", sys.executable, "--wait", "2m"]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        for line in p.stderr:  # the run says it waits
            if line.startswith("waiting: this host is busy"):
                break
        else:
            pytest.fail(f"the run ended without waiting: {p.wait()}")
        held.close()
        end = time.monotonic() + 30
        while True:  # the run takes the lock within a few tries
            with open(path, "a+") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    break
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < end, "the run did not take the free host"
            time.sleep(0.2)
    finally:
        p.terminate()
        p.wait(timeout=60)


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.cluster
def test_hosts_held_by_another_run_are_waited_for_then_taken(cluster, monkeypatch):
    monkeypatch.setattr(hostlock, "WAIT_POLL_S", 0.5)
    said: list[str] = []
    with SSHPool(cluster.host_specs()) as pool:
        first = hostlock.lock_hosts(pool, ["h2"], "run-a", 10)
        t0 = time.monotonic()
        with pytest.raises(HostBusy, match=r"^h2: in use by run run-a .* still, after waiting 2s \(--wait\)$"):
            hostlock.lock_hosts(pool, ["h1", "h2"], "run-b", 10, wait_s=2, say=said.append)
        assert 2 <= time.monotonic() - t0 < 10
        assert len(said) == 1 and said[0].startswith("waiting for h2: in use by run run-a")
        threading.Timer(1.5, lambda: [lock.release() for lock in first]).start()
        taken = hostlock.lock_hosts(pool, ["h1", "h2"], "run-b", 10, wait_s=60, say=said.append)
        assert sorted(lock.host for lock in taken) == ["h1", "h2"]
        for lock in taken:
            lock.release()
