"""docs/results/runs.md is generated from the committed results files and is current."""

from __future__ import annotations

import shutil

from run_benchmarks.judging import runs_table
from run_benchmarks.planning.registry import ROOT


def test_the_committed_page_is_the_one_the_files_make():
    assert runs_table.PAGE.read_text() == runs_table.page(), "docs/results/runs.md is not current: run flagbench runs-table"


def test_a_row_per_round_and_phase_from_the_file_and_a_stale_page_is_named(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(ROOT / "docs/results/runs/2026-11-29_llama3_8b_H200x1_short-micro2.json", runs)
    (row,) = runs_table.rows(runs)
    assert row[:9] == [
        "2026-11-29",
        "llama3_8b",
        "nvidia",
        "H200 x 1",
        "config_H200x1x1",
        "PP1DP1TP1",
        "short",
        "train.micro_batch=2",
        "train",
    ]
    assert row[9:] == ["6,685", "32.4%", "39.1%", "120.3 / 138.3", "aligned (0.00%)", "round 1 ok", row[-1]]
    monkeypatch.setattr(runs_table, "RUNS", runs)
    monkeypatch.setattr(runs_table, "PAGE", tmp_path / "runs.md")
    assert runs_table.main(["--check"]) == 1 and "is not current" in capsys.readouterr().err
    assert runs_table.main([]) == 0 and runs_table.main(["--check"]) == 0
