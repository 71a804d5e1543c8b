"""Committed references change only for cause, and never to absorb a run that failed against them.

- No committed reference has among its repeats a run judged not aligned against a reference of
  its model (recording.absorbed_failures; --record-reference refuses to make one).
- Since references became one per model, phase and recipe (commit 5851a7a), every commit that adds
  or changes a reference file changes nothing else and says why in a body of its own; git keeps
  the earlier versions readable.
- Every reference recorded from 2026-12-01 on has at least 3 repeats whose curves differ in
  rounding (loss_gate.MIN_REPEATS), so that the noise figure has a measured spread.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from run_benchmarks.judging import loss_gate, recording
from run_benchmarks.planning.registry import ROOT

REFERENCES = sorted(ROOT.glob("cases/*/*/reference/*/*.json"))
SINCE = "5851a7a"


@pytest.mark.parametrize("path", REFERENCES, ids=lambda p: str(p.relative_to(ROOT / "cases")))
def test_no_reference_absorbs_a_run_that_failed_against_it(path):
    assert recording.absorbed_failures(path) == []


#: the day the repeats rule began; references made before it keep what they had
REPEATS_RULE_FROM = "2026-12-01"


@pytest.mark.parametrize("path", REFERENCES, ids=lambda p: str(p.relative_to(ROOT / "cases")))
def test_a_reference_made_since_the_rule_has_three_repeats(path):
    doc = json.loads(path.read_text())
    made = str(doc.get("made", ""))
    if not (made[:4].isdigit() and made[:10] >= REPEATS_RULE_FROM):  # older ones wrote "cpu x1, <date>"
        return
    curves = {tuple(r["loss"]) for r in doc.get("repeats") or []}
    assert len(curves) >= loss_gate.MIN_REPEATS and doc.get("spread") is not None, f"{path}: {len(curves)} distinct repeat(s)"


def test_a_reference_that_absorbed_a_failed_run_is_named(tmp_path):
    """baichuan2_13b's third 4 x H200 run was judged not aligned (2.58 %) against the reference of
    the time; a reference with it among its repeats is named, and --record-reference refuses it."""
    failed = "docs/results/runs/2026-11-27_baichuan2_13b_H200x4_hostG-recompute16-expandable-standard.json"
    doc = json.loads((ROOT / "cases/baichuan2/deepspeed/reference/baichuan2_13b/standard.json").read_text())
    doc["repeats"].append({"path": failed, "steps": doc["steps"], "loss": doc["loss"]})
    bad = tmp_path / "standard.json"
    bad.write_text(json.dumps(doc))
    (said,) = recording.absorbed_failures(bad)
    assert f"repeat {failed} round 1 was judged not aligned against" in said and "baichuan2_13b/config_H200x1x4.json" in said


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_references_change_in_commits_of_their_own():
    if subprocess.run(["git", "cat-file", "-e", f"{SINCE}^{{commit}}"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip(f"this clone's history does not reach {SINCE}")
    commits = _git("log", "--format=%H", "--diff-filter=AM", f"{SINCE}^..HEAD", "--", "cases/*/*/reference/*").split()
    assert commits, "the commits that made the references are not found"
    for c in commits:
        files = _git("show", "--format=", "--name-only", c).split()
        others = [f for f in files if "/reference/" not in f]
        assert not others, f"{c[:9]} changes a reference and also {others[:5]}"
        body = _git("show", "-s", "--format=%b", c).strip()
        assert body, f"{c[:9]} changes a reference without saying why in its body"
