"""The conformance probe forked from rank 0 (training/conformance/forking.py): the child's exit
status, output and errors, its time limit and kill, and when a fork is refused. Real forks of
this process; the runs that fork a probe are in tests/test_conformance.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import pytest

from training.conformance import forking


def test_the_child_returns_its_status_and_output(tmp_path):
    def work() -> int:
        print("probe:    0.10 s imported")
        print("to stderr", file=sys.stderr)
        return 3

    child = forking.Forked(work, str(tmp_path))
    out, err = child.communicate(timeout=30)
    assert child.returncode == 3
    assert out == "probe:    0.10 s imported\n" and err == "to stderr\n"


def test_an_error_in_the_child_is_its_traceback_and_status_1(tmp_path):
    def work() -> int:
        raise ValueError("no such kernel")

    child = forking.Forked(work, str(tmp_path))
    _, err = child.communicate(timeout=30)
    assert child.returncode == 1
    assert "ValueError: no such kernel" in err and "Traceback" in err


def test_a_child_past_its_limit_is_killed(tmp_path):
    child = forking.Forked(lambda: time.sleep(60) or 0, str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        child.communicate(timeout=0.3)
    child.kill()
    child.communicate()
    assert child.returncode == -9 and time.monotonic() - t0 < 30


def _module(**attrs) -> types.ModuleType:
    mod = types.ModuleType("cases.acme.torch.conformance")
    mod.__dict__.update(attrs)
    return mod


def _cfg(device: str | None = None) -> dict:
    return {"vendor": {"device": device} if device else {}}


@pytest.fixture
def one_thread(monkeypatch):
    """The thread count as a rank's main thread alone would see it: the test process's own
    threads (pytest-xdist's channel under ``-n 2``) not counted, those a test starts counted."""
    real, base = threading.active_count, threading.active_count()
    monkeypatch.setattr(forking.threading, "active_count", lambda: real() - base + 1)


def test_a_run_on_the_cpu_forks_a_module_that_declares_after_fork(one_thread):
    from cases.llama3.megatron import conformance as llama3

    assert forking.refusal(llama3, _cfg()) is None
    assert forking.refusal(llama3, _cfg("cpu")) is None


def test_a_device_a_thread_or_no_after_fork_spawns_the_probe(one_thread):
    ready = _module(after_fork=lambda cfg: None)
    assert forking.refusal(ready, _cfg("cuda")) == "the run's device is cuda, whose runtime a forked child cannot share"
    assert forking.refusal(_module(), _cfg()) == "cases.acme.torch.conformance declares no after_fork"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert forking.refusal(ready, _cfg()) == "the rank runs 2 threads"
    finally:
        stop.set()
        thread.join()


def _resolved(tmp_path, *sets: str) -> dict:
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning.casename import CaseName
    from run_benchmarks.planning.config import ClusterConfig

    cluster = ClusterConfig(backend="local", hosts=[{"name": "localhost", "address": "127.0.0.1"}])
    p = planning.build(CaseName.parse("llama3_8b:megatron:H200:1:1"), "nvidia", cluster, tmp_path, None, list(sets))
    return p.resolved(0, str(tmp_path / "output"), str(tmp_path / "cache"))


def test_the_hosts_allocator_switches_are_no_part_of_the_stack(tmp_path):
    """parallel.pinned_register_threads and parallel.expandable_segments set the allocator's
    variable on the host (training/settings.py HOST_KEYS): the check's key is the same with them;
    a switch the probe builds with (the attention kernel) is another stack."""
    from training.conformance import stack_key

    base, _ = stack_key(_resolved(tmp_path), "NVIDIA H200")
    host, _ = stack_key(_resolved(tmp_path, "parallel.pinned_register_threads=16", "parallel.expandable_segments=true"), "NVIDIA H200")
    other, _ = stack_key(_resolved(tmp_path, "parallel.attention=local"), "NVIDIA H200")
    assert host == base and other != base
