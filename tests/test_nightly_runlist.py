"""Bad run lists and flags: exit 2, one line naming the file and the field, nothing run or written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.nightly import driver as nightly
from run_benchmarks.nightly import history
from run_benchmarks.planning import references
from run_benchmarks.planning.registry import ROOT

GOOD_CASE = "  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, rounds: 2, set: [train.steps=10]}\n"
HEAD = "log_dir: logs\nhistory_db: h.sqlite\n"

BAD = [
    ("YAML syntax error", "cases: [a, b\n", "YAML syntax error"),
    ("top level is a list", "- 1\n", "expected a mapping with a 'cases' list at the top level, got list"),
    ("no cases", HEAD, "field 'cases': Field required"),
    ("empty cases", HEAD + "cases: []\n", "field 'cases': at least one case is needed, got []"),
    (
        "unknown top-level field",
        "log_dri: x\ncases:\n" + GOOD_CASE,
        "field 'log_dri': unknown field; expected one of: cases, cluster, log_dir",
    ),
    (
        "unknown case field",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, round: 3}\n",
        "field 'cases.0.round': unknown field; expected one of: case, vendor, rounds, variant, recipe, set, reference, tolerances",
    ),
    (
        "rounds not a number",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, rounds: three}\n",
        "field 'cases.0.rounds': Input should be a valid integer, unable to parse string as an integer, got 'three'",
    ),
    (
        "zero rounds",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, rounds: 0}\n",
        "field 'cases.0.rounds': Input should be greater than or equal to 1, got 0",
    ),
    ("missing vendor", HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2'}\n", "field 'cases.0.vendor': Field required"),
    (
        "malformed case name",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu', vendor: cpu}\n",
        "field 'cases.0.case': case name 'llama3_tiny:megatron:cpu' must have the form",
    ),
    (
        "repeat field in the case name",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2:3', vendor: cpu}\n",
        "field 'cases.0.case': give the round count as 'rounds:'",
    ),
    (
        "vendor with a path",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: ../cpu}\n",
        "field 'cases.0.vendor': name '../cpu' is not a valid name",
    ),
    (
        "override without a value",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, set: [train.steps]}\n",
        "field 'cases.0.set': set 'train.steps': expected KEY=VALUE",
    ),
    (
        "override outside the allowed sections",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, set: [model.hidden_size=8]}\n",
        "only train.*, parallel.* and data.* may be set",
    ),
    (
        "negative tolerance",
        HEAD + "tolerances: {throughput_drop_pct: -5}\ncases:\n" + GOOD_CASE,
        "field 'tolerances.throughput_drop_pct': Input should be greater than 0, got -5",
    ),
    (
        "tolerance as a fraction word",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, tolerances: {memory_rise_pct: lots}}\n",
        "field 'cases.0.tolerances.memory_rise_pct': Input should be a valid number",
    ),
    (
        "baseline window zero",
        HEAD + "baseline_runs: 0\ncases:\n" + GOOD_CASE,
        "field 'baseline_runs': Input should be greater than or equal to 1",
    ),
    ("duplicate case", HEAD + "cases:\n" + GOOD_CASE + GOOD_CASE, "field 'cases': cases.1 repeats cases.0"),
    (
        "unknown vendor",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: acme}\n",
        "field 'cases.0' (llama3_tiny:megatron:cpu:1:2 on acme): unknown vendor 'acme'",
    ),
    (
        "no config for the size",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:3', vendor: cpu}\n",
        "field 'cases.0' (llama3_tiny:megatron:cpu:1:3 on cpu): vendor 'cpu' has no config_cpux1x3",
    ),
    ("unknown variant", HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, variant: PP9}\n", "no config_cpux1x2_PP9"),
    (
        "batch not divisible",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, set: [train.global_batch=3]}\n",
        "global batch 3 is not a multiple",
    ),
    (
        "data without a corpus",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, set: [data.data_dir=/]}\n",
        "field 'cases.0' (llama3_tiny:megatron:cpu:1:2 on cpu): data.data_dir / holds 0 Megatron corpora",
    ),
    (
        "reference not a file",
        HEAD + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, reference: curves/nope.json}\n",
        "field 'cases.0' (llama3_tiny:megatron:cpu:1:2 on cpu): reference ",  # the path follows: below the run list's folder
    ),
    (
        "reference of another global batch",
        HEAD
        + "cases:\n  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, set: [train.global_batch=16], "
        + f"reference: {ROOT}/cases/llama3/megatron/reference/llama3_tiny/standard.json}}\n",
        "global batch 8 there, 16 here; loss curves compare step by step only at the same global batch",
    ),
    ("missing cluster file", HEAD + "cluster: nope.yaml\ncases:\n" + GOOD_CASE, "nope.yaml: file not found"),
    (
        "bad cluster file",
        HEAD + "cluster: cluster.yaml\ncases:\n" + GOOD_CASE,
        "cluster.yaml: field 'master_port': Input should be a valid integer",
    ),
]


@pytest.mark.parametrize("what, text, fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_run_list(what, text, fragment, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "cluster.yaml").write_text("master_port: abc\n")
    path = cfg / "nightly.yaml"
    path.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc = nightly.main(["--nightly", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    assert fragment in err, err
    if what == "reference not a file":
        assert err.endswith(f"reference {path.parent / 'curves' / 'nope.json'}: no such file"), err
    if what not in ("missing cluster file", "bad cluster file"):
        assert str(path) in err, err  # the run list is named ...
    assert sorted(p.name for p in cfg.iterdir()) == ["cluster.yaml", "nightly.yaml"]  # ... and nothing is written
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "give the run list once"),
        (["a.yaml", "--nightly", "b.yaml"], "give the run list once"),
        (["--nightly", "/nonexistent/nightly.yaml"], "/nonexistent/nightly.yaml: file not found"),
        (["--nightly", "x.yaml", "--vendor", "cpu"], "--vendor: not a nightly option"),
    ],
)
def test_bad_flags(argv, fragment, capsys):
    assert nightly.main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_newer_history_schema_is_refused(tmp_path, capsys):
    import sqlite3

    db = tmp_path / "h.sqlite"
    history.connect(db).close()
    con = sqlite3.connect(db)
    con.execute("PRAGMA user_version = 99")
    con.commit()
    con.close()
    path = tmp_path / "nightly.yaml"
    path.write_text(HEAD + "cases:\n" + GOOD_CASE)
    assert nightly.main([str(path), "--db", str(db)]) == 2
    assert "history schema 99 is newer" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_check_plans_the_example_run_list(capsys):
    assert nightly.main(["--check", str(ROOT / "examples" / "nightly.yaml")]) == 0
    out = capsys.readouterr().out
    assert "llama3_tiny:megatron:cpu:1:2 on cpu set train.profile_step=0: 5 round(s), config config_cpux1x2" in out
    planned = [line for line in out.splitlines() if " round(s), config " in line]
    assert len(planned) == 2 and all(", reference " in line for line in planned), out  # every run of the example is judged
    assert "variant TP2" in out and "config_cpux1x2_TP2" in out
    assert f"logs    {ROOT / 'logs' / 'nightly'}" in out  # relative to the run list's folder


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "gpu").glob("*.yaml")), ids=lambda p: p.name)
def test_the_gpu_run_lists_plan_here(path, capsys):
    """The GPU machine's run lists (docs/gpu-runs.md) are planned in full on this CPU machine:
    configs, overrides, layouts, memory of the states and the references they name."""
    assert nightly.main(["--check", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    jobs = nightly.prepare(path).jobs
    planned = [line for line in out.splitlines() if " round(s), config " in line]
    assert len(planned) == len(jobs) and all(", reference " in line for line in planned)  # every run is judged
    if path.name.startswith("llama3_8b_"):  # the short recipe's one reference judges every layout
        assert all(j.plan.recipe == "short" for j in jobs)
        assert out.count("reference (train): cases/llama3/megatron/reference/llama3_8b/short.json, the mean of 3 runs") == len(jobs)


def test_relative_paths_follow_the_run_list(tmp_path):
    (tmp_path / "ci").mkdir()
    path = tmp_path / "ci" / "nightly.yaml"
    path.write_text("log_dir: ../out\nhistory_db: db/h.sqlite\nreport_dir: /srv/pages\ncases:\n" + GOOD_CASE)
    night = nightly.prepare(path)
    assert night.log_dir == tmp_path / "out" and night.db_path == tmp_path / "ci" / "db" / "h.sqlite"
    assert night.report_dir == Path("/srv/pages")
    assert night.jobs[0].plan.run_dir.parent == tmp_path / "out" and night.jobs[0].plan.case.repeat == 2
    assert night.jobs[0].plan.user_overrides == [{"param": "train.steps", "value": 10, "standard": 30}]
    flags = nightly.prepare(path, db=str(tmp_path / "x.sqlite"), log_dir=str(tmp_path / "l"), report_dir=str(tmp_path / "r"))
    assert (flags.db_path, flags.log_dir, flags.report_dir) == (tmp_path / "x.sqlite", tmp_path / "l", tmp_path / "r")


def test_the_run_lists_timeouts_reach_the_ranks(tmp_path):
    """round_timeout_s and stall_timeout_s of a run list set the cluster's; the stall timeout
    and the node's stack folder are in every node's environment (training/case.py reads them)."""
    from run_benchmarks.planning.plan import plan_nodes

    path = tmp_path / "nightly.yaml"
    path.write_text("round_timeout_s: 7200\nstall_timeout_s: 120\ncases:\n" + GOOD_CASE)
    night = nightly.prepare(path)
    assert (night.cluster.round_timeout_s, night.cluster.stall_timeout_s) == (7200, 120)
    plan = night.jobs[0].plan
    (node,) = plan_nodes(plan, "python3", ROOT, plan.run_dir / "round1")
    assert node.env["FB_STALL_TIMEOUT_S"] == "120" and node.env["FB_STACKS_DIR"] == str(plan.run_dir / "round1" / "node0" / "stacks")
    path.write_text("stall_timeout_s: 0\ncases:\n" + GOOD_CASE)
    with pytest.raises(InputError, match="stall_timeout_s"):
        nightly.prepare(path)


def test_a_case_judged_against_its_own_reference(tmp_path, capsys):
    """A run shortened to another global batch has no committed curve (its rounds would be
    unjudged): the run list names one, one file or several, relative to its own folder."""
    (tmp_path / "ci" / "curves").mkdir(parents=True)
    committed = ROOT / "cases" / "llama3" / "megatron" / "reference" / "llama3_tiny"
    doc = json.loads((committed / "standard.json").read_text())
    for name, scale in (("config_cpux1x1.json", 1.0), ("config_cpux1x2.json", 1.001)):  # the committed curve, and one a little off it
        (tmp_path / "ci" / "curves" / name).write_text(json.dumps({**doc, "loss": [v * scale for v in doc["loss"]]}))
    path = tmp_path / "ci" / "nightly.yaml"
    path.write_text(
        HEAD
        + "cases:\n"
        + "  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, reference: curves/config_cpux1x1.json}\n"
        + "  - {case: 'llama3_tiny:megatron:cpu:1:1', vendor: cpu, reference: null}\n"
        + "  - {case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, variant: TP2,\n"
        + "     reference: [curves/config_cpux1x1.json, curves/config_cpux1x2.json]}\n"
    )
    one, committed_one, two = nightly.prepare(path).jobs
    assert committed_one.plan.reference == []
    curves = tmp_path / "ci" / "curves"
    assert one.plan.reference == [curves / "config_cpux1x1.json"]
    # each case records the one command that plans it again (results.json's command)
    assert one.plan.command == [
        "run_benchmarks/start_task.py",
        "--vendor",
        "cpu",
        "--case_name",
        "llama3_tiny:megatron:cpu:1:2:3",
        "--reference",
        str(curves / "config_cpux1x1.json"),
    ]
    assert two.plan.reference == [curves / "config_cpux1x1.json", curves / "config_cpux1x2.json"]
    ref = references.load_references(one.plan)["train"]
    assert ref.path == str(curves / "config_cpux1x1.json")  # not the committed standard.json
    mean = references.load_references(two.plan)["train"]
    assert len(mean.repeats) == 2 and all(mean.loss[s] == pytest.approx(ref.loss[s] / 2 + mean.repeats[1].loss[s] / 2) for s in ref.loss)
    assert nightly.main(["--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"config config_cpux1x2, recipe standard, reference {curves / 'config_cpux1x1.json'}, tolerances" in out


def test_exit_status_2_from_start_task_and_module(tmp_path):
    """Both entry points: python -m run_benchmarks.nightly.driver, and start_task.py --nightly (flagbench nightly's alias)."""
    path = tmp_path / "nightly.yaml"
    path.write_text("cases: []\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "run_benchmarks.nightly.driver", str(path)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {path}: field 'cases': at least one case is needed, got []"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run_benchmarks" / "start_task.py"), "--nightly", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2 and "field 'cases'" in proc.stderr
