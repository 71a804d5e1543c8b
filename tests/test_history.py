"""History database: schema and its version, round aggregation, storage, the list command.

These tests store typed results built here (``fake_results``); the nightly
tests in test_nightly_real.py store real runs of the tiny case.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.nightly import history
from run_benchmarks.typed_results import RunResults
from tests.test_results_models import fake_phase, fake_run

CASE = "llama3_tiny:megatron:cpu:1:2"
HW = history.hardware_key("cpu", "local", ["localhost"], "Test CPU x2")


def fake_results(
    run_id: str,
    tps: list[float | None],
    *,
    started: str = "2026-01-01T00:00:00+00:00",
    mem: float = 0.4,
    aligned: bool | None = True,
    steps: int = 30,
    vendor: str = "cpu",
    config_name: str = "config_cpux1x2",
    phases: tuple[str, ...] = ("train",),
) -> RunResults:
    """A results.json as the orchestrator writes it: a round with throughput None failed; ``aligned``
    True, False or None makes the others ok, invalid or unjudged."""
    status = {True: "ok", False: "invalid", None: "unjudged"}[aligned]
    verdict = {True: "aligned", False: "not aligned", None: "not judged"}[aligned]
    rounds = []
    for t in tps:
        if t is None:
            rounds.append(
                {
                    "status": "failed",
                    "error": "node0 (localhost): exit status 1; boom",
                    "phases": [fake_phase(ph, tps=None, verdict="not judged", steps=steps, mem=None) for ph in phases],
                }
            )
        else:
            rounds.append(
                {
                    "status": status,
                    "phases": [fake_phase(ph, tps=t, verdict=verdict, mre=0.01 if aligned else 0.2, steps=steps, mem=mem) for ph in phases],
                }
            )
    return fake_run(rounds, run_id, started=started, vendor=vendor, config_name=config_name, steps=steps)


def store(db, res: RunResults, requested: int | None = None, verdict: str = "pass", night: int | None = None, **kw) -> int:
    return history.record_run(
        db,
        night,
        res,
        hardware=HW,
        variant=None,
        rounds_requested=requested or len(res.rounds),
        verdict=verdict,
        baseline_runs=0,
        findings=[],
        **kw,
    )


def test_summary_median_iqr_and_olympic_mean():
    s = history.value_stats([10.0, 30.0, 20.0, 40.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (4, 25.0, 10.0, 40.0)
    assert (s["q1"], s["q3"]) == (17.5, 32.5)
    assert s["olympic"] is None  # under 5 rounds
    s5 = history.value_stats([10.0, 30.0, 20.0, 40.0, 1000.0])
    assert s5["median"] == 30.0 and s5["olympic"] == 30.0  # fastest (1000) and slowest (10) dropped
    assert history.value_stats([])["median"] is None
    one = history.value_stats([7.0])
    assert (one["median"], one["q1"], one["q3"], one["olympic"]) == (7.0, 7.0, 7.0, None)


def test_failed_and_missing_rounds_are_counted_not_dropped(tmp_path):
    db = history.connect(tmp_path / "h.sqlite")
    res = fake_results("r1", [100.0, None, 120.0, 110.0])  # 4 ran, one failed; 5 were asked for
    run = store(db, res, requested=5)
    row = db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()
    assert (row["rounds_requested"], row["rounds_ok"], row["rounds_failed"], row["good"]) == (5, 3, 2, 0)
    st = history.stats_of(db, run)["train"]["tokens_per_gpu_s"]
    assert (st["n"], st["median"], st["min"], st["max"]) == (3, 110.0, 100.0, 120.0)
    statuses = [r["status"] for r in db.execute("SELECT status FROM rounds WHERE run = ? ORDER BY round", (run,))]
    assert statuses == ["ok", "failed", "ok", "ok"]


def test_schema_is_versioned(tmp_path):
    path = tmp_path / "h.sqlite"
    history.connect(path).close()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"nights", "runs", "run_stats", "rounds", "phases", "losses", "findings"} <= tables
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
    res = fake_results("r1", [100.0, 101.0])
    run = store(db, res, reference={"train": {s: 7.0 - 0.1 * s for s in range(1, 31)}})
    row = db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()
    assert row["case_key"] == CASE and row["loss_aligned"] == 1 and row["good"] == 1
    assert json.loads(row["settings_json"])["train"]["steps"] == 30
    assert json.loads(row["user_overrides_json"]) == [{"param": "train.steps", "value": 30, "standard": 30}]
    assert json.loads(row["system_json"])["host"] == "testhost"
    phases = history.phases_of(db, run)
    assert [(p["round"], p["phase"], p["status"], p["loss_verdict"], p["tokens_per_gpu_s"]) for p in phases] == [
        (1, "train", "ok", "aligned", 100.0),
        (2, "train", "ok", "aligned", 101.0),
    ]
    curves = history.losses_of(db, run)
    assert set(curves) == {(0, "train"), (1, "train"), (2, "train")}  # round 0: the reference
    assert curves[(1, "train")][30] == pytest.approx(4.0)


def test_each_phase_and_status_is_kept(tmp_path):
    db = history.connect(tmp_path / "h.sqlite")
    two = fake_results("two", [100.0, 110.0], phases=("pretrain", "finetune"))
    run = store(db, two, requested=3)
    st = history.stats_of(db, run)
    assert list(st) == ["pretrain", "finetune"] and st["finetune"]["tokens_per_gpu_s"]["median"] == 105.0
    assert [(p["round"], p["phase"]) for p in history.phases_of(db, run)] == [
        (1, "pretrain"),
        (1, "finetune"),
        (2, "pretrain"),
        (2, "finetune"),
    ]
    row = db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()
    assert history.rounds_text(row) == "2/0/0/1" and row["good"] == 0  # the round that never ran counts as failed
    # unjudged rounds are clean: their figures count, the loss says not judged; invalid ones are not
    unj = store(db, fake_results("unjudged", [100.0], aligned=None))
    inv = store(db, fake_results("invalid", [100.0, 200.0], aligned=False))
    rows = {r["run_id"]: r for r in db.execute("SELECT * FROM runs")}
    assert (history.rounds_text(rows["unjudged"]), rows["unjudged"]["good"], rows["unjudged"]["loss_aligned"]) == ("0/1/0/0", 1, None)
    assert (history.rounds_text(rows["invalid"]), rows["invalid"]["good"], rows["invalid"]["loss_aligned"]) == ("0/0/2/0", 0, 0)
    assert history.stats_of(db, unj)["train"]["tokens_per_gpu_s"]["n"] == 1
    assert history.stats_of(db, inv)["train"]["tokens_per_gpu_s"]["n"] == 0  # not a result
    # the allocator's retries are kept beside the figures (median over rounds), none where none was recorded
    tight = fake_results("tight", [100.0, 100.0, 100.0])
    for rnd, n in zip(tight.rounds, (4, 0, 6)):
        rnd.phases[0] = rnd.phases[0].model_copy(update={"alloc_retries": n})
    assert history.stats_of(db, store(db, tight))["train"]["alloc_retries"]["median"] == 4.0
    assert history.stats_of(db, unj)["train"]["alloc_retries"]["n"] == 0


SCHEMA_1 = """
CREATE TABLE nights (id INTEGER PRIMARY KEY AUTOINCREMENT, started TEXT NOT NULL, finished TEXT, runlist_path TEXT NOT NULL,
  runlist_text TEXT NOT NULL, host TEXT NOT NULL, exit_status INTEGER, report_path TEXT);
CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, night_id INTEGER REFERENCES nights(id), run_id TEXT NOT NULL UNIQUE,
  case_key TEXT NOT NULL, vendor TEXT NOT NULL, hardware_key TEXT NOT NULL, config_key TEXT NOT NULL, config_name TEXT NOT NULL,
  variant TEXT, started TEXT NOT NULL, finished TEXT, run_dir TEXT, rounds_requested INTEGER NOT NULL, rounds_ok INTEGER NOT NULL,
  rounds_failed INTEGER NOT NULL, loss_aligned INTEGER, good INTEGER NOT NULL, verdict TEXT NOT NULL,
  baseline_runs INTEGER NOT NULL DEFAULT 0, baseline_json TEXT NOT NULL, tolerances_json TEXT NOT NULL, error TEXT,
  system_json TEXT NOT NULL, settings_json TEXT NOT NULL, overrides_json TEXT NOT NULL, user_overrides_json TEXT NOT NULL,
  hardware_json TEXT NOT NULL);
CREATE INDEX runs_identity ON runs (case_key, vendor, hardware_key, config_key, started);
CREATE TABLE run_stats (run INTEGER NOT NULL REFERENCES runs(id), metric TEXT NOT NULL, n INTEGER NOT NULL, median REAL, min REAL,
  max REAL, q1 REAL, q3 REAL, olympic REAL, PRIMARY KEY (run, metric));
CREATE TABLE rounds (run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL, status TEXT NOT NULL, error TEXT, duration_s REAL,
  tokens_per_gpu_s REAL, mfu_6n REAL, mfu_palm REAL, peak_mem_gib REAL, loss_mre REAL, loss_aligned INTEGER, PRIMARY KEY (run, round));
CREATE TABLE losses (run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL, phase TEXT NOT NULL, step INTEGER NOT NULL,
  loss REAL, PRIMARY KEY (run, round, phase, step));
CREATE TABLE findings (run INTEGER NOT NULL REFERENCES runs(id), metric TEXT NOT NULL, baseline REAL, now REAL, change REAL,
  tolerance REAL, message TEXT NOT NULL);
PRAGMA user_version = 1;
"""  # history.py's schema 1, as databases written before phases were kept have it


def test_a_schema1_database_is_migrated(tmp_path):
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA_1)
    for run, case, phases in (
        (1, "llama3_tiny:megatron:cpu:1:2", ["train"]),
        (2, "llava_tiny:deepspeed:cpu:1:2", ["finetune", "pretrain"]),
    ):
        old.execute(
            "INSERT INTO runs VALUES (?, NULL, ?, ?, 'cpu', 'hw', 'cfg', 'config_cpux1x2', NULL, '2026-01-01', NULL, NULL, 1, 1, 0,"
            " 1, 1, 'pass', 0, '{}', '{}', NULL, '{}', '{}', '[]', '[]', '{}')",
            (run, f"run{run}", case),
        )
        old.execute("INSERT INTO rounds VALUES (?, 1, 'ok', NULL, 10.0, ?, 0.1, 0.2, 0.4, 0.01, 1)", (run, 100.0 * run))
        old.execute("INSERT INTO run_stats VALUES (?, 'tokens_per_gpu_s', 1, ?, ?, ?, ?, ?, NULL)", (run, *[100.0 * run] * 5))
        old.executemany("INSERT INTO losses VALUES (?, 1, ?, 1, 5.0)", [(run, ph) for ph in phases])
    old.commit()
    old.close()
    db = history.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION == 3
    # the round figures were the first phase's: llava's is pretrain (its case's order, not the alphabet)
    assert [(p["run"], p["phase"], p["tokens_per_gpu_s"], p["loss_verdict"]) for p in db.execute("SELECT * FROM phases ORDER BY run")] == [
        (1, "train", 100.0, "aligned"),
        (2, "pretrain", 200.0, "aligned"),
    ]
    assert history.stats_of(db, 2) == {
        "pretrain": {
            "tokens_per_gpu_s": {
                "run": 2,
                "phase": "pretrain",
                "metric": "tokens_per_gpu_s",
                "n": 1,
                "median": 200.0,
                "min": 200.0,
                "max": 200.0,
                "q1": 200.0,
                "q3": 200.0,
                "olympic": None,
            }
        }
    }
    assert {r[1] for r in db.execute("PRAGMA table_info(rounds)")} == {"run", "round", "status", "error", "duration_s"}
    assert history.environment_of(db.execute("SELECT * FROM runs WHERE id = 1").fetchone()) is None  # schema 3: none recorded then
    assert history.rounds_text(db.execute("SELECT * FROM runs WHERE id = 1").fetchone()) == "1/0/0/0"
    store(db, fake_results("new", [100.0]))  # and it takes new runs as a fresh one does
    db.close()
    assert history.connect(path).execute("SELECT count(*) FROM runs").fetchone()[0] == 3


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
    assert "1/0/0/1" in out and "regressed" in out  # run_b: one ok, one failed
    assert out.index("20260101-010000") < out.index("20260102-010000")  # oldest first
    assert history.main(["list", "--case", CASE, "--db", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in rows] == [run_a, run_b, run_c]
    assert rows[0]["stats"]["train"]["tokens_per_gpu_s"]["olympic"] == 130.0
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


def test_the_ranks_environment_is_kept_with_the_run(tmp_path):
    """Schema 3: what the ranks recorded of their environment (run_meta ``environment``) is kept
    per run and read back as recorded; a run that recorded none reads None, not an empty record.
    A schema-2 file gains the column on opening, its runs reading None."""
    db = history.connect(tmp_path / "h.sqlite")
    res = fake_results("env", [100.0, 100.0])
    for rnd in res.rounds:
        rnd.phases[0] = rnd.phases[0].model_copy(
            update={"meta": {"environment": {"NCCL_MAX_CTAS": "16", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}}
        )
    with_env, without = store(db, res), store(db, fake_results("plain", [100.0]))
    row = lambda run: db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()
    assert history.environment_of(row(with_env)) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_MAX_CTAS": "16"}
    assert history.environment_of(row(without)) is None
    db.close()
    two = tmp_path / "two.sqlite"
    db = history.connect(two)
    old = store(db, fake_results("old", [100.0]))
    db.close()
    raw = sqlite3.connect(two)
    raw.execute("ALTER TABLE runs DROP COLUMN environment_json")  # the runs table as schema 2 has it
    raw.execute("PRAGMA user_version = 2")
    raw.commit()
    raw.close()
    db = history.connect(two)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 3
    assert history.environment_of(row(old)) is None
    assert history.environment_of(row(store(db, res)))["NCCL_MAX_CTAS"] == "16"
