"""The nightly command end to end with a scripted orchestrator: fast, every verdict path.

``orchestrator.run`` is replaced by a stand-in that talks to the console as the real one
does and writes results.json round by round, with throughputs a test chooses.  The real
orchestrator on the real tiny case is exercised in test_nightly_real.py.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.judging import results
from run_benchmarks.nightly import driver as nightly
from run_benchmarks.nightly import history
from run_benchmarks.running import orchestrator
from tests.test_history import fake_results

CASE = "llama3_tiny:megatron:cpu:1:2"


@pytest.fixture
def scripted(monkeypatch):
    """script[case label] = list of per-round throughputs (None: the round fails), or an exception."""
    script: dict[str, object] = {}
    seen_status: list[str] = []

    def run(plan, runtime, console):
        res = orchestrator.base_results(plan)
        results.write(res, plan.run_dir)
        todo = script[plan.config_name]
        with console.status(f"preparing {plan.case.framework} environment"):
            if isinstance(todo, BaseException):
                raise todo
        aligned = script.get("aligned", True)
        for i, r in enumerate(fake_results(plan.run_id, todo, aligned=aligned).rounds, 1):
            with console.status(f"round {i}/{plan.case.repeat}: {plan.case}"):
                seen_status.append(f"round {i}")
            res = res.model_copy(update={"rounds": [*res.rounds, r]})
            results.write(res, plan.run_dir)
            console.print(f"round {i}: {r.status}")
        return res

    monkeypatch.setattr(orchestrator, "run", run)
    script["_status"] = seen_status
    return script


def write_runlist(tmp_path, rounds=3, extra_cases=""):
    path = tmp_path / "nightly.yaml"
    path.write_text(
        "log_dir: logs\nhistory_db: h.sqlite\nbaseline_runs: 3\ntolerances: {throughput_drop_pct: 10, memory_rise_pct: 10}\ncases:\n"
        f"  - {{case: '{CASE}', vendor: cpu, rounds: {rounds}, set: [train.steps=12]}}\n" + extra_cases
    )
    return path


def night(path, capsys):
    rc = nightly.main([str(path)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_baseline_none_then_pass_then_regressed(tmp_path, scripted, capsys):
    path = write_runlist(tmp_path)
    scripted["config_cpux1x2"] = [1000.0, 1020.0, 980.0]
    rc, out, err = night(path, capsys)
    assert rc == 0, out + err
    assert "baseline: none" in out and "nightly: 1 case(s), 0 finding(s); exit status 0" in out
    assert "round 1: ok" in err and "round 3: ok" in err  # the orchestrator's lines reach the console
    assert scripted["_status"] == ["round 1", "round 2", "round 3"]

    scripted["config_cpux1x2"] = [950.0, 990.0, 1000.0]  # -3 %: noise
    rc, out, err = night(path, capsys)
    assert rc == 0, out + err
    assert "pass" in out

    scripted["config_cpux1x2"] = [700.0, 720.0, 690.0]  # -29 %
    rc, out, err = night(path, capsys)
    assert rc == 1, out + err
    lines = [ln for ln in out.splitlines() if ln.startswith("REGRESSION")]
    # baseline: median of the two earlier runs' medians (1000 and 990); MFU follows throughput
    assert lines == [
        f"REGRESSION {CASE} on cpu (config_cpux1x2): tokens/p/s median 700 vs baseline 995 (median of 2 run(s)): -29.6%, tolerance -10%",
        f"REGRESSION {CASE} on cpu (config_cpux1x2): MFU-6N median 0.70% vs baseline 1.00% (median of 2 run(s)): -29.6%, tolerance -5%",
    ]

    db = history.connect(tmp_path / "h.sqlite")
    nights = db.execute("SELECT * FROM nights ORDER BY id").fetchall()
    assert [n["exit_status"] for n in nights] == [0, 0, 1]
    assert all((tmp_path / "logs" / "reports" / n["report_path"].rsplit("/", 1)[-1]).is_file() for n in nights)
    runs = db.execute("SELECT * FROM runs ORDER BY id").fetchall()
    assert [r["verdict"] for r in runs] == ["baseline: none", "pass", "regressed"]
    assert [r["baseline_runs"] for r in runs] == [0, 1, 2]
    assert json.loads(runs[2]["baseline_json"])["train"]["tokens_per_gpu_s"] == 995.0
    f = db.execute("SELECT * FROM findings").fetchall()
    assert [(x["metric"], x["baseline"], x["now"]) for x in f] == [
        ("tokens/p/s", 995.0, 700.0),
        ("MFU-6N", pytest.approx(995.0 / 1e5), pytest.approx(700.0 / 1e5)),
    ]
    # a regressed run completed: it is good and rolls into later baselines (median, so one night does not move it)
    assert runs[2]["good"] == 1
    index = (tmp_path / "logs" / "reports" / "index.html").read_text()
    assert index.count("nightly-") >= 3 and "regression or failure" in index


def test_failed_round_and_unaligned_loss_fail_the_night(tmp_path, scripted, capsys):
    path = write_runlist(tmp_path)
    scripted["config_cpux1x2"] = [1000.0, 1000.0, 1000.0]
    assert night(path, capsys)[0] == 0
    scripted["config_cpux1x2"] = [1000.0, None, 1000.0]
    rc, out, _ = night(path, capsys)
    assert rc == 1
    assert (
        f"REGRESSION {CASE} on cpu (config_cpux1x2): 1 of 3 round(s) failed (baseline: no failed round in the last 1 good runs): node0 (localhost): exit status 1; boom"
        in out
    )
    assert "2/0/0/1" in out  # ok/unjudged/invalid/failed shown in the summary
    scripted["config_cpux1x2"] = [1000.0, 1000.0, 1000.0]
    scripted["aligned"] = False
    rc, out, _ = night(path, capsys)
    assert rc == 1 and f"REGRESSION {CASE} on cpu (config_cpux1x2): loss no longer aligns with the reference: MRE" in out
    # rounds whose loss is not judged (no reference, too short) are clean: not a failure, said so
    scripted["aligned"] = None
    rc, out, err = night(path, capsys)
    assert rc == 0 and "0/3/0/0" in out and "rounds ok 0, unjudged 3, invalid 0, failed 0 of 3" in err
    db = history.connect(tmp_path / "h.sqlite")
    assert [r["good"] for r in db.execute("SELECT good FROM runs ORDER BY id")] == [1, 0, 0, 1]


def test_a_broken_case_is_named_and_the_others_still_run(tmp_path, scripted, capsys):
    path = write_runlist(tmp_path, extra_cases=f"  - {{case: '{CASE}', vendor: cpu, variant: TP2, rounds: 2}}\n")
    scripted["config_cpux1x2"] = InputError("building the megatron environment for vendor cpu failed (exit 1)")
    scripted["config_cpux1x2_TP2"] = [500.0, 510.0]
    rc, out, err = night(path, capsys)
    assert rc == 1
    assert "case broke off: building the megatron environment for vendor cpu failed" in err
    assert f"REGRESSION {CASE} on cpu (config_cpux1x2): 3 of 3 round(s) failed (baseline: none): building the megatron environment" in out
    db = history.connect(tmp_path / "h.sqlite")
    rows = db.execute("SELECT config_name, rounds_ok, rounds_failed, error FROM runs ORDER BY id").fetchall()
    assert [tuple(r)[:3] for r in rows] == [("config_cpux1x2", 0, 3), ("config_cpux1x2_TP2", 2, 0)]
    assert "megatron environment" in rows[0]["error"]


def test_interrupt_keeps_finished_cases(tmp_path, scripted, capsys):
    path = write_runlist(tmp_path, extra_cases=f"  - {{case: '{CASE}', vendor: cpu, variant: TP2, rounds: 2}}\n")
    scripted["config_cpux1x2"] = [1000.0, 1000.0, 1000.0]
    scripted["config_cpux1x2_TP2"] = KeyboardInterrupt()
    rc, out, err = night(path, capsys)
    assert rc == 130 and "interrupted" in err
    assert "nightly: 1 case(s), 0 finding(s); exit status 130" in out
    db = sqlite3.connect(tmp_path / "h.sqlite")
    assert db.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    assert db.execute("SELECT exit_status FROM nights").fetchone()[0] == 130


def test_olympic_mean_from_five_rounds(tmp_path, scripted, capsys):
    path = write_runlist(tmp_path, rounds=5)
    scripted["config_cpux1x2"] = [100.0, 200.0, 210.0, 220.0, 5000.0]
    rc, _, _ = night(path, capsys)
    assert rc == 0
    db = history.connect(tmp_path / "h.sqlite")
    st = history.stats_of(db, 1)["train"]["tokens_per_gpu_s"]
    assert (st["n"], st["median"], st["olympic"], st["q1"], st["q3"]) == (5, 210.0, 210.0, 200.0, 220.0)
