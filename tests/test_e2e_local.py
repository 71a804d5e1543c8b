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

    # another parallel layout of the same case on the same data, gated against this run's curve
    proc2 = subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--variant", "TP2",
         "--reference", str(run_dir / "results.json"), "--set", "train.profile_step=8", "--log-dir", str(tmp_path / "tp2")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc2.returncode == 0, proc2.stdout + proc2.stderr
    (run2,) = [p for p in (tmp_path / "tp2").iterdir() if p.is_dir()]
    res2 = json.loads((run2 / "results.json").read_text())
    (rnd2,) = res2["rounds"]
    assert rnd2["layout"].startswith("PP1DP1TP2")
    assert rnd2["reference"] == {"train": str(run_dir / "results.json")}
    assert res2["command"][0] == "run_benchmarks/start_task.py" and "--reference" in res2["command"]
    assert rnd2["phases"][0]["loss_compared_steps"] == 10  # steps 21..30
    assert rnd2["loss_aligned"] is True and 0 <= rnd2["loss_mre"] < 0.02
    # the two layouts really differ in arithmetic, yet not beyond the gate
    assert rnd2["phases"][0]["loss"] != rnd["phases"][0]["loss"]
    # step 8 was profiled: its time split into parts, its trace kept, and it is not in the window
    assert rnd2["window"]["excluded"] == [8] and rnd2["window"]["steps"] == rnd["window"]["steps"] - 1
    (b,) = rnd2["phases"][0]["step_breakdown"].values()
    assert b["step"] == 8 and b["source"] == "cpu ops" and b["pp_rank"] == 0
    parts = b["categories"]
    assert parts["gemm"]["kernel_s"] > 0 and parts["attention"]["kernel_s"] > 0 and parts["optimizer"]["kernel_s"] > 0
    assert parts["communication"]["kernel_s"] > 0  # TP2 all-reduces in every layer
    assert 0 < b["busy_s"] <= b["step_time_s"] and b["idle_s"] >= 0 and b["optimizer_wall_s"] > 0
    assert sum(c["kernel_s"] for n, c in parts.items() if n != "communication") <= b["step_time_s"]
    assert sorted(p.name for p in run2.rglob("profile_rank*_step8.json.gz")) == ["profile_rank0_step8.json.gz", "profile_rank1_step8.json.gz"]
    assert "| gemm |" in (run2 / "results.md").read_text()


def _dry(*extra):
    return subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--dry-run", "--json", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _results(path, model="llama3_tiny", global_batch=8, loss=None, status="ok"):
    path.write_text(json.dumps({
        "model": model, "settings": {"train": {"global_batch": global_batch}},
        "rounds": [{"round": 1, "status": status, "phases": [{"phase": "train", "loss": loss or {"21": 5.0, "22": 4.9}}]}],
    }))  # fmt: skip
    return path


def test_reference_file_is_checked_before_anything_runs(tmp_path):
    ok = _dry("--reference", str(_results(tmp_path / "ok.json")))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["reference"] == str(tmp_path / "ok.json")
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"steps": [21, 22], "loss": [5.0, 4.9]}))
    assert _dry("--reference", str(curve)).returncode == 0
    bad = {
        "missing.json": (None, "no such file"),
        "gb.json": (_results(tmp_path / "gb.json", global_batch=16), "global batch 16 there, 8 here"),
        "model.json": (_results(tmp_path / "model.json", model="llama3_8b"), "a run of 'llama3_8b'"),
        "failed.json": (_results(tmp_path / "failed.json", status="failed"), "no round finished ok"),
        "junk.json": (None, "neither a reference curve"),
    }
    (tmp_path / "junk.json").write_text(json.dumps({"loss": 1}))
    for name, (_, message) in bad.items():
        proc = _dry("--reference", str(tmp_path / name))
        assert proc.returncode == 2 and message in proc.stderr and name in proc.stderr, (name, proc.stderr)
