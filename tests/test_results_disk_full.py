"""results.json on a disk that fills during the run: the run's reserve gives it room, the
last write still lands with its status and error, and no temporary file is left. A real
tmpfs in a mount namespace of the test's own (unshare)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from run_benchmarks.planning.registry import ROOT

FILL = """
import json, sys
from pathlib import Path
from run_benchmarks.judging import results
from tests.test_results_models import fake_run

run_dir = Path(sys.argv[1]) / "run"
res = fake_run().model_copy(update={"finished": None, "status": "running", "error": None})
results.write(res, run_dir)  # the run's first write keeps room for later ones
try:  # the rank logs fill the disk
    with open(run_dir.parent / "filler", "wb") as fh:
        while True:
            fh.write(b"x" * 65536)
            fh.flush()
except OSError as exc:
    print("disk full:", exc.strerror, flush=True)
rnd = fake_run().rounds[0].model_copy(update={"status": "failed", "error": "node0 (h1): " + "lost " * 2000})
res = res.model_copy(update={"rounds": [*res.rounds, rnd]})
results.write(res, run_dir)
res = res.model_copy(update={"finished": "2026-01-01T01:00:00+00:00", "status": "failed", "error": "round 2 failed"})
results.write(res, run_dir)
print("written", flush=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) and root")
def test_results_json_ends_with_status_and_error_on_a_full_disk(tmp_path):
    script = (
        'mount -t tmpfs -o size=1m tmpfs "$1" && "$2" -c "$3" "$1" && echo === && ls -A "$1/run" && echo === && cat "$1/run/results.json"'
    )
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(tmp_path), sys.executable, FILL],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    said, files, text = p.stdout.split("===\n")
    assert "disk full: No space left on device" in said and "written" in said, p.stdout + p.stderr
    assert files.split() == ["results.json", "results.md"]  # no temporary file, the reserve given up or removed
    res = json.loads(text)
    assert (res["status"], res["error"], len(res["rounds"])) == ("failed", "round 2 failed", 2)


#: in a mount namespace of its own: the log dir a 4 MiB tmpfs, filled once a rank of the run
#: logs a few steps; then what start_task.py said, its exit status, the files left behind
FILL_MID_RUN = """
d=$1; shift; mount -t tmpfs -o size=4m tmpfs "$d" || exit 99
"$@" >"$d.out" 2>"$d.err" & pid=$!
i=0; until ls "$d"/logs/*/round1/node0/ranks/*/* >/dev/null 2>&1 || [ $i -ge 600 ]; do sleep 0.5; i=$((i+1)); done
sleep 3; dd if=/dev/zero of="$d/filler" bs=64k 2>/dev/null
wait $pid; echo "rc=$?"; find "$d" -name "*.tmp" -o -name harness-error.log
"""


@pytest.mark.framework("megatron")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) and root")
def test_a_log_folder_filling_mid_run_ends_in_one_line_naming_it(tmp_path, megatron_python):
    """A 2-process local llama3_tiny run whose log folder (a 4 MiB tmpfs) fills while the ranks
    train: the round fails naming the full folder, exit 1, no traceback (not the monitor's, not
    a cut metric line's), no temporary file or crash log."""
    full = tmp_path / "full"
    full.mkdir()
    argv = [sys.executable, str(ROOT / "run_benchmarks" / "start_task.py"), "--vendor", "cpu"]
    argv += ["--case_name", "llama3_tiny:megatron:cpu:1:2", "--log-dir", str(full / "logs"), "--set", "train.steps=400"]
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", FILL_MID_RUN, "sh", str(full), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    err = (tmp_path / "full.err").read_text()
    assert p.stdout.splitlines()[0] == "rc=1", p.stdout + err
    assert p.stdout.splitlines()[1:] == [], p.stdout  # no temporary file, no harness crash log
    assert "Traceback" not in err and "unexpected" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("round 1: failed")]
    assert line.startswith(f"round 1: failed - {full}/logs/llama3_tiny_megatron_cpux1x2_") and line.endswith(
        ": this machine's log folder is full (No space left on device): the logs written there are cut short"
    ), line
