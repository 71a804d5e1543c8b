"""Nightly rounds on real runs of the tiny CPU case, through the real orchestrator.

Three nights over one history file, each a ``python -m run_benchmarks.nightly.driver`` process
as CI starts it:

1. seed: no history yet -> "baseline: none", exit 0;
2. unchanged: same case, same machine -> pass against the seed, exit 0;
3. slowed: the same run list while the machine really gives it less CPU -> the throughput
   regression is flagged, exit 1, naming the case and the baseline against the new figure.

The slow-down is real, not written into the history: the slowed nightly process and every
rank it starts run in a cgroup whose quota (``cpu.cfs_quota_us``) is half of one CPU while
the ranks train (from their ``run_meta`` record to ``run_end``; the start-up and the report
run unthrottled), where the ranks of the other nights had two CPUs; where cgroups cannot be
written it is pinned to one CPU shared with three busy-looping neighbours instead, the whole
night.  Either is several times slower, far beyond the throughput tolerance of 50 %, which
is wide so that the unchanged night passes on a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from run_benchmarks.nightly import history
from run_benchmarks.planning.registry import ROOT
from tests.test_report_browser import assert_loads_offline_with_plots, load_page
from training import metriclog as ml

CASE = "llama3_tiny:megatron:cpu:1:2"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1 CPU controller
CPU_SHARE = 50  # percent of one CPU for the slowed night (the others have two CPUs: 4 x less)
NEIGHBOURS = 3  # without cgroups: busy loops sharing the one CPU the slowed night may use


def write_runlist(tmp: Path, python: str, rounds: int, sets: str = "[]", reference: str | None = None) -> Path:
    path = tmp / f"nightly-{rounds}.yaml"
    ref = f", reference: {reference}" if reference else ""
    path.write_text(
        f"log_dir: logs\nhistory_db: history.sqlite\npython: {python}\nround_timeout_s: 600\nbaseline_runs: 5\n"
        "tolerances: {throughput_drop_pct: 50, memory_rise_pct: 25}\n"
        f"cases:\n  - {{case: '{CASE}', vendor: cpu, rounds: {rounds}, set: {sets}{ref}}}\n"
    )
    return path


def nightly(runlist: Path, setup: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    """One nightly process; ``setup`` runs in it before it starts (its ranks inherit the result)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "run_benchmarks.nightly.driver", str(runlist)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=runlist.parent,
        env=env,
        preexec_fn=setup,
    )


def _training(log_dir: Path, old: set[Path]) -> tuple[bool, bool]:
    """Whether a run in ``log_dir`` not among ``old`` has begun training (a rank's
    ``run_meta``) and whether it has ended (``run_end``)."""
    logs = [f for run in log_dir.glob("*") if run not in old for f in run.glob("round*/node*/ranks/**/*.log") if f.is_file()]
    parsed = [ml.parse_file(f) for f in logs]
    return any(p.of(ml.EV_META) for p in parsed), any(p.of(ml.EV_END) for p in parsed)


@contextlib.contextmanager
def less_cpu(log_dir: Path) -> Iterator[Callable[[], None]]:
    """A process setup that really slows a run down: half of one CPU (cgroup v1 CPU quota)
    while the ranks of the run that starts in ``log_dir`` train, or else one CPU shared with
    busy-looping neighbours."""
    group: Path | None = CGROUP_CPU / f"flagbench-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("-1")  # no limit until the ranks train
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        group = None
    if group is not None:
        procs, quota = group / "cgroup.procs", group / "cpu.cfs_quota_us"
        old, done = set(log_dir.glob("*")), threading.Event()

        def throttle() -> None:  # polls the rank logs (20 a second): steps take 70 ms unthrottled
            while not done.wait(0.05) and not _training(log_dir, old)[0]:
                pass
            quota.write_text(str(100000 * CPU_SHARE // 100))
            while not done.wait(0.2) and not _training(log_dir, old)[1]:
                pass
            quota.write_text("-1")

        watch = threading.Thread(target=throttle, daemon=True)
        watch.start()
        try:
            yield lambda: procs.write_text(str(os.getpid()))
        finally:
            done.set()
            watch.join()
            with contextlib.suppress(OSError):  # empty again once the nightly and its ranks exited
                group.rmdir()
        return
    cpu = min(os.sched_getaffinity(0))
    pin = lambda: os.sched_setaffinity(0, {cpu})
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin) for _ in range(NEIGHBOURS)]
    try:
        yield pin
    finally:
        for p in hogs:
            p.kill()
            p.wait()


@pytest.mark.alone  # its nights compare speeds: tests/parallel.py
@pytest.mark.framework("megatron")
def test_history_and_verdicts_on_real_runs(tmp_path, megatron_python):
    runlist = write_runlist(tmp_path, megatron_python, rounds=2)

    seed = nightly(runlist)
    assert seed.returncode == 0, seed.stdout + seed.stderr
    assert "baseline: none" in seed.stdout and "0 finding(s)" in seed.stdout

    same = nightly(runlist)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "REGRESSION" not in same.stdout

    with less_cpu(tmp_path / "logs") as setup:
        slow = nightly(write_runlist(tmp_path, megatron_python, rounds=1), setup)
    assert slow.returncode == 1, slow.stdout + slow.stderr
    regressions = [ln for ln in slow.stdout.splitlines() if ln.startswith("REGRESSION")]
    assert len(regressions) == 1, slow.stdout
    assert regressions[0].startswith(f"REGRESSION {CASE} on cpu (config_cpux1x2): tokens/p/s median ")
    assert "vs baseline" in regressions[0] and "(median of 2 run(s))" in regressions[0] and "tolerance -50%" in regressions[0]

    db = history.connect(tmp_path / "history.sqlite")
    runs = db.execute("SELECT * FROM runs ORDER BY id").fetchall()
    assert [r["verdict"] for r in runs] == ["baseline: none", "pass", "regressed"]
    assert [(r["rounds_requested"], r["rounds_ok"], r["rounds_failed"]) for r in runs] == [(2, 2, 0), (2, 2, 0), (1, 1, 0)]
    assert len({history.identity_of(r)["config_key"] for r in runs}) == 1  # the same config all three nights
    assert [r["loss_aligned"] for r in runs] == [1, 1, 1]  # slower, but the same training
    meds = [history.stats_of(db, r["id"])["train"]["tokens_per_gpu_s"]["median"] for r in runs]
    baseline = json.loads(runs[2]["baseline_json"])["train"]["tokens_per_gpu_s"]
    assert baseline == pytest.approx((meds[0] + meds[1]) / 2)
    assert meds[2] < 0.5 * baseline
    (finding,) = db.execute("SELECT * FROM findings").fetchall()
    assert finding["metric"] == "tokens/p/s" and finding["now"] == pytest.approx(meds[2])

    # what each run stored: system, settings, every round, and the loss curve of every round
    first = runs[0]
    assert json.loads(first["system_json"])["host"] and json.loads(first["settings_json"])["train"]["steps"] == 30
    rounds = history.phases_of(db, first["id"])
    assert [(r["round"], r["phase"], r["status"], r["loss_verdict"]) for r in rounds] == [(n, "train", "ok", "aligned") for n in (1, 2)]
    assert all(r["tokens_per_gpu_s"] > 0 and r["peak_mem_gib"] > 0 and r["device_mem_used_gib"] is None for r in rounds)
    curves = history.losses_of(db, first["id"])
    assert sorted(curves[(0, "train")]) == list(range(1, 31))  # the committed reference it was compared with
    for rnd in (1, 2):
        loss = curves[(rnd, "train")]
        assert sorted(loss) == list(range(1, 31)) and loss[30] < loss[1]
    results = json.loads((Path(first["run_dir"]) / "results.json").read_text())
    assert {int(k): v for k, v in results["rounds"][0]["phases"][0]["loss"].items()} == curves[(1, "train")]

    assert history.main(["list", "--case", CASE, "--vendor", "cpu", "--db", str(tmp_path / "history.sqlite")]) == 0

    night = db.execute("SELECT * FROM nights ORDER BY id DESC").fetchone()
    assert night["exit_status"] == 1
    page = load_page(Path(night["report_path"]), tmp_path / "profile")
    assert_loads_offline_with_plots(page, plots=3)
    assert "regressed" in page["text"] and CASE in page["text"]
    index = load_page(tmp_path / "logs" / "reports" / "index.html", tmp_path / "profile2")
    assert_loads_offline_with_plots(index, plots=1)
    assert len([link for link in index["links"] if link.startswith("nightly-")]) == 3


@pytest.mark.framework("megatron")
def test_a_loss_that_stops_aligning_fails_the_night(tmp_path, megatron_python):
    """A real run that trains differently (a tenth of the learning rate) than its committed
    reference curve, named in the run list (a --set of the learning rate leaves the recipe, which
    the committed reference alone would then not judge): the loss no longer aligns, the night
    fails and names the case."""
    committed = ROOT / "cases/llama3/megatron/reference/llama3_tiny/standard.json"
    proc = nightly(write_runlist(tmp_path, megatron_python, rounds=1, sets="[train.lr=0.0003]", reference=str(committed)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("REGRESSION")]
    assert line.startswith(f"REGRESSION {CASE} on cpu (config_cpux1x2): loss no longer aligns with the reference: MRE ")
    assert line.endswith("% over steps 21-30 (at least 2%) (baseline: none)")
    db = history.connect(tmp_path / "history.sqlite")
    run = db.execute("SELECT * FROM runs").fetchone()
    assert (run["loss_aligned"], run["good"], run["verdict"]) == (0, 0, "regressed")
    (rnd,) = history.phases_of(db, run["id"])
    assert (rnd["status"], rnd["loss_verdict"]) == ("invalid", "not aligned") and rnd["loss_mre"] > 0.02


def test_the_documented_example_passes_its_first_night(tmp_path, megatron_python):
    """examples/nightly.yaml as docs/nightly.md gives it, on a fresh history: every round of
    every case it lists ran, was judged and is ok; the night exits 0. Only where it writes is
    moved into the test's folder (its log_dir and history_db), and the environment's Python named."""
    text = (ROOT / "examples" / "nightly.yaml").read_text()
    text = text.replace("log_dir: ../logs/nightly", "log_dir: logs").replace("history_db: null", "history_db: history.sqlite")
    assert "log_dir: logs" in text and "history_db: history.sqlite" in text
    runlist = tmp_path / "nightly.yaml"
    runlist.write_text(f"python: {megatron_python}\n" + text)
    proc = nightly(runlist)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = sorted((tmp_path / "logs").glob("*/results.json"))
    assert len(results) == 2
    for f in results:
        res = json.loads(f.read_text())
        assert res["status"] == "ok" and all(r["status"] == "ok" for r in res["rounds"]), [r["error"] for r in res["rounds"]]
        assert all(p["gate"]["verdict"] == "aligned" for r in res["rounds"] for p in r["phases"])
