"""The loss gate keeps its teeth: runs broken on purpose are judged not aligned.

llama3_tiny on one CPU process, through start_task.py, each run with one of examples/defects.py's
vendor hooks in a config variant of its own, against the model's one committed reference (the
standard recipe's): labels that are the input tokens (an off-by-one in a data path) are not
aligned, and the run's status says invalid (exit 1). A token embedding that gets no gradient
no longer reaches the gate: the conformance check stops that run before training
(tests/test_conformance.py).
The two defects the synthetic corpus cannot show (a RoPE base 10 % off, one repeated micro batch
in eight; docs/metrics.md) are not asserted here.

Under the ``attention`` recipe (300 steps on the synthetic corpus version 2, whose span sets only
attention learns), attention multiplied by 0 and attention limited to the last seq / 16 keys,
both from the ninth SDPA call on (past the conformance check, which passes), are judged not
aligned by the loss gate itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks.planning.registry import ROOT

CONFIGS = ROOT / "vendors" / "cpu" / "cases" / "llama3_tiny" / "megatron"


def _run_with_hook(tmp_path: Path, hook: str, *args: str) -> dict:
    variant = "DEFECT" + hook.replace("_", "")
    config = CONFIGS / f"config_cpux1x1_{variant}.yaml"
    config.write_text(
        "description: llama3_tiny on one CPU process with a defect on purpose (tests/test_recipe_teeth.py)\n"
        f"validated: false\nparallel: {{tp: 1, pp: 1}}\ntrain: {{micro_batch: 1}}\nhook: examples.defects:{hook}\n"
    )
    try:
        cmd = [sys.executable, "run_benchmarks/start_task.py", "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:1"]
        proc = subprocess.run(
            [*cmd, "--variant", variant, "--log-dir", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
    finally:
        config.unlink()
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    res = json.loads((run_dir / "results.json").read_text())
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    return res


@pytest.mark.framework("megatron")
@pytest.mark.parametrize("hook, at_least", [("unshifted_labels", 0.10)])
def test_a_broken_run_is_not_aligned(tmp_path, megatron_python, hook, at_least):
    res = _run_with_hook(tmp_path, hook)
    (rnd,) = res["rounds"]
    (phase,) = rnd["phases"]
    assert rnd["status"] == "invalid" and res["hook"] == f"examples.defects:{hook}", rnd["error"]
    assert phase["reference"]["path"] == "cases/llama3/megatron/reference/llama3_tiny/standard.json"
    assert phase["gate"]["verdict"] == "not aligned" and phase["gate"]["mre"] > at_least, phase["gate"]


@pytest.mark.framework("megatron")
@pytest.mark.parametrize("hook, at_least", [("attention_times_zero_late", 0.08), ("attention_window_late", 0.03)])
def test_attention_defects_past_the_check_are_not_aligned_on_a_corpus_that_needs_attention(tmp_path, megatron_python, hook, at_least):
    res = _run_with_hook(tmp_path, hook, "--recipe", "attention")
    (rnd,) = res["rounds"]
    (phase,) = rnd["phases"]
    assert rnd["conformance"]["verdict"] == "passed", rnd["conformance"]  # the defect comes after the check
    assert rnd["status"] == "invalid" and phase["gate"]["verdict"] == "not aligned", (rnd["error"], phase["gate"])
    assert phase["reference"]["path"].startswith("cases/llama3/megatron/reference/llama3_tiny/attention.data-synthetic-v2-")
    assert phase["gate"]["mre"] > at_least, phase["gate"]
