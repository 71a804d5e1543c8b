"""results.md's cells: a status cut between words, an unjudged loss with its value, and a run
refused by a busy host called refused, not failed."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

from run_benchmarks import typed_results as tr
from run_benchmarks.judging import results
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running.remote.errors import HostBusy
from run_benchmarks.running.runtimes import local
from tests.test_results_models import fake_phase, fake_run


def test_a_status_is_cut_between_words_and_an_unjudged_loss_shows_its_value():
    error = "rank 0: " + "a" * 45 + " longword continues here"  # character 60 inside 'longword'
    run = fake_run([{"status": "invalid", "error": error, "phases": [fake_phase(verdict="not judged")]}])
    row = results.rows(run)[0]
    status = row[results.COLUMNS.index("status")]
    assert status == "invalid: rank 0: " + "a" * 45 + " ..."
    assert row[results.COLUMNS.index("loss")] == "loss 4.0000; not judged: no reference curve"


def test_a_busy_host_makes_a_refused_run_not_a_failed_one(tmp_path):
    for exc in (local.HostBusy("this host is busy: run x holds it"), HostBusy("h1", "host h1 is busy: run x holds it")):
        out = tr.run_outcome([], exc, 1)
        assert out["status"] == "refused" and "busy" in out["error"]
    locks = tmp_path / "locks"
    locks.mkdir()
    with open(locks / "local.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("run other-run (pid 1, since then)\n")
        held.flush()
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "run_benchmarks" / "start_task.py"),
                "--vendor",
                "cpu",
                "--case_name",
                "llama3_tiny:megatron:cpu:1:1",
            ]
            + ["--log-dir", str(tmp_path / "logs"), "--python", sys.executable],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "FLAGBENCH_LOCK_DIR": str(locks)},
        )
    assert proc.returncode == 2 and "this host is busy: run other-run" in proc.stderr, proc.stderr
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert json.loads((run_dir / "results.json").read_text())["status"] == "refused"
    md = (run_dir / "results.md").read_text()
    assert "status: **refused**: this host is busy: run other-run" in md and "failed" not in md
