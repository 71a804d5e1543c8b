"""One run at a time on this host: a second local run is refused at once with the holder's
run and pid (exit 2, nothing started), and the lock goes with the first run, also when that
run is killed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_benchmarks.planning.registry import ROOT

START = str(ROOT / "run_benchmarks" / "start_task.py")
CASE = "llama3_tiny:megatron:cpu:1:1"


def start(log_dir: Path, python: str, *extra: str) -> list[str]:
    return [sys.executable, START, "--vendor", "cpu", "--case_name", CASE, "--log-dir", str(log_dir), "--python", python, *extra]


@pytest.mark.framework("megatron")
def test_a_second_local_run_is_refused_while_one_runs(tmp_path, megatron_python):
    first = subprocess.Popen(
        start(tmp_path / "a", megatron_python, "--set", "train.steps=100000"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        end = time.monotonic() + 120
        while not list((tmp_path / "a").glob("*/round1/node0")) and time.monotonic() < end:
            assert first.poll() is None, first.stdout.read() if first.stdout else ""
            time.sleep(0.2)
        (run_a,) = (tmp_path / "a").iterdir()
        second = subprocess.run(start(tmp_path / "b", megatron_python), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: this host is busy: run {run_a.name} (pid {first.pid}, since ")
        assert "one run at a time per host" in line
        (run_b,) = (tmp_path / "b").iterdir()  # its results.json says why it did not run
        res = json.loads((run_b / "results.json").read_text())
        assert res["status"] == "refused" and "this host is busy" in res["error"] and not (run_b / "round1").exists()
    finally:
        first.kill()  # SIGKILL: no teardown of its own; the kernel drops its lock
        first.wait()
        for _ in range(3):  # its launcher and ranks, orphaned by the kill, pass or fail
            subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / "a")], check=False)
            time.sleep(0.5)
    from run_benchmarks.running.runtimes.local import LocalRuntime

    class P:
        run_id = "next"
        vendor = type("V", (), {"visible_devices_env": None})  # the whole host, as the cpu vendor's runs take it

    rt = LocalRuntime()
    rt._take_lock(P())  # free again at once
    rt.cleanup()
