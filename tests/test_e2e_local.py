"""The embedded default end to end: the tiny llama3 case through start_task.py."""

import json
import subprocess
import sys

import pytest

from run_benchmarks.registry import ROOT

START = str(ROOT / "run_benchmarks" / "start_task.py")


@pytest.mark.framework("megatron")
def test_tiny_llama3_two_processes(tmp_path, megatron_python):
    proc = subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    res = json.loads((run_dir / "results.json").read_text())
    assert (res["case"], res["vendor"], res["hardware"], res["nnodes"], res["nprocs"]) == ("llama3_tiny:megatron:cpu:1:2:1", "cpu", "cpu", 1, 2)
    assert res["config_name"] == "config_cpux1x2" and res["system"]["host"]
    (rnd,) = res["rounds"]
    assert rnd["status"] == "ok" and rnd["error"] is None
    assert rnd["tokens_per_gpu_s"] > 0
    assert rnd["mfu_6n"] is None and rnd["mfu_palm"] is None  # no peak for a CPU: never invented
    assert rnd["peak_mem_gib"] > 0
    assert rnd["window"]["first_step"] == res["settings"]["train"]["warmup_steps"] + 1
    assert rnd["window"]["last_step"] == res["settings"]["train"]["steps"]
    assert rnd["loss_aligned"] is True and rnd["loss_mre"] < 0.02
    meta = rnd["phases"][0]["meta"]
    assert meta["params_exact"] == res["model_counts"]["train"]["params_exact"]
    assert rnd["layout"].startswith("PP1DP2TP1")
    # raw logs of both ranks and the resolved config stay with the round
    rank_logs = [p for p in (run_dir / "round1" / "node0" / "ranks").rglob("stdout.log")]
    assert len(rank_logs) == 2
    assert json.loads((run_dir / "round1" / "resolved.json").read_text())["case"]["nprocs"] == 2
    md = (run_dir / "results.md").read_text()
    assert "| config | phase | precision | parallel |" in md and "config_cpux1x2 r1" in md
    assert "config_cpux1x2 r1" in proc.stdout  # the same table in the terminal
