"""History database: schema and its version, round aggregation, storage, the list command.

These tests store results.json-shaped dicts built here (``fake_results``); the nightly
tests in test_nightly_real.py store real runs of the tiny case.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from run_benchmarks import history
from run_benchmarks.errors import InputError

CASE = "llama3_tiny:megatron:cpu:1:2"
HW = history.hardware_key("cpu", "local", ["localhost"], "Test CPU x2")


def fake_results(
    run_id: str,
    tps: list[float | None],
    *,
    started: str = "2026-01-01T00:00:00+00:00",
    mem: float = 0.4,
    aligned: bool | None = None,
    steps: int = 30,
    settings: dict | None = None,
    vendor: str = "cpu",
    config_name: str = "config_cpux1x2",
) -> dict:
    """A results.json as the orchestrator writes it; a round with throughput None failed."""
    rounds = []
    for i, t in enumerate(tps, 1):
        loss = {str(s): 7.0 - 0.1 * s for s in range(1, steps + 1)}
        ok = t is not None
        rounds.append({
            "round": i, "status": "ok" if ok else "failed", "error": None if ok else "node0 (localhost): exit status 1; boom",
            "duration_s": 12.0, "layout": "PP1DP2TP1", "tokens_per_gpu_s": t,
            "mfu_6n": None if t is None else t / 1e5, "mfu_palm": None if t is None else t / 1.2e5,
            "peak_mem_gib": mem if ok else None, "total_mem_gib": None, "per_rank_mem_gib": {},
            "loss_mre": None if aligned is None or not ok else (0.01 if aligned else 0.2),
            "loss_aligned": aligned if ok else None,
            "phases": [{"phase": "train", "loss": loss if ok else {}}],
            "reference": {"train": None},
        })  # fmt: skip
    return {
        "schema": 1, "run_id": run_id, "case": CASE + f":{len(tps)}", "vendor": vendor, "config_name": config_name,
        "started": started, "finished": started, "system": {"host": "testhost", "cpu_count": 2},
        "settings": settings or {"train": {"steps": steps, "warmup_steps": 5, "precision": "fp32"}, "parallel": {"tp": 1}, "data": {}},
        "overrides": [], "user_overrides": [{"param": "train.steps", "value": steps, "standard": 30}],
        "hardware_info": {"chip": "cpu", "precision": "fp32", "peak_flops": None}, "rounds": rounds,
    }  # fmt: skip


def store(db, res: dict, requested: int | None = None, verdict: str = "pass", night: int | None = None, **kw) -> int:
    return history.record_run(
        db, night, res, hardware=HW, variant=None, rounds_requested=requested or len(res["rounds"]),
        verdict=verdict, baseline_runs=0, findings=[], **kw,
    )  # fmt: skip


def test_summary_median_iqr_and_olympic_mean():
    s = history.summarize([10.0, 30.0, 20.0, 40.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (4, 25.0, 10.0, 40.0)
    assert (s["q1"], s["q3"]) == (17.5, 32.5)
    assert s["olympic"] is None  # under 5 rounds
    s5 = history.summarize([10.0, 30.0, 20.0, 40.0, 1000.0])
    assert s5["median"] == 30.0 and s5["olympic"] == 30.0  # fastest (1000) and slowest (10) dropped
    assert history.summarize([])["median"] is None
    one = history.summarize([7.0])
    assert (one["median"], one["q1"], one["q3"], one["olympic"]) == (7.0, 7.0, 7.0, None)


def test_failed_and_missing_rounds_are_counted_not_dropped(tmp_path):
    db = history.connect(tmp_path / "h.sqlite")
    res = fake_results("r1", [100.0, None, 120.0, 110.0])  # 4 ran, one failed; 5 were asked for
    run = store(db, res, requested=5)
    row = db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()
    assert (row["rounds_requested"], row["rounds_ok"], row["rounds_failed"], row["good"]) == (5, 3, 2, 0)
    st = history.stats_of(db, run)["tokens_per_gpu_s"]
    assert (st["n"], st["median"], st["min"], st["max"]) == (3, 110.0, 100.0, 120.0)
    statuses = [r["status"] for r in db.execute("SELECT status FROM rounds WHERE run = ? ORDER BY round", (run,))]
    assert statuses == ["ok", "failed", "ok", "ok"]


def test_schema_is_versioned(tmp_path):
    path = tmp_path / "h.sqlite"
    history.connect(path).close()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"nights", "runs", "run_stats", "rounds", "losses", "findings"} <= tables
    raw.execute(f"PRAGMA user_version = {history.SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    with pytest.raises(InputError, match="newer than this harness"):
        history.connect(path)
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.close()
    with pytest.raises(InputError, match="not a flagbench history"):
        history.connect(other)


def test_stores_config_system_and_loss_curves(tmp_path):
    db = history.connect(tmp_path / "h.sqlite")
    res = fake_results("r1", [100.0, 101.0], aligned=True)
    run = store(db, res, reference={"train": {s: 7.0 - 0.1 * s for s in range(1, 31)}})
    row = db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()
    assert row["case_key"] == CASE and row["loss_aligned"] == 1 and row["good"] == 1
    assert json.loads(row["settings_json"])["train"]["steps"] == 30
    assert json.loads(row["user_overrides_json"]) == [{"param": "train.steps", "value": 30, "standard": 30}]
    assert json.loads(row["system_json"])["host"] == "testhost"
    curves = history.losses_of(db, run)
    assert set(curves) == {(0, "train"), (1, "train"), (2, "train")}  # round 0: the reference
    assert curves[(1, "train")][30] == pytest.approx(4.0)


def test_config_key_follows_the_resolved_settings():
    a = {"train": {"steps": 30}, "parallel": {"tp": 1}}
    assert history.config_key("config_cpux1x2", a) == history.config_key("config_cpux1x2", json.loads(json.dumps(a)))
    assert history.config_key("config_cpux1x2", a) != history.config_key("config_cpux1x2", {**a, "train": {"steps": 31}})
    assert history.config_key("config_cpux1x2", a) != history.config_key("config_cpux1x2_TP2", a)
    assert history.case_key("llama3_tiny:megatron:cpu:1:2:5") == CASE


def test_list_command(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    db = history.connect(path)
    run_a, run_b, run_c = (f"llama3_tiny_megatron_cpux1x2_2026010{d}-010000-00000{d}" for d in (1, 2, 3))
    store(db, fake_results(run_a, [100.0, 110.0, 120.0, 160.0, 900.0], started="2026-01-01T01:00:00+00:00"))
    store(db, fake_results(run_b, [90.0, None], started="2026-01-02T01:00:00+00:00"), verdict="regressed")
    store(db, fake_results(run_c, [50.0], vendor="nvidia", started="2026-01-03T01:00:00+00:00"))
    db.close()
    assert history.main(["list", "--case", CASE, "--vendor", "cpu", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "20260101-010000-000001" in out and "20260102-010000-000002" in out and "20260103" not in out
    assert "120.0" in out and "130.0" in out  # run_a's median, and its olympic mean (900 and 100 dropped)
    assert "1/1" in out and "regressed" in out  # run_b: one ok, one failed
    assert out.index("20260101-010000") < out.index("20260102-010000")  # oldest first
    assert history.main(["list", "--case", CASE, "--db", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in rows] == [run_a, run_b, run_c]
    assert rows[0]["stats"]["tokens_per_gpu_s"]["olympic"] == 130.0
    assert history.main(["list", "--case", "llama3_tiny:megatron:cpu:1:8", "--db", str(path)]) == 0
    assert "no runs of llama3_tiny:megatron:cpu:1:8" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["list", "--case", "llama3_tiny:megatron"], "must have the form"),
        (["list", "--case", CASE, "--vendor", "../cpu"], "vendor '../cpu' is not a valid name"),
        (["list", "--case", CASE, "--db", "/nonexistent/h.sqlite"], "/nonexistent/h.sqlite: no history database there"),
        (["list"], "--case"),
    ],
)
def test_list_command_bad_input(argv, fragment, capsys):
    assert history.main(argv) == 2
    assert fragment in capsys.readouterr().err
