"""The embedded default end to end: the tiny cases through start_task.py, and the loss gate on them.

One 30-step llama3_tiny run (``base``: the session's ``llama3_dp2_run``, which
tests/test_llama3_megatron_case.py checks too) is shared: it is checked against the
committed curve, and its own curve, scaled in temp files, is the reference of the gate's
runs; its results.json is what --verify checks. Curves are never taken from the committed
files for the gate tests, since those change with the case's starting weights.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks import typed_results as tr
from tests.case_helpers import START, start_task

LLAMA = "llama3_tiny:megatron:cpu:1:2"


def run_case(log_dir: Path, *args, case=LLAMA, **env):
    """start_task.py on a tiny case; returns the process and its results (None when it wrote none)."""
    proc = start_task("--vendor", "cpu", "--case_name", case, "--log-dir", str(log_dir), *args, **env)
    runs = [p for p in log_dir.iterdir() if p.is_dir()] if log_dir.is_dir() else []
    assert len(runs) <= 1
    return proc, (tr.load(runs[0] / "results.json") if runs else None)


def curve_file(path: Path, loss: dict[int, float], off: float = 0.0) -> Path:
    """A {steps, loss} curve that ``loss`` is exactly ``off`` from: reference = loss / (1 - off)."""
    steps = sorted(loss)
    path.write_text(json.dumps({"model": "llama3_tiny", "steps": steps, "loss": [loss[s] / (1 - off) for s in steps]}))
    return path


@pytest.fixture(scope="module")
def base(llama3_dp2_run):
    proc, run_dir = llama3_dp2_run  # conftest.py: the committed config_cpux1x2, a plain progress line every second
    return proc, tr.load(run_dir / "results.json"), run_dir


@pytest.mark.framework("megatron")
def test_tiny_llama3_two_processes(base, tmp_path):
    proc, res, run_dir = base
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (res.case, res.vendor, res.hardware, res.nnodes, res.nprocs, res.schema_) == (
        "llama3_tiny:megatron:cpu:1:2:1",
        "cpu",
        "cpu",
        1,
        2,
        2,
    )
    assert res.config_name == "config_cpux1x2" and res.system["host"]
    (rnd,) = res.rounds
    (p,) = rnd.phases
    assert rnd.status == "ok" and rnd.error is None
    assert p.gate.verdict == "aligned" and p.gate.mre < 0.02 and (p.gate.first_step, p.gate.last_step) == (21, 30)
    assert p.reference.path.endswith("reference/llama3_tiny/standard.json") and sorted(p.reference.loss) == list(range(1, 31))
    assert rnd.tokens_per_gpu_s == p.tokens_per_gpu_s > 0
    assert (res.status, res.error) == ("ok", None) and res.code_version  # the run's own status, and the code that made it
    assert p.mfu_6n is None and p.mfu_palm is None  # no peak for a CPU: never invented
    assert p.peak_mem_gib > 0 and p.device_mem is None and rnd.device_mem is None  # no monitored device on a CPU
    assert p.window.first_step == res.settings["train"]["warmup_steps"] + 1
    assert p.window.last_step == res.settings["train"]["steps"]
    # every step record is kept: the figures can be recomputed from the file
    assert [s.step for s in p.steps] == list(range(1, 31)) and all(s.tokens > 0 and s.step_time_s > 0 for s in p.steps)
    assert [s.t for s in p.steps] == sorted(s.t for s in p.steps) and p.loss == {s.step: s.loss for s in p.steps}
    assert p.meta["params_exact"] == res.model_counts["train"]["params_exact"]
    assert rnd.layout.startswith("PP1DP2TP1")
    # where rank 0's time went before its first step ended, each phase measured (training/startup.py)
    start = rnd.startup
    assert list(start["phases"]) == ["imports", "conformance", "process_groups", "model", "weights", "optimizer", "build", "first_step"]
    assert all(v >= 0 for v in start["phases"].values()) and start["phases"]["imports"] > 0.1
    total = sum(v for k, v in start["phases"].items() if k != "conformance")
    assert start["process_start"] == "proc" and abs(start["to_first_step_s"] - total) < 0.01, start
    # raw logs of both ranks and the resolved config stay with the round
    assert len(list((run_dir / "round1" / "node0" / "ranks").rglob("stdout.log"))) == 2
    assert json.loads((run_dir / "round1" / "resolved.json").read_text())["case"]["nprocs"] == 2
    md = (run_dir / "results.md").read_text()
    assert (
        "| config | phase | precision | parallel |" in md
        and "config_cpux1x2 r1" in md
        and "| mem allocated (GiB) | mem in use (GiB) |" in md
    )
    assert "config_cpux1x2 r1" in proc.stdout and "aligned (" in proc.stdout  # the same table in the terminal
    # while it ran: the step it was at, read from the ranks' logs
    assert re.search(r"round 1: step \d+/30, [\d,]+ tokens/p/s, loss [\d.]+ \(\d+:\d\d\)", proc.stderr), proc.stderr

    # another parallel layout of the same case on the same data, gated against two reference runs (--reference
    # twice): this run and a copy of it 1 % higher, repeats whose per-step mean is the curve, 1 % their spread
    shifted = json.loads((run_dir / "results.json").read_text())
    shifted["rounds"][0]["phases"][0]["loss"] = {k: v * 1.01 for k, v in shifted["rounds"][0]["phases"][0]["loss"].items()}
    (tmp_path / "shifted.json").write_text(json.dumps(shifted))
    refs = [str(run_dir / "results.json"), str(tmp_path / "shifted.json")]
    proc2, res2 = run_case(
        tmp_path / "tp2", "--variant", "TP2", "--reference", refs[0], "--reference", refs[1], "--set", "train.profile_step=8"
    )
    assert proc2.returncode == 0, proc2.stdout + proc2.stderr
    (rnd2,) = res2.rounds
    (p2,) = rnd2.phases
    assert rnd2.layout.startswith("PP1DP1TP2")
    assert rnd2.reference == {"train": "; ".join(refs)} and [r.path for r in p2.reference.repeats] == refs
    assert p2.reference.repeats[0].loss == p.loss and p2.reference.loss == pytest.approx({s: v * 1.005 for s, v in p.loss.items()})
    assert p2.reference.spread == pytest.approx(0.01)
    assert res2.command[0] == "run_benchmarks/start_task.py" and res2.command.count("--reference") == 2
    assert p2.gate.compared_steps == 10 and p2.gate.verdict == "aligned" and rnd2.loss_aligned is True  # steps 21..30
    assert p2.gate.reason.endswith(" over steps 21-30 against the mean of 2 runs (their spread 1.00%)")
    assert "; mean of 2 runs, spread 1.00%)" in proc2.stdout
    # the mean, its spread and the verdict recomputed from the results.json alone
    verified = start_task("--verify", str(tmp_path / "tp2" / res2.run_id / "results.json"), timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # the two layouts really differ in arithmetic, yet not beyond the gate
    assert p2.loss != p.loss
    # step 8 was profiled: its time split into parts, its trace kept, and it is not in the window
    assert p2.window.excluded == [8] and p2.window.steps == p.window.steps - 1 and p2.steps[7].profiled
    (b,) = p2.step_breakdown.values()
    assert b["step"] == 8 and b["source"] == "cpu ops" and b["pp_rank"] == 0
    parts = b["categories"]
    assert parts["gemm"]["kernel_s"] > 0 and parts["attention"]["kernel_s"] > 0 and parts["optimizer"]["kernel_s"] > 0
    assert parts["communication"]["kernel_s"] > 0  # TP2 all-reduces in every layer
    assert 0 < b["busy_s"] <= b["step_time_s"] and b["idle_s"] >= 0 and b["optimizer_wall_s"] > 0
    assert 0 <= b["optimizer_idle_s"] <= b["optimizer_wall_s"] and b["gaps"] == []  # gaps between kernels: GPU traces alone
    assert sum(c["kernel_s"] for n, c in parts.items() if n != "communication") <= b["step_time_s"]
    run2 = tmp_path / "tp2" / res2.run_id
    assert sorted(p.name for p in run2.rglob("profile_rank*_step8.json.gz")) == [
        "profile_rank0_step8.json.gz",
        "profile_rank1_step8.json.gz",
    ]
    md = (run2 / "results.md").read_text()
    assert "| gemm |" in md and "| of it with no kernel running |" in md
    # each part names its largest operators, summed over their calls, largest first
    largest = b["largest"]
    assert set(largest) == set(parts) and largest["communication"] and largest["gemm"][0]["name"].startswith("aten::")
    for part, ops in largest.items():
        times = [o["kernel_s"] for o in ops]
        assert times == sorted(times, reverse=True) and sum(times) <= parts[part]["kernel_s"] + 1e-9 and all(o["calls"] >= 1 for o in ops)
    assert "Largest kernels of each part" in md and f"| gemm | `{largest['gemm'][0]['name']}` |" in md


@pytest.mark.framework("megatron")
def test_a_diverging_run_fails_and_names_the_step(base, tmp_path):
    proc, res = run_case(tmp_path, "--set", "train.lr=1000", "--set", "train.min_lr=100")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (rnd,) = res.rounds
    (p,) = rnd.phases
    first = next(s.step for s in p.steps if s.loss != s.loss)  # the first NaN, as the records have it
    assert first > res.settings["train"]["warmup_steps"]
    assert rnd.status == "failed" and rnd.error == f"phase train: loss NaN at step {first}"
    assert p.gate.nonfinite_step == first and p.tokens_per_gpu_s > 0  # the figures are kept, marked
    assert f"failed: {p.tokens_per_gpu_s:.1f}" in proc.stdout and f"loss NaN at step {first}" in proc.stdout


@pytest.mark.framework("megatron")
@pytest.mark.parametrize("off, status, rc", [(0.019, "ok", 0), (0.021, "invalid", 1)])
def test_the_two_percent_gate(base, tmp_path, off, status, rc):
    ref = curve_file(tmp_path / "ref.json", base[1].rounds[0].phases[0].loss, off)
    proc, res = run_case(tmp_path / "logs", "--reference", str(ref))
    assert proc.returncode == rc, proc.stdout + proc.stderr
    (rnd,) = res.rounds
    g = rnd.phases[0].gate
    assert rnd.status == status and g.mre == pytest.approx(off, abs=1e-3) and g.compared_steps == 10
    if status == "invalid":
        assert rnd.error == f"phase train: loss not aligned: MRE {100 * g.mre:.2f}% over steps 21-30 (at least 2%)"
        assert f"invalid: {rnd.phases[0].tokens_per_gpu_s:.1f}" in proc.stdout


@pytest.mark.framework("megatron")
def test_a_short_run_against_a_longer_reference_is_not_judged(base, tmp_path):
    ref = curve_file(tmp_path / "ref.json", base[1].rounds[0].phases[0].loss)
    proc, res = run_case(tmp_path / "logs", "--reference", str(ref), "--set", "train.steps=22")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (rnd,) = res.rounds
    assert rnd.status == "unjudged" and rnd.phases[0].gate.verdict == "not judged"
    assert rnd.error == "phase train: loss not judged: steps 23-30 missing (reference to step 30)"
    # a round shorter than the plain progress interval (60 s) still says in the log where it ended
    assert re.search(r"^round 1: step 22/22, [\d,]+ tokens/p/s, loss [\d.]+ \(\d+:\d\d\)$", proc.stderr, re.M), proc.stderr


def test_a_reference_that_cannot_judge_stops_before_anything_runs(tmp_path):
    early = tmp_path / "early.json"
    early.write_text(json.dumps({"steps": list(range(1, 21)), "loss": [5.0] * 20}))
    proc, res = run_case(tmp_path / "logs", "--reference", str(early))
    assert proc.returncode == 2 and res is None and not (tmp_path / "logs").exists()
    assert proc.stderr.strip() == f"error: --reference {early}: 0 step(s) from step 21 on (none); the loss gate compares at least 5"


@pytest.mark.framework("deepspeed")
def test_two_phases_each_judged(tmp_path, deepspeed_python):
    """llava_tiny: the finetune reference alone is off, so the round is invalid and names that phase.
    The run is judged against it again (``--judge --update``: the live gate's judging, on the
    curves the run recorded) rather than run twice."""
    llava = "llava_tiny:deepspeed:cpu:1:2"
    proc, first = run_case(tmp_path / "first", "--set", "train.steps=25", case=llava)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 25 of the committed curves' 30 steps: not judged
    (rnd,) = first.rounds
    assert rnd.status == "unjudged" and [p.phase for p in rnd.phases] == ["pretrain", "finetune"]
    assert rnd.error.splitlines() == [  # the finetune starts from a pretrain of another recipe: its reference cannot judge it
        "phase pretrain: loss not judged: steps 26-30 missing (reference to step 30)",
        "phase finetune: loss not judged: the pretrain ran another recipe (standard with train.steps=25, the reference's standard)",
    ]
    # a clean first run is a reference: its finetune curve 5 % off
    finetune = rnd.phases[1]
    off = finetune.model_copy(
        update={
            "loss": {s: v * 1.05 for s, v in finetune.loss.items()},
            "steps": [s.model_copy(update={"loss": s.loss * 1.05}) for s in finetune.steps],
        }
    )
    ref = first.model_copy(update={"rounds": [rnd.model_copy(update={"phases": [rnd.phases[0], off]})]})
    (tmp_path / "ref.json").write_text(json.dumps(ref.dump()))
    again = tmp_path / "again.json"
    again.write_text(json.dumps(first.dump()))
    proc = start_task("--judge", str(again), "--reference", str(tmp_path / "ref.json"), "--update", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a phase not aligned: as a run exits
    res = tr.load(again)
    (rnd,) = res.rounds
    pre, fine = rnd.phases
    assert pre.gate.verdict == "aligned" and fine.gate.verdict == "not aligned" and rnd.status == "invalid"
    assert rnd.loss_aligned is False and rnd.tokens_per_gpu_s is None  # two phases: the figures are the phases'
    assert rnd.error == f"phase finetune: loss not aligned: MRE {100 * fine.gate.mre:.2f}% over steps 21-25 (at least 2%)"


@pytest.mark.framework("megatron")
def test_verify_a_fresh_file_and_an_edited_one(base, tmp_path):
    run_dir = base[2]
    good = start_task("--verify", str(run_dir / "results.json"), timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.strip().splitlines()[-1] == f"{run_dir / 'results.json'}: every figure of 1 round(s) matches its records"
    data = json.loads((run_dir / "results.json").read_text())
    data["rounds"][0]["phases"][0]["tokens_per_gpu_s"] *= 1.1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    bad = start_task("--verify", str(edited), timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    recorded = data["rounds"][0]["phases"][0]["tokens_per_gpu_s"]
    assert f"{edited}: round 1 phase train: tokens_per_gpu_s recorded {recorded!r}, recomputed " in bad.stdout


def _dry(*extra):
    return subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", LLAMA, "--dry-run", "--json", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_reference_file_is_checked_before_anything_runs(tmp_path):
    """Another model, another global batch, a round that is not clean, too short: exit 2, the file named."""
    from tests.test_results_models import fake_run

    def results_file(name, status="ok", model="llama3_tiny", global_batch=8):
        run = fake_run([{"status": status}])
        run = run.model_copy(
            update={"model": model, "settings": {**run.settings, "train": {**run.settings["train"], "global_batch": global_batch}}}
        )
        (tmp_path / name).write_text(json.dumps(run.dump()))
        return tmp_path / name

    ok = _dry("--reference", str(results_file("ok.json")))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["reference"] == str(tmp_path / "ok.json")
    assert _dry("--reference", str(results_file("unjudged.json", status="unjudged"))).returncode == 0
    assert _dry("--reference", str(results_file("invalid.json", status="invalid"))).returncode == 0  # its curve only differed
    assert _dry("--reference", str(curve_file(tmp_path / "curve.json", {s: 5.0 for s in range(1, 26)}))).returncode == 0
    (tmp_path / "junk.json").write_text(json.dumps({"loss": 1}))
    (tmp_path / "zero.json").write_text(json.dumps({"steps": list(range(1, 31)), "loss": [5.0] * 22 + [0.0] * 8}))
    (tmp_path / "other.json").write_text(json.dumps({"model": "gpt3_tiny", "steps": list(range(1, 31)), "loss": [5.0] * 30}))
    bad = {
        "missing.json": "no such file",
        "gb.json": (results_file("gb.json", global_batch=16), "global batch 16 there, 8 here")[1],
        "model.json": (results_file("model.json", model="llama3_8b"), "a run of 'llama3_8b', not of 'llama3_tiny'")[1],
        "failed.json": (
            results_file("failed.json", status="failed"),
            "no round ran through (ok, unjudged or invalid by its own gate): round 1 failed",
        )[1],
        "junk.json": "neither a reference curve",
        "zero.json": "step 23: reference loss 0.0",
        "other.json": "a curve of 'gpt3_tiny', not of 'llama3_tiny'",
    }
    for name, message in bad.items():
        proc = _dry("--reference", str(tmp_path / name))
        assert proc.returncode == 2 and message in proc.stderr and f"--reference {tmp_path / name}" in proc.stderr, (name, proc.stderr)
