"""Benchmark history in one SQLite file: nights, case runs, rounds and their phases, loss curves, verdicts.

``python -m run_benchmarks.nightly.history list --case llama3_tiny:megatron:cpu:1:2 [--vendor cpu] [--db PATH]``
prints a case's runs as a table, a line per phase.  The schema (``SCHEMA``) is versioned with
``PRAGMA user_version``; a file written by a newer harness is refused, never rewritten, and
one of schema 1 (one set of figures per round) is migrated in place on opening.  Every
figure is kept per phase; a run's statistics are over its clean rounds (ok or unjudged).

A run's identity for comparisons is (case_key, vendor, hardware_key, config_key):
``case_key`` is ``model:framework:hardware:nnodes:nprocs`` (the size without the
repeat count), ``config_key`` hashes the config name and the resolved settings after
every override, ``hardware_key`` names the chip and the machines it ran on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sqlite3
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from run_benchmarks.errors import InputError
from run_benchmarks.planning import registry
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.typed_results import PhaseResult, RunResults, recorded_environment

SCHEMA_VERSION = 3
#: the figures aggregated per run and phase, over its clean rounds (ok or unjudged)
METRICS = (
    "tokens_per_gpu_s",
    "mfu_6n",
    "mfu_palm",
    "peak_mem_gib",
    "device_mem_used_gib",
    "sm_clock_mhz",
    "alloc_retries",
    "tokens_per_joule",
)
OLYMPIC_MIN_ROUNDS = 5  # MLPerf-style: drop the fastest and the slowest from 5 rounds on

SCHEMA = """
CREATE TABLE nights (               -- one nightly invocation over a run list
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  started TEXT NOT NULL, finished TEXT,
  runlist_path TEXT NOT NULL, runlist_text TEXT NOT NULL,
  host TEXT NOT NULL,
  exit_status INTEGER,               -- NULL while running
  report_path TEXT
);
CREATE TABLE runs (                 -- one case run: one results.json
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  night_id INTEGER REFERENCES nights(id),
  run_id TEXT NOT NULL UNIQUE,
  case_key TEXT NOT NULL, vendor TEXT NOT NULL,
  hardware_key TEXT NOT NULL, config_key TEXT NOT NULL,
  config_name TEXT NOT NULL, variant TEXT,
  started TEXT NOT NULL, finished TEXT, run_dir TEXT,
  rounds_requested INTEGER NOT NULL, rounds_ok INTEGER NOT NULL, rounds_failed INTEGER NOT NULL,  -- failed: or never ran
  loss_aligned INTEGER,              -- 1 every phase of every clean round aligned, 0 a round invalid, NULL not judged
  good INTEGER NOT NULL,             -- 1: no failed or invalid round; feeds baselines
  verdict TEXT NOT NULL,             -- pass | regressed | baseline: none
  baseline_runs INTEGER NOT NULL DEFAULT 0,  -- how many good runs the baseline is the median of
  baseline_json TEXT NOT NULL,       -- phase -> metric -> baseline median at judging time
  tolerances_json TEXT NOT NULL,     -- the tolerances (percent) the run was judged with
  error TEXT,
  system_json TEXT NOT NULL, settings_json TEXT NOT NULL, overrides_json TEXT NOT NULL,
  user_overrides_json TEXT NOT NULL, hardware_json TEXT NOT NULL,
  rounds_unjudged INTEGER NOT NULL DEFAULT 0, rounds_invalid INTEGER NOT NULL DEFAULT 0,
  environment_json TEXT              -- what the ranks recorded of their environment; NULL: nothing recorded
);
CREATE INDEX runs_identity ON runs (case_key, vendor, hardware_key, config_key, started);
CREATE TABLE run_stats (            -- per run, phase and metric, over its clean rounds
  run INTEGER NOT NULL REFERENCES runs(id), phase TEXT NOT NULL, metric TEXT NOT NULL,
  n INTEGER NOT NULL, median REAL, min REAL, max REAL, q1 REAL, q3 REAL,
  olympic REAL,                      -- mean without fastest and slowest; NULL under 5 rounds
  PRIMARY KEY (run, phase, metric)
);
CREATE TABLE rounds (
  run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL,
  status TEXT NOT NULL, error TEXT, duration_s REAL,   -- ok | unjudged | invalid | failed
  PRIMARY KEY (run, round)
);
CREATE TABLE phases (               -- every phase of every round, whatever its status
  run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL, phase TEXT NOT NULL,
  tokens_per_gpu_s REAL, mfu_6n REAL, mfu_palm REAL, step_time_s REAL,
  peak_mem_gib REAL,                 -- the allocator's peak
  device_mem_used_gib REAL, device_mem_total_gib REAL,  -- in use, as the monitor saw it
  loss_verdict TEXT NOT NULL, loss_mre REAL, loss_reason TEXT,
  PRIMARY KEY (run, round, phase)
);
CREATE TABLE losses (               -- round 0: the reference curve compared against
  run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL, phase TEXT NOT NULL,
  step INTEGER NOT NULL, loss REAL,
  PRIMARY KEY (run, round, phase, step)
);
CREATE TABLE findings (             -- what made a run's verdict 'regressed'
  run INTEGER NOT NULL REFERENCES runs(id),
  metric TEXT NOT NULL, baseline REAL, now REAL, change REAL, tolerance REAL,
  message TEXT NOT NULL, phase TEXT  -- NULL: the whole run (failed rounds)
);
"""

# Schema 1 kept one set of figures per round (the first phase's); schema 2 keeps every phase.
MIGRATE_1_TO_2 = """
ALTER TABLE runs ADD COLUMN rounds_unjudged INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN rounds_invalid INTEGER NOT NULL DEFAULT 0;
ALTER TABLE findings ADD COLUMN phase TEXT;
CREATE TABLE phases (
  run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL, phase TEXT NOT NULL,
  tokens_per_gpu_s REAL, mfu_6n REAL, mfu_palm REAL, step_time_s REAL,
  peak_mem_gib REAL, device_mem_used_gib REAL, device_mem_total_gib REAL,
  loss_verdict TEXT NOT NULL, loss_mre REAL, loss_reason TEXT,
  PRIMARY KEY (run, round, phase)
);
INSERT INTO phases SELECT r.run, r.round, f.phase, r.tokens_per_gpu_s, r.mfu_6n, r.mfu_palm, NULL, r.peak_mem_gib, NULL, NULL,
  CASE r.loss_aligned WHEN 1 THEN 'aligned' WHEN 0 THEN 'not aligned' ELSE 'not judged' END, r.loss_mre,
  'recorded by history schema 1' FROM rounds r JOIN first_phase f ON f.run = r.run;
CREATE TABLE rounds_2 (
  run INTEGER NOT NULL REFERENCES runs(id), round INTEGER NOT NULL,
  status TEXT NOT NULL, error TEXT, duration_s REAL,
  PRIMARY KEY (run, round)
);
INSERT INTO rounds_2 SELECT run, round, status, error, duration_s FROM rounds;
DROP TABLE rounds;
ALTER TABLE rounds_2 RENAME TO rounds;
CREATE TABLE run_stats_2 (
  run INTEGER NOT NULL REFERENCES runs(id), phase TEXT NOT NULL, metric TEXT NOT NULL,
  n INTEGER NOT NULL, median REAL, min REAL, max REAL, q1 REAL, q3 REAL, olympic REAL,
  PRIMARY KEY (run, phase, metric)
);
INSERT INTO run_stats_2 SELECT s.run, f.phase, s.metric, s.n, s.median, s.min, s.max, s.q1, s.q3, s.olympic
  FROM run_stats s JOIN first_phase f ON f.run = s.run;
DROP TABLE run_stats;
ALTER TABLE run_stats_2 RENAME TO run_stats;
DROP TABLE first_phase;
"""


# Schema 3 keeps what the ranks recorded of their environment (the vendor's recorded_env).
MIGRATE_2_TO_3 = "ALTER TABLE runs ADD COLUMN environment_json TEXT;"


def default_db() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "flagbench" / "history.sqlite"


def connect(path: str | os.PathLike[str], create: bool = True) -> sqlite3.Connection:
    """Open (and create or check) a history file."""
    p = Path(path).expanduser()
    if not create and not p.is_file():
        raise InputError(f"{p}: no history database there")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(p, timeout=30)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA foreign_keys = ON")
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except (sqlite3.DatabaseError, OSError) as exc:
        raise InputError(f"{p}: not a usable history database: {exc}") from None
    if version > SCHEMA_VERSION:
        db.close()
        raise InputError(f"{p}: history schema {version} is newer than this harness's ({SCHEMA_VERSION}); use a newer flagbench")
    if version == 0:
        if db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            db.close()
            raise InputError(f"{p}: an SQLite file that is not a flagbench history (no schema version)")
        with db:
            db.executescript(SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    else:
        if version == 1:
            _migrate_1_to_2(db)
        if version <= 2:
            db.executescript("BEGIN;\n" + MIGRATE_2_TO_3 + "\nPRAGMA user_version = 3;\nCOMMIT;")
    return db


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    """Schema 1 -> 2 in one transaction: its round figures become the first phase's rows."""
    db.execute("CREATE TEMP TABLE first_phase (run INTEGER PRIMARY KEY, phase TEXT NOT NULL)")
    db.executemany("INSERT INTO first_phase VALUES (?, ?)", _first_phases(db))
    try:
        db.executescript("BEGIN;\n" + MIGRATE_1_TO_2 + "PRAGMA user_version = 2;\nCOMMIT;")
    except sqlite3.DatabaseError:
        db.rollback()
        raise


def _first_phases(db: sqlite3.Connection) -> list[tuple[int, str]]:
    """Per run, the phase its schema-1 round figures belonged to: the first of its case."""
    out = []
    for row in db.execute("SELECT id, case_key FROM runs").fetchall():
        seen = [r[0] for r in db.execute("SELECT DISTINCT phase FROM losses WHERE run = ? AND round > 0", (row["id"],))]
        if len(seen) == 1:
            out.append((row["id"], seen[0]))
            continue
        try:
            out.append((row["id"], registry.find_case(CaseName.parse(row["case_key"])).config.phases[0]))
        except InputError:  # a case this checkout does not have
            out.append((row["id"], sorted(seen)[0] if seen else "train"))
    return out


# --------------------------------------------------------------------------- keys and stats


def case_key(case: str | CaseName) -> str:
    """``model:framework:hardware:nnodes:nprocs``; the repeat count is not part of a case."""
    cn = CaseName.parse(case) if isinstance(case, str) else case
    return f"{cn.model}:{cn.framework}:{cn.hardware}:{cn.nnodes}:{cn.nprocs}"


def config_key(config_name: str, settings: dict[str, Any]) -> str:
    text = json.dumps({"config": config_name, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hardware_key(chip: str, backend: str, hosts: Iterable[str], cpu_model: str | None) -> str:
    """The chip plus the machines: this host's CPU for local runs, the host names otherwise."""
    where = f"{cpu_model or 'unknown cpu'}" if backend == "local" else ",".join(sorted(hosts))
    return f"{chip}|{backend}|{where}"


def cpu_model() -> str | None:
    """This host's CPU model and logical core count, e.g. ``AMD EPYC 7B13 x2``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return None


def value_stats(values: list[float]) -> dict[str, Any]:
    """Median, min/max, quartiles and (from 5 values on) the olympic mean."""
    xs = sorted(values)
    out: dict[str, Any] = {"n": len(xs), "median": None, "min": None, "max": None, "q1": None, "q3": None, "olympic": None}
    if not xs:
        return out
    q1, q3 = statistics.quantiles(xs, n=4, method="inclusive")[::2] if len(xs) > 1 else (xs[0], xs[0])
    out.update(median=statistics.median(xs), min=xs[0], max=xs[-1], q1=q1, q3=q3)
    if len(xs) >= OLYMPIC_MIN_ROUNDS:
        out["olympic"] = statistics.fmean(xs[1:-1])
    return out


def round_stats(res: RunResults) -> dict[str, dict[str, dict[str, Any]]]:
    """Per phase and metric, the summary over the clean rounds (failed and invalid ones are counted apart)."""
    clean = [r for r in res.rounds if r.clean]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for phase in res.phases:
        figs = [_figures(p) for r in clean for p in r.phases if p.phase == phase]
        out[phase] = {m: value_stats([f[m] for f in figs if f[m] is not None]) for m in METRICS}
    return out


def _figures(p: PhaseResult) -> dict[str, float | None]:
    """The METRICS of one phase of one round."""
    return {
        "tokens_per_gpu_s": p.tokens_per_gpu_s,
        "mfu_6n": p.mfu_6n,
        "mfu_palm": p.mfu_palm,
        "peak_mem_gib": p.peak_mem_gib,
        "device_mem_used_gib": p.device_mem.used_gib if p.device_mem else None,
        "sm_clock_mhz": p.device_clocks.sm_median_mhz if p.device_clocks else None,  # the median over the phase's steps
        "tokens_per_joule": p.device_energy.tokens_per_joule if p.device_energy else None,  # per device, over the window
        "alloc_retries": None if p.alloc_retries is None else float(p.alloc_retries),  # the allocator's cache flushes
    }


def loss_verdict(res: RunResults) -> bool | None:
    """False: a round was invalid (a phase not aligned); True: every phase of every clean round
    aligned; None: something not judged, or no clean round."""
    if any(r.status == "invalid" for r in res.rounds):
        return False
    flags = [p.gate.aligned for r in res.rounds if r.clean for p in r.phases]
    return None if not flags or None in flags else all(flags)


def status_counts(res: RunResults, rounds_requested: int) -> dict[str, int]:
    """Rounds per status; rounds that never ran count as failed."""
    counts = {st: sum(1 for r in res.rounds if r.status == st) for st in ("ok", "unjudged", "invalid")}
    counts["failed"] = rounds_requested - sum(counts.values())
    return counts


# --------------------------------------------------------------------------- writing


def start_night(db: sqlite3.Connection, started: str, runlist_path: str, runlist_text: str, host: str) -> int:
    with db:
        cur = db.execute(
            "INSERT INTO nights (started, runlist_path, runlist_text, host) VALUES (?, ?, ?, ?)",
            (started, runlist_path, runlist_text, host),
        )
    return int(cur.lastrowid or 0)


def finish_night(db: sqlite3.Connection, night: int, finished: str, exit_status: int, report_path: str | None) -> None:
    with db:
        db.execute(
            "UPDATE nights SET finished = ?, exit_status = ?, report_path = ? WHERE id = ?", (finished, exit_status, report_path, night)
        )


def _loss_points(curve: dict[Any, Any] | None) -> list[tuple[int, float | None]]:
    """(step, loss) rows; a NaN or inf loss is stored as NULL (SQLite has no NaN)."""
    return sorted((int(s), float(v) if v is not None and math.isfinite(v) else None) for s, v in (curve or {}).items())


def record_run(
    db: sqlite3.Connection,
    night: int | None,
    res: RunResults,
    *,
    hardware: str,
    variant: str | None,
    rounds_requested: int,
    verdict: str,
    baseline_runs: int,
    findings: list[dict[str, Any]],
    baseline: dict[str, dict[str, float | None]] | None = None,
    tolerances: dict[str, float] | None = None,
    error: str | None = None,
    run_dir: str | None = None,
    reference: dict[str, dict[int, float]] | None = None,
) -> int:
    """Store one case run with its rounds, phases, stats, loss curves and findings; returns its row id."""
    n = status_counts(res, rounds_requested)
    aligned = loss_verdict(res)
    good = int(n["failed"] == 0 and n["invalid"] == 0 and n["ok"] + n["unjudged"] > 0)
    env = recorded_environment(res.rounds)
    j = lambda x: json.dumps(x, sort_keys=True, default=str)
    with db:
        cur = db.execute(
            "INSERT INTO runs (night_id, run_id, case_key, vendor, hardware_key, config_key, config_name, variant,"
            " started, finished, run_dir, rounds_requested, rounds_ok, rounds_unjudged, rounds_invalid, rounds_failed,"
            " loss_aligned, good, verdict, baseline_runs, baseline_json, tolerances_json, error, system_json, settings_json,"
            " overrides_json, user_overrides_json, hardware_json, environment_json)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                night,
                res.run_id,
                case_key(res.case),
                res.vendor,
                hardware,
                config_key(res.config_name, res.settings),
                res.config_name,
                variant,
                res.started,
                res.finished,
                run_dir,
                rounds_requested,
                n["ok"],
                n["unjudged"],
                n["invalid"],
                n["failed"],
                None if aligned is None else int(aligned),
                good,
                verdict,
                baseline_runs,
                j(baseline or {}),
                j(tolerances or {}),
                error,
                j(res.system),
                j(res.settings),
                j(res.overrides),
                j(res.user_overrides),
                j(res.hardware_info),
                None if env is None else j(env),
            ),
        )
        run = int(cur.lastrowid or 0)
        for phase, stats in round_stats(res).items():
            db.executemany(
                "INSERT INTO run_stats VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(run, phase, m, s["n"], s["median"], s["min"], s["max"], s["q1"], s["q3"], s["olympic"]) for m, s in stats.items()],
            )
        for r in res.rounds:
            db.execute("INSERT INTO rounds VALUES (?, ?, ?, ?, ?)", (run, r.round, r.status, r.error, r.duration_s))
            for p in r.phases:
                dm = p.device_mem
                db.execute(
                    "INSERT INTO phases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        run,
                        r.round,
                        p.phase,
                        p.tokens_per_gpu_s,
                        p.mfu_6n,
                        p.mfu_palm,
                        p.step_time_s,
                        p.peak_mem_gib,
                        dm.used_gib if dm else None,
                        dm.total_gib if dm else None,
                        p.gate.verdict,
                        p.gate.mre,
                        p.gate.reason,
                    ),
                )
                db.executemany(
                    "INSERT INTO losses VALUES (?, ?, ?, ?, ?)", [(run, r.round, p.phase, s, v) for s, v in _loss_points(p.loss)]
                )
        for phase, curve in (reference or {}).items():
            db.executemany("INSERT INTO losses VALUES (?, 0, ?, ?, ?)", [(run, phase, s, v) for s, v in _loss_points(curve)])
        db.executemany(
            "INSERT INTO findings (run, metric, baseline, now, change, tolerance, message, phase) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (run, f["metric"], f.get("baseline"), f.get("now"), f.get("change"), f.get("tolerance"), f["message"], f.get("phase"))
                for f in findings
            ],
        )
    return run


# --------------------------------------------------------------------------- reading


def stats_of(db: sqlite3.Connection, run: int) -> dict[str, dict[str, dict[str, Any]]]:
    """phase -> metric -> the run's summary over its clean rounds."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in db.execute("SELECT * FROM run_stats WHERE run = ? ORDER BY rowid", (run,)):
        out.setdefault(row["phase"], {})[row["metric"]] = dict(row)
    return out


def phases_of(db: sqlite3.Connection, run: int) -> list[sqlite3.Row]:
    """Every phase of every round of a run, with its round's status, in round and phase order."""
    return db.execute(
        "SELECT p.*, r.status, r.error FROM phases p JOIN rounds r ON r.run = p.run AND r.round = p.round"
        " WHERE p.run = ? ORDER BY p.round, p.rowid",
        (run,),
    ).fetchall()


def baseline_runs(db: sqlite3.Connection, identity: dict[str, str], limit: int, before_run: int | None = None) -> list[sqlite3.Row]:
    """The last ``limit`` good runs of one identity (case_key, vendor, hardware_key, config_key), newest first."""
    sql = "SELECT * FROM runs WHERE case_key = ? AND vendor = ? AND hardware_key = ? AND config_key = ? AND good = 1"
    args: list[Any] = [identity["case_key"], identity["vendor"], identity["hardware_key"], identity["config_key"]]
    if before_run is not None:
        sql += " AND id < ?"
        args.append(before_run)
    return db.execute(sql + " ORDER BY started DESC, id DESC LIMIT ?", (*args, limit)).fetchall()


def environment_of(row: sqlite3.Row) -> dict[str, str] | None:
    """What a stored run's ranks recorded of their environment; None where nothing was."""
    text = row["environment_json"]
    return None if text is None else json.loads(text)


def identity_of(row: sqlite3.Row | dict[str, Any]) -> dict[str, str]:
    return {k: row[k] for k in ("case_key", "vendor", "hardware_key", "config_key")}


def runs_of_identity(db: sqlite3.Connection, identity: dict[str, str], up_to_run: int | None = None) -> list[sqlite3.Row]:
    """Every run of one identity, oldest first (the trend)."""
    sql = "SELECT * FROM runs WHERE case_key = ? AND vendor = ? AND hardware_key = ? AND config_key = ?"
    args: list[Any] = [identity["case_key"], identity["vendor"], identity["hardware_key"], identity["config_key"]]
    if up_to_run is not None:
        sql += " AND id <= ?"
        args.append(up_to_run)
    return db.execute(sql + " ORDER BY started, id", args).fetchall()


def losses_of(db: sqlite3.Connection, run: int) -> dict[tuple[int, str], dict[int, float]]:
    """(round, phase) -> step -> loss; round 0 is the reference curve."""
    out: dict[tuple[int, str], dict[int, float]] = {}
    for row in db.execute("SELECT round, phase, step, loss FROM losses WHERE run = ? ORDER BY round, phase, step", (run,)):
        out.setdefault((row["round"], row["phase"]), {})[row["step"]] = row["loss"]
    return out


def case_runs(db: sqlite3.Connection, case: str, vendor: str | None = None, limit: int | None = None) -> list[sqlite3.Row]:
    sql, args = "SELECT * FROM runs WHERE case_key = ?", [case]
    if vendor:
        sql += " AND vendor = ?"
        args.append(vendor)
    rows = db.execute(
        sql + " ORDER BY started DESC, id DESC" + (" LIMIT ?" if limit else ""), (*args, *([limit] if limit else []))
    ).fetchall()
    return rows[::-1]


# --------------------------------------------------------------------------- the list command


def fmt_num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def rounds_text(row: sqlite3.Row) -> str:
    """A run's rounds by status: ``ok/unjudged/invalid/failed``."""
    return f"{row['rounds_ok']}/{row['rounds_unjudged']}/{row['rounds_invalid']}/{row['rounds_failed']}"


LOSS_TEXT = {None: "not judged", 1: "aligned", 0: "NOT aligned"}


def history_table(db: sqlite3.Connection, rows: list[sqlite3.Row], title: str) -> Table:
    """One line per run and phase; the figures are over the run's clean rounds only."""
    table = Table(title=title, title_justify="left")
    for col in (
        "started",
        "run",
        "vendor",
        "hardware",
        "config",
        "phase",
        "rounds ok/unjudged/invalid/failed",
        "tokens/p/s",
        "min-max",
        "IQR",
        "olympic",
        "MFU-6N",
        "mem alloc GiB",
        "mem in use GiB",
        "loss",
        "verdict",
    ):
        table.add_column(col, no_wrap=col not in ("hardware", "config"), overflow="fold")
    for row in rows:
        sets = json.loads(row["user_overrides_json"])
        config = row["config_name"].removeprefix("config_") + (" " + ",".join(f"{o['param']}={o['value']}" for o in sets) if sets else "")
        for phase, st in (stats_of(db, row["id"]) or {"-": {}}).items():
            tps, mfu, mem, used = (st.get(m, {}) for m in ("tokens_per_gpu_s", "mfu_6n", "peak_mem_gib", "device_mem_used_gib"))
            table.add_row(
                row["started"][:16].replace("T", " "),
                row["run_id"].rsplit("_", 1)[-1],
                row["vendor"],
                row["hardware_key"].split("|", 2)[-1],
                config,
                phase,
                rounds_text(row),
                fmt_num(tps.get("median")),
                f"{fmt_num(tps.get('min'))}-{fmt_num(tps.get('max'))}",
                f"{fmt_num(tps.get('q1'))}-{fmt_num(tps.get('q3'))}",
                fmt_num(tps.get("olympic")),
                "-" if mfu.get("median") is None else f"{100 * mfu['median']:.1f}%",
                fmt_num(mem.get("median"), ".3f"),
                fmt_num(used.get("median"), ".2f"),
                LOSS_TEXT[row["loss_aligned"]],
                row["verdict"],
            )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m run_benchmarks.nightly.history", description="query the benchmark history")
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="a case's runs, oldest first")
    ls.add_argument("--case", required=True, help="model:framework:hardware:nnodes:nprocs, e.g. llama3_tiny:megatron:cpu:1:2")
    ls.add_argument("--vendor", help="only this vendor's runs")
    ls.add_argument("--db", metavar="PATH", help=f"history file (default {default_db()})")
    ls.add_argument("--last", type=int, metavar="N", help="only the newest N runs")
    ls.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        key = case_key(args.case)
        if args.vendor:
            check_name(args.vendor, "vendor")
        if args.last is not None and args.last < 1:
            raise InputError("--last must be a positive integer")
        db = connect(args.db or default_db(), create=False)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = case_runs(db, key, args.vendor, args.last)
    if args.json:
        print(json.dumps([{**dict(r), "stats": stats_of(db, r["id"])} for r in rows], indent=2))
    elif not rows:
        print(f"no runs of {key}{' on ' + args.vendor if args.vendor else ''} in {args.db or default_db()}")
    else:
        console = Console(width=max(shutil.get_terminal_size((240, 24)).columns, 220))  # a table, never squeezed
        console.print(history_table(db, rows, f"{key}{' / ' + args.vendor if args.vendor else ''}: {len(rows)} run(s)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
