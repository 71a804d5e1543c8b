"""Rounds of the DeepSpeed cases through start_task.py, read back for their tests.

Used by tests/test_baichuan2_run.py and tests/test_llava_case.py: a committed
configuration's run (30 steps, its loss judged against the reference curve) and
short runs of other layouts compared with its first steps.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from run_benchmarks.planning.registry import ROOT
from training.metriclog import ParsedLog, parse_lines

START = str(ROOT / "run_benchmarks" / "start_task.py")
#: layouts of one case must give the same loss at every step within this (relative)
SAME_CURVE = 0.005


@dataclasses.dataclass
class Run:
    proc: subprocess.CompletedProcess
    dir: Path  # <log-dir>/<run_id>
    round: dict[str, Any]  # results.json's only round
    log: ParsedLog  # every rank's records

    @property
    def output(self) -> Path:
        return self.dir / "round1" / "output"

    def loss(self, phase: str, steps: int) -> list[float]:
        (ph,) = [p for p in self.round["phases"] if p["phase"] == phase]
        return [ph["loss"][str(s)] for s in range(1, steps + 1)]


def start_task(log_dir: Path, case_name: str, *sets: str) -> Run:
    cmd = [sys.executable, START, "--vendor", "cpu", "--case_name", case_name, "--log-dir", str(log_dir)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    runs = [p for p in log_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    (rnd,) = json.loads((runs[0] / "results.json").read_text())["rounds"]
    lines: list[str] = []
    for rank_log in sorted((runs[0] / "round1").glob("node*/ranks/*.log")):
        lines += rank_log.read_text().splitlines()
    return Run(proc, runs[0], rnd, parse_lines(lines, source=str(runs[0])))


def assert_short_run_unjudged(run: Run) -> None:
    """A run shorter than any reference curve ran fine, but its loss is not judged (exit 1)."""
    assert (run.proc.returncode, run.round["status"]) == (1, "unjudged"), run.proc.stdout[-4000:] + run.proc.stderr[-2000:]
    assert "loss not judged" in run.round["error"], run.round["error"]


def assert_same_curve(base: list[float], other: list[float], what: str) -> None:
    worst = max(abs(x - b) / b for x, b in zip(other, base, strict=True))
    assert worst < SAME_CURVE, (what, worst, other, base)


def assert_data_inside_step(run: Run, phases: set[str], steps: int) -> None:
    """Every step record: the batch fetch is timed, inside the step (training/steptimer.py)."""
    records = run.log.of("step", "train_step")
    assert {r.value.get("phase", "train") for r in records} == phases
    assert len(records) == steps * len(phases)
    for r in records:
        assert 0 < r.value["data_s"] <= r.value["step_time_s"], r.value
