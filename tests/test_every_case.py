"""Every case under cases/ runs end to end on the CPU, found by discovery: a case is covered
the day it lands. Each model that has a cpu vendor config runs its smallest one-node config
through start_task.py for a few steps past the warm-up (the full runs and their loss gates are
in each case's own tests); a case family with no cpu config at all is a failure here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from run_benchmarks.planning import registry
from run_benchmarks.planning.registry import ROOT

START = str(ROOT / "run_benchmarks" / "start_task.py")


def _smallest(model: str, framework: str) -> str | None:
    """The cpu config of one node with the fewest processes (no layout variant), as its size."""
    sizes = sorted(
        (
            (int(p.stem.split("x")[2]), p.stem.removeprefix("config_"))
            for p in registry.vendor_config_dir("cpu", model, framework).glob("config_cpux1x*.yaml")
            if "_" not in p.stem.removeprefix("config_")
        ),
        key=lambda t: t[0],
    )
    return sizes[0][1] if sizes else None


def discovered() -> list[tuple[str, str, str]]:
    """(model, framework, size) of every case model with a one-node cpu config."""
    out = []
    for key in sorted(registry.cases()):
        if ":" not in key:
            continue
        model, framework = key.split(":")
        size = _smallest(model, framework)
        if size:
            out.append((model, framework, size))
    return out


CASES = discovered()


def test_every_case_family_has_a_cpu_config():
    families = {(e.config.family, e.config.framework) for e in registry.cases().values()}
    table = registry.cases()
    covered = {(table[f"{m}:{fw}"].config.family, fw) for m, fw, _ in CASES}
    assert families == covered, f"case folders without a cpu vendor config: {sorted(families - covered)}"


@pytest.mark.e2e  # each case trains through start_task.py
@pytest.mark.parametrize("model, framework, size", CASES, ids=[f"{m}:{fw}" for m, fw, _ in CASES])
def test_the_case_runs_end_to_end(model, framework, size, request, tmp_path):
    request.getfixturevalue(f"{framework}_python")  # its environment, built once (skips where it cannot be)
    n = size.split("x")[2]
    proc = subprocess.run(
        [
            sys.executable,
            START,
            "--vendor",
            "cpu",
            "--case_name",
            f"{model}:{framework}:cpu:1:{n}",
            "--log-dir",
            str(tmp_path),
            "--set",
            "train.steps=7",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    (run_dir,) = tmp_path.iterdir()
    res = json.loads((run_dir / "results.json").read_text())
    (rnd,) = res["rounds"]
    # 7 steps against a 30-step reference: ran fine, the loss not judged (steps missing)
    assert proc.returncode == 1 and rnd["status"] == "unjudged", proc.stdout[-3000:] + proc.stderr[-3000:]
    for p in rnd["phases"]:
        assert len(p["steps"]) == 7 and p["meta"]["model"] == model, p["phase"]
        # the cpu vendor's recorded_env (OMP_, MKL_, GLOO_): its own env as each rank saw it
        env = p["meta"]["environment"]
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1" and all(k.startswith(("OMP_", "MKL_", "GLOO_")) for k in env), env
        if framework != "paddle":  # and torch's ranks take its thread count (no paddle call reports one)
            assert p["meta"]["cpu_threads"] == 1, p["meta"]
        assert p["tokens_per_gpu_s"] and p["tokens_per_gpu_s"] > 0 and p["peak_mem_gib"] > 0
    assert [n["returncode"] for n in rnd["nodes"]] == [0]
