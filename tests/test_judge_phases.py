"""``--judge`` of a two-phase run against committed references, one file per phase: each phase is
judged by its own file (llava1.5_7b's short recipe on one H200, 2026-12-02, the committed runs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.judging import recording

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "cases/llava/deepspeed/reference/llava1.5_7b"
RUN = ROOT / "docs/results/runs/2026-12-02_llava1.5_7b_H200x1_short-config-validation.json"


def test_each_phase_is_judged_by_the_reference_of_its_phase(tmp_path):
    run = tmp_path / "results.json"
    shutil.copy(RUN, run)
    lines = recording.judge_file(run, [REF / "short.pretrain.json", REF / "short.finetune.json"])
    assert len(lines) == 1 and "round 1 ok" in lines[0], lines
    doc = json.loads(run.read_text())
    phases = {p["phase"]: p for p in doc["rounds"][0]["phases"]}
    assert {ph: p["gate"]["verdict"] for ph, p in phases.items()} == {"pretrain": "aligned", "finetune": "aligned"}
    assert phases["pretrain"]["reference"]["path"].endswith("short.pretrain.json")
    assert phases["finetune"]["reference"]["path"].endswith("short.finetune.json")


def test_a_phase_no_file_holds_is_refused_naming_the_files(tmp_path):
    run = tmp_path / "results.json"
    shutil.copy(RUN, run)
    before = run.read_text()
    with pytest.raises(InputError, match=r"no file is a curve of phase 'finetune': .*short\.pretrain\.json \(pretrain\)"):
        recording.judge_file(run, [REF / "short.pretrain.json"])
    assert run.read_text() == before
