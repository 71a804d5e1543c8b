"""A failed round leads with its root cause: the rank that was killed and by what, or the
exception a rank raised, before the ranks and nodes that fell with it.

The launcher texts are torchrun's and DeepSpeed's own output formats; the last test kills
a rank of a real run with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from run_benchmarks import causes
from run_benchmarks.registry import ROOT

TORCHRUN = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/work/main/cases/llama3/megatron/train.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_12:07:46
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 30765)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 30765
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_12:07:46
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 30766)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 30766
=======================================================
"""


def test_the_launchers_root_cause_is_read():
    assert causes.launcher_root_cause(TORCHRUN) == (3, "killed by SIGKILL")  # not the SIGTERM the launcher sent the others
    raised = TORCHRUN.replace("exitcode  : -9 (pid: 30766)  (SIGKILL)", "exitcode  : 1 (pid: 30766)")
    assert causes.launcher_root_cause(raised) == (3, "exit status 1")
    ds = (
        "[2026-11-26 12:00:01,000] [INFO] [launch.py:335:sigkill_handler] Killing subprocess 123\n"
        "[2026-11-26 12:00:01,000] [ERROR] [launch.py:341:sigkill_handler] ['python', 'train.py'] exits with return code = -9\n"
    )
    assert causes.launcher_root_cause(ds) == (None, "killed by SIGKILL")
    assert causes.launcher_root_cause("no summary here") is None


def test_a_logs_cause_is_its_last_exception_line_or_an_address_in_use():
    log = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n[rank1]: ValueError: first\n'
        "Traceback (most recent call last):\n[rank1]: IndexError: index out of range in self\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert causes.log_cause(log) == "IndexError: index out of range in self"
    assert (
        causes.log_cause("[W socket.cpp] The server socket has failed to listen on [::]:29500 (errno: 98 - Address already in use).")
        == "[W socket.cpp] The server socket has failed to listen on [::]:29500 (errno: 98 - Address already in use)."
    )
    assert causes.log_cause("all fine") is None


def test_a_kill_near_the_hosts_memory_says_so():
    assert (
        causes.memory_hint({"host_mem_peak_gib": 125.7, "host_mem_total_gib": 125.8})
        == "; likely out of host memory (peak 125.7 of 125.8 GiB)"
    )
    assert causes.memory_hint({"host_mem_peak_gib": 20.0, "host_mem_total_gib": 125.8}) == ""
    assert causes.memory_hint(None) == ""


@pytest.mark.framework("megatron")
def test_a_rank_killed_mid_run_leads_the_rounds_error(megatron_python, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run_benchmarks" / "start_task.py"),
            "--vendor",
            "cpu",
            "--case_name",
            "llama3_tiny:megatron:cpu:1:2",
            "--log-dir",
            str(tmp_path),
            "--set",
            "train.steps=100000",
            "--round-timeout",
            "300",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = None
    end = time.monotonic() + 240
    while victim is None and time.monotonic() < end and proc.poll() is None:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "train.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1":
                    victim = p
            except psutil.Error:
                continue
        if victim is None:
            time.sleep(0.5)
    assert victim is not None, "rank 1 never started"
    time.sleep(3)  # a few steps in
    os.kill(victim.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, out + err
    (run_dir,) = tmp_path.iterdir()
    res = json.loads((run_dir / "results.json").read_text())
    (rnd,) = res["rounds"]
    first = rnd["error"].splitlines()[0]
    assert rnd["status"] == "failed" and first == "rank 1 on node0 (localhost) killed by SIGKILL", rnd["error"]
    assert f"round 1: failed - {first}" in err  # the same line in the terminal
    assert res["status"] == "failed" and res["error"] == f"round 1 failed: {first}"
    assert first in (run_dir / "results.md").read_text()
