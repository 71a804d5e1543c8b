"""start_task.py --verify: every committed results.json checks out; edited figures are named.

A fresh run's file, and the same file with an edited figure, are checked through a real
tiny run in test_e2e_local.py; here files are built from step records with the harness's
own figure code, then edited.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from run_benchmarks import typed_results as tr
from run_benchmarks.judging import loss_gate, metrics, verify
from run_benchmarks.judging.loss_gate import round_status
from run_benchmarks.planning.registry import ROOT
from tests.test_results_models import RUNS, fake_phase, fake_run

START = str(ROOT / "run_benchmarks" / "start_task.py")


def test_every_committed_results_file_verifies():
    proc = subprocess.run([sys.executable, START, "--verify", *map(str, RUNS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    schemas = {path: json.loads(path.read_text())["schema"] for path in RUNS}
    assert set(schemas.values()) == {1, 2}, schemas  # both kinds are committed: both are checked
    for path in RUNS:
        mine = [ln for ln in lines if ln.startswith(f"{path}: ")]
        if schemas[path] == 1:  # said once what cannot be recomputed, then checked what can
            assert mine[0].startswith(
                f"{path}: schema 1 keeps no per-step records: the window, tokens/p/s, step time and loss curve cannot be recomputed"
            )
            assert mine[-1] == f"{path}: every figure that can be recomputed matches"
        else:  # every figure recomputed from the step records
            assert mine == [f"{path}: every figure of {len(json.loads(path.read_text())['rounds'])} round(s) matches its records"]


def consistent(off: float = 0.0, **step_changes: float) -> tr.RunResults:
    """A one-round file whose figures are what its step records give, judged against a curve ``off`` from them."""
    run = fake_run()
    p = run.rounds[0].phases[0]
    steps = [s.model_copy(update={"loss": step_changes.get(f"s{s.step}", s.loss)}) for s in p.steps]
    fig = metrics.figures(steps, 5, run.world_size, run.model_counts["train"], run.hardware_info["peak_flops"])
    ref = tr.Reference(path="/refs/curve.json", loss={s: v / (1 - off) for s, v in p.loss.items()})
    gate = loss_gate.judge_loss(fig["loss"], ref, 5)
    phase = p.model_copy(update={**fig, "steps": steps, "gate": gate, "reference": ref})
    status = round_status([], {"train": gate})[0]
    rnd = run.rounds[0].model_copy(
        update={
            "phases": [phase],
            "status": status,
            "tokens_per_gpu_s": phase.tokens_per_gpu_s,
            "mfu_6n": phase.mfu_6n,
            "mfu_palm": phase.mfu_palm,
            "window": phase.window,
            "loss_mre": gate.mre,
            "loss_aligned": gate.aligned,
        }
    )
    return run.model_copy(update={"rounds": [rnd]})


def write(tmp_path, run: tr.RunResults | dict, name: str = "results.json"):
    path = tmp_path / name
    path.write_text(json.dumps(run.dump() if isinstance(run, tr.RunResults) else run))
    return path


def findings(path) -> tuple[int, list[str]]:
    lines = list(verify.run([path]))
    return max(code for code, _ in lines), [line for _, line in lines]


def test_a_consistent_file_matches(tmp_path):
    path = write(tmp_path, consistent(off=0.01))
    assert findings(path) == (0, [f"{path}: every figure of 1 round(s) matches its records"])
    # a file made before the spread was recorded: nothing to compare, the rest is checked
    older = json.loads(json.dumps(consistent(off=0.01).dump()))
    assert older["rounds"][0]["phases"][0].pop("throughput_spread") is not None
    path = write(tmp_path, older, "older.json")
    assert findings(path) == (0, [f"{path}: every figure of 1 round(s) matches its records"])


EDITS = [
    (
        "throughput",
        lambda d: d["rounds"][0]["phases"][0].update(tokens_per_gpu_s=1.0),
        "round 1 phase train: tokens_per_gpu_s recorded 1.0, recomputed",
    ),
    ("window", lambda d: d["rounds"][0]["phases"][0]["window"].update(first_step=5), "round 1 phase train: window recorded"),
    (
        "a step's time",
        lambda d: d["rounds"][0]["phases"][0]["steps"][10].update(step_time_s=9.0),
        "round 1 phase train: tokens_per_gpu_s recorded",
    ),
    (
        "MRE",
        lambda d: d["rounds"][0]["phases"][0]["gate"].update(mre=0.001),
        "round 1 phase train: loss gate mre recorded 0.001, recomputed",
    ),
    (
        "spread",
        lambda d: d["rounds"][0]["phases"][0]["throughput_spread"].update(p90=1.0),
        "round 1 phase train: throughput_spread recorded",
    ),
    ("round figure", lambda d: d["rounds"][0].update(tokens_per_gpu_s=2.0), "round 1: tokens_per_gpu_s recorded 2.0, recomputed"),
    ("status", lambda d: d["rounds"][0].update(status="unjudged"), "round 1: status recorded 'unjudged', recomputed 'ok'"),
    ("reference", lambda d: d["rounds"][0]["phases"][0]["reference"]["loss"].update({"25": 99.0}), "round 1 phase train: loss gate mre"),
]


@pytest.mark.parametrize("what, edit, fragment", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_figure_is_named(tmp_path, what, edit, fragment):
    data = consistent(off=0.01).dump()
    data = json.loads(json.dumps(data))  # as read from the file
    edit(data)
    path = write(tmp_path, data)
    code, lines = findings(path)
    assert code == 1 and any(line.startswith(f"{path}: {fragment}") for line in lines), lines


def test_a_loss_the_verdict_missed(tmp_path):
    """A NaN in the records under a round recorded ok: the gate's recomputed verdict and the status disagree."""
    data = json.loads(json.dumps(consistent().dump()))
    data["rounds"][0]["phases"][0]["steps"][26]["loss"] = math.nan
    code, lines = findings(write(tmp_path, data))
    assert code == 1
    assert any("loss gate nonfinite_step recorded None, recomputed 27" in ln for ln in lines)
    assert any("round 1: status recorded 'ok', recomputed 'failed'" in ln for ln in lines)


def test_schema1_mfu_edit_and_unreadable_files(tmp_path):
    data = json.loads(RUNS[0].read_text())
    data["rounds"][0]["phases"][0]["mfu_6n"] = 0.5
    path = write(tmp_path, data, "schema1.json")
    code, lines = findings(path)
    assert code == 1 and any(ln.startswith(f"{path}: round 1 phase train: mfu_6n recorded 0.5, recomputed 0.31") for ln in lines), lines
    (tmp_path / "junk.json").write_text("{")
    proc = subprocess.run(
        [sys.executable, START, "--verify", str(path), str(tmp_path / "junk.json")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and f"error: {tmp_path / 'junk.json'}: not JSON" in proc.stderr
    assert f"{path}: round 1 phase train: mfu_6n recorded 0.5" in proc.stdout  # the other file is still checked


def test_same():
    assert verify.same(1.0, 1.0 + 1e-12) and not verify.same(1.0, 1.0001)
    assert verify.same(math.nan, math.nan) and not verify.same(None, 0.0) and not verify.same(math.nan, 1.0)
    assert verify.same({1: [1.0, None]}, {1: [1.0, None]}) and not verify.same({1: 1.0}, {2: 1.0})
    assert verify.same(fake_phase().window, fake_phase().window)


def test_a_code_version_that_is_no_commit_here_is_said(tmp_path):
    """A results.json whose code_version names no commit of this repository (a mistyped one, or a
    fork's) gets a note; a real commit, with or without +changes, none. Needs a full git clone."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if head.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: its history cannot tell")
    bogus = "df9877807671779675f5ec27713a0df6c092c9f3"  # a HEAD's head and another commit's tail
    path = write(tmp_path, consistent().model_copy(update={"code_version": bogus}))
    assert findings(path) == (
        0,
        [
            f"{path}: code_version {bogus} is not a commit of this repository ({ROOT}): the code that made it cannot be checked out from here",
            f"{path}: every figure of 1 round(s) matches its records",
        ],
    )
    for version in (head.stdout.strip(), head.stdout.strip() + "+changes"):
        path = write(tmp_path, consistent().model_copy(update={"code_version": version}), "real.json")
        assert findings(path) == (0, [f"{path}: every figure of 1 round(s) matches its records"])


def test_a_code_version_no_branch_reaches_is_said(tmp_path):
    """A commit left behind by a rewrite (here, but on no branch or tag) does not travel with a
    clone: the note says so, where a plain existence check would pass it on this checkout only."""
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: its history cannot tell")
    made = subprocess.run(  # an object only: no ref, no working-tree change
        ["git", "-C", str(ROOT), "commit-tree", "HEAD^{tree}", "-m", f"unreachable {tmp_path.name}"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = made.stdout.strip()
    path = write(tmp_path, consistent().model_copy(update={"code_version": orphan}))
    assert findings(path) == (
        0,
        [
            f"{path}: code_version {orphan} is on no branch or tag of this repository ({ROOT}): a clone cannot check it out",
            f"{path}: every figure of 1 round(s) matches its records",
        ],
    )
