"""The live progress line: the newest step record of the ranks' logs, as the node agent
writes it to progress.json and the orchestrator shows it; and an unexpected error in the
harness as one line with its traceback in a file."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from run_benchmarks import errors, start_task
from run_benchmarks.running import progress
from training import metriclog as ml


def rank_log(path: Path, rank: int, steps: list[tuple[int, float]], phase: str = "train", tokens: int = 4096) -> None:
    """Step records as a rank writes them (the project's own emitter), with launcher noise between."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    log = ml.MetricLogger(run="r", rank=rank, stream=out)
    for step, loss in steps:
        log.step(step, loss, tokens, 0.5, 1e-4, phase=phase)
        out.write("[default0]: some framework chatter\n")
    with open(path, "a") as fh:
        fh.write(out.getvalue())


def test_the_newest_step_of_any_rank_makes_the_line(tmp_path):
    node = tmp_path / "node0"
    rank_log(node / "ranks" / "0" / "stdout.log", 0, [(1, 9.0), (2, 8.5)])
    time.sleep(0.01)
    rank_log(node / "ranks" / "1" / "stdout.log", 1, [(3, 8.1)], phase="finetune")
    snap = progress.latest(progress.rank_logs(node))
    assert (snap["phase"], snap["step"], snap["loss"]) == ("finetune", 3, 8.1)
    # 4096 tokens in 0.5 s over 2 processes
    assert progress.line([None, snap], {"finetune": 40}, world_size=2) == "finetune step 3/40, 4,096 tokens/p/s, loss 8.1"
    assert progress.line([None, None], {"train": 30}, 2) is None


def test_only_the_tail_is_read_and_a_cut_line_is_skipped(tmp_path):
    log = tmp_path / "node0" / "stdout.log"
    rank_log(log, 0, [(k, 10.0 - k / 100) for k in range(1, 2001)])  # ~0.5 MB of records
    assert log.stat().st_size > progress.TAIL_BYTES
    lines = progress.tail_lines(log)
    assert sum(len(x) + 1 for x in lines) <= progress.TAIL_BYTES
    assert progress.latest([log])["step"] == 2000
    assert progress.latest([tmp_path / "missing.log"]) is None


def test_the_agent_writer_keeps_progress_json_current(tmp_path):
    node = tmp_path / "node1"
    rank_log(node / "ranks" / "x" / "attempt_0" / "0" / "stdout.log", 0, [(1, 9.0)])
    w = progress.writer(node, every=0.1)
    w.start()
    try:
        deadline = time.monotonic() + 5
        while not (node / progress.FILE).is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads((node / progress.FILE).read_text())["step"] == 1
        rank_log(node / "ranks" / "x" / "attempt_0" / "0" / "stdout.log", 0, [(2, 8.0)])
    finally:
        w.stop()  # writes once more on the way out: the last step is there for a late reader
    assert progress.read(node)["step"] == 2
    (node / progress.FILE).write_text("{half")  # a torn file is read from the logs instead
    assert progress.read(node)["step"] == 2


def test_an_unexpected_error_is_one_line_and_its_traceback_a_file(tmp_path, monkeypatch, capsys):
    """A harness bug (here: planning raises what nothing expects) never prints a traceback."""

    def broken(*_a, **_k):
        raise KeyError("nodes")

    monkeypatch.setattr(start_task.planning, "build", broken)
    monkeypatch.setattr(errors, "CRASH_DIR", tmp_path / "crashes")
    rc = start_task.main(["--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert rc == 3 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    (log,) = (tmp_path / "crashes").iterdir()
    assert line == f"error: unexpected KeyError: 'nodes' (the traceback is in {log})"
    assert "Traceback (most recent call last)" in log.read_text() and "in broken" in log.read_text()


@pytest.mark.framework("megatron")
def test_a_crash_during_the_run_leaves_its_traceback_in_the_run_folder(tmp_path, monkeypatch, capsys, megatron_python):
    from run_benchmarks.running import orchestrator

    def broken(*_a, **_k):
        raise RuntimeError("the table could not be made")

    monkeypatch.setattr(orchestrator, "evaluate_round", broken)
    rc = start_task.main(
        [
            "--vendor",
            "cpu",
            "--case_name",
            "llama3_tiny:megatron:cpu:1:1",
            "--log-dir",
            str(tmp_path / "logs"),
            "--python",
            megatron_python,
            "--set",
            "train.steps=3",
        ]
    )
    err = capsys.readouterr().err
    (run_dir,) = (tmp_path / "logs").iterdir()
    log = run_dir / "harness-error.log"
    assert rc == 3 and f"error: unexpected RuntimeError: the table could not be made (the traceback is in {log})" in err
    assert "Traceback" not in err and "evaluate_round" in log.read_text()
    res = json.loads((run_dir / "results.json").read_text())  # the run's file still says what stopped it
    assert res["status"] == "failed" and "RuntimeError: the table could not be made" in res["error"] and res["finished"]


@pytest.mark.framework("megatron")
def test_ranks_that_do_not_report_in_time_stop_the_local_round(tmp_path, megatron_python):
    """Two local ranks cannot import torch and megatron-core and report within 1 s: the round
    stops at the startup timeout with that cause, and no rank is left running."""
    import subprocess
    import sys

    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(start_task.__file__)),
            "--vendor",
            "cpu",
            "--case_name",
            "llama3_tiny:megatron:cpu:1:2",
            "--log-dir",
            str(tmp_path),
            "--python",
            megatron_python,
            "--startup-timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and time.monotonic() - t0 < 60, proc.stdout + proc.stderr
    (run_dir,) = tmp_path.iterdir()
    res = json.loads((run_dir / "results.json").read_text())
    (rnd,) = res["rounds"]
    assert rnd["error"].startswith("node0 (localhost): no rank started training within 1 s of launch (startup_timeout_s)"), rnd["error"]
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert left == []


def test_stillness_counts_from_the_last_move_of_any_node_on_the_callers_clock():
    """A node moves when its newest step or newest record changes; a node not read this time
    keeps what it said; nothing counts before the first report."""
    still = progress.Stillness()
    assert still.update([None, None], now=100.0) is None and still.where() == "before the first step"
    started = {"started": True, "last_t": 5.0}
    assert still.update([started, None], now=101.0) == 0.0
    assert still.update([started, None], now=104.0) == 3.0  # the same record: still
    step = {"started": True, "last_t": 9.0, "phase": "train", "step": 1, "t": 9.0}
    assert still.update([started, step], now=105.0) == 0.0 and still.where() == "after step 1"
    assert still.update([None, None], now=110.0) == 5.0  # unread files are no move
    # a record of another kind (a phase's memory, its end) moves it; the newest step stays
    assert still.update([{"started": True, "last_t": 12.0}, step], now=111.0) == 0.0
    ft = {"started": True, "last_t": 20.0, "phase": "finetune", "step": 3, "t": 20.0}
    assert still.update([started, ft], now=130.0) == 0.0 and still.where() == "after finetune step 3"
    assert still.update([started, ft], now=1930.5) == 1800.5


def test_nodes_seen_stopping_closer_than_the_reads_are_both_named():
    """Progress is written and read every 2 s each, so a node seen stopping 3 s after another may
    have stopped first: the stall's blame names every node within the slack of the earliest
    stop, and only the earlier where they stopped farther apart."""
    still = progress.Stillness()

    def at(step: int) -> dict:
        return {"started": True, "last_t": float(step), "phase": "train", "step": step, "t": float(step)}

    still.update([at(1), at(1)], now=10.0)
    still.update([at(2), at(1)], now=13.0)  # node 1 seen still since 10 s, node 0 since 13 s
    slack = progress.WRITE_EVERY_S + 2.0  # the orchestrator's read interval
    assert still.still_first(slack=slack) == [0, 1]
    still.update([at(3), at(1)], now=16.0)  # node 0 moved again 6 s after node 1 stopped
    assert still.still_first(slack=slack) == [1]


def test_a_node_never_seen_is_named_with_the_first_to_stand_still():
    """A node whose ranks report no steps (none of the reporting ranks) has no progress to read:
    when it stopped is not known, so a stall names it beside the node seen stopping first."""
    still = progress.Stillness()
    step = {"started": True, "last_t": 1.0, "phase": "train", "step": 1, "t": 1.0}
    still.update([step, None, None], now=10.0)
    assert still.still_first(slack=4.0) == [0, 1, 2]
