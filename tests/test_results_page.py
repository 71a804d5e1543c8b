"""docs/results/README.md, the headlines, is generated from the committed results files and is current."""

from __future__ import annotations

import json

from run_benchmarks.judging import results_page
from run_benchmarks.planning.registry import ROOT

RUNS = ROOT / "docs/results/runs"
PINNED = [f"2026-12-02_llama3_8b_H200x1_short-offload-pinned-copy-r{i}.json" for i in (1, 2, 3)]
OVERLAP = [f"2026-12-01_llama3_8b_H200x1_short-overlap-offload-0.4-r{i}.json" for i in (1, 2, 3)]
TOKENS, RUNS_COL, CEILING, FILES = (results_page.HEADLINE.index(c) for c in ("tokens/p/s (median)", "runs", "of own ceiling", "files"))


def copied(tmp_path, names, edit=None):
    """The named committed files in a folder of their own, ``edit(name, data)`` changing each first."""
    runs = tmp_path / "runs"
    runs.mkdir(parents=True)
    for name in names:
        data = json.loads((RUNS / name).read_text())
        if edit:
            edit(name, data)
        (runs / name).write_text(json.dumps(data))
    return runs


def test_the_committed_page_is_the_one_the_files_make():
    assert results_page.PAGE.read_text() == results_page.page(), "docs/results/README.md is not current: run flagbench results-page"


def test_three_runs_of_one_measurement_make_one_headline_their_median(tmp_path):
    rows = results_page.headline_rows(results_page.load_runs(copied(tmp_path, PINNED + OVERLAP)))
    assert [(r[TOKENS], r[RUNS_COL]) for r in rows] == [("7,130", "3 of 3"), ("6,993", "3 of 3")]
    for row, names in zip(rows, (OVERLAP, PINNED)):
        assert all(name in row[FILES] for name in names)
    # in the committed files the 2026-12-02 row is those three and the run of the same settings
    # through the shared megatron loop (code 5355b1e); the 2026-12-01 three share theirs with the
    # run of the same settings that spawned its conformance check (code 179584a)
    committed = results_page.headline_rows(results_page.load_runs())
    (pinned,) = [r for r in committed if PINNED[0] in r[FILES]]
    assert pinned[TOKENS] == "6,993" and pinned[RUNS_COL] == "4 of 4"
    assert "2026-12-03_llama3_8b_H200x1_short-shared-loop.json" in pinned[FILES]
    (overlap,) = [r for r in committed if OVERLAP[0] in r[FILES]]
    assert all(name in overlap[FILES] for name in OVERLAP) and "short-spawned-check" in overlap[FILES]


def test_a_run_not_judged_is_never_in_a_headline(tmp_path):
    def unjudge(name, data):
        if name == PINNED[0]:
            data["status"] = data["rounds"][0]["status"] = "unjudged"
            data["rounds"][0]["phases"][0]["gate"] = {"verdict": "not judged", "reason": "no reference"}

    runs = results_page.load_runs(copied(tmp_path, PINNED, unjudge))
    assert results_page.headline_rows(runs) == []
    singles = results_page.single_rows(runs)
    assert len(singles) == 2 and all(row[-2] == "no: 2 of 3 runs judged aligned" for row in singles)
    assert not any(PINNED[0] in row[-1] for row in singles)
    # on the committed files: every run a headline links was judged aligned in a round that was ok
    committed = results_page.load_runs()
    for row in results_page.headline_rows(committed):
        for run in committed:
            if f"(runs/{run.path.name})" in row[FILES]:
                assert run.rnd.status == "ok" and run.phase.gate.verdict == "aligned", run.path.name


def test_a_ceiling_below_the_throughput_is_no_percentage(tmp_path):
    def low_ceiling(name, data):
        if name == PINNED[1]:
            data["rounds"][0]["phases"][0].update(ceiling_tokens_per_gpu_s=5000.0, ceiling_efficiency=1.3985)

    (row,) = results_page.headline_rows(results_page.load_runs(copied(tmp_path, PINNED, low_ceiling)))
    assert row[CEILING] == "ceiling failed (5,000 < 6,993)"
    (row,) = results_page.headline_rows(results_page.load_runs(copied(tmp_path / "as-run", PINNED)))
    assert row[CEILING] == "54.5%"
    # the committed llava_tiny run timed its finetune's ceiling below the phase's throughput
    rows = [r for r in results_page.single_rows(results_page.load_runs()) if "2026-11-29_llava_tiny_cpux1x2.json" in r[-1]]
    assert [r[results_page.SINGLE.index("of own ceiling")] for r in rows] == ["79.4%", "ceiling failed (364 < 444)"]


def test_a_stale_page_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results_page, "RUNS", copied(tmp_path, PINNED))
    monkeypatch.setattr(results_page, "PAGE", tmp_path / "README.md")
    assert results_page.main(["--check"]) == 1 and "is not current: run flagbench results-page" in capsys.readouterr().err
    assert results_page.main([]) == 0 and results_page.main(["--check"]) == 0
    assert "| 6,993 | 6,983-6,993 | 3 of 3 |" in (tmp_path / "README.md").read_text()
