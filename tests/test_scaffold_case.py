"""``python -m run_benchmarks.tools.case_tools scaffold-case``: a case written from the templates runs
end to end on the CPU, for each framework with a template (DeepSpeed, megatron-core, paddle).
In a copy of the repository: scaffold the case, run it through start_task.py (unjudged: no
reference yet) at three micro batches, record its first reference curve from them with
``--record-reference``, then, unedited, the vendor check and the tests the project runs on every
case: the test the scaffold wrote (the case again, its loss aligned with that curve),
tests/test_every_case.py and tests/test_validated_configs.py.
The files written pass the repository's lint (ruff check, ruff format). Bad names are refused
with exit 2 and nothing is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks.planning.registry import ROOT

COPIED = ("run_benchmarks", "training", "cases", "vendors", "tests", "docs", "setup.cfg", "pyproject.toml")


def _repo_copy(dst: Path) -> Path:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "logs"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def _run(repo: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_names_are_refused_with_exit_2(tmp_path):
    repo = tmp_path / "repo"
    (repo / "cases").mkdir(parents=True)
    for name in ("run_benchmarks", "training"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for args, said in (
        (["Gpt2", "deepspeed", "--model", "gpt2_tiny"], "family 'Gpt2': a case folder is a Python package name"),
        (["gpt2", "jax", "--model", "gpt2_tiny"], "framework 'jax': scaffold-case has a template for deepspeed, megatron, paddle"),
        (["gpt2", "deepspeed", "--model", "gpt2-tiny"], "model 'gpt2-tiny'"),
    ):
        proc = _run(repo, "-m", "run_benchmarks.tools.case_tools", "scaffold-case", *args, timeout=60)
        assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in (repo / "cases").iterdir()) == []
    proc = _run(repo, "-m", "run_benchmarks.tools.case_tools", "scaffold-case", "gpt2", "deepspeed", "--model", "x", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "wrote vendors/cpu/cases/x/deepspeed/config_cpux1x2.yaml" in proc.stdout, proc.stdout
    proc = _run(repo, "-m", "run_benchmarks.tools.case_tools", "scaffold-case", "gpt2", "deepspeed", "--model", "y", timeout=60)
    assert proc.returncode == 2 and "cases/gpt2/deepspeed exists" in proc.stderr, proc.stderr


def test_every_template_writes_lint_clean_files(tmp_path):
    repo = tmp_path / "repo"
    (repo / "cases").mkdir(parents=True)
    for name in ("run_benchmarks", "training"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    for framework in FRAMEWORKS:
        proc = _run(
            repo,
            "-m",
            "run_benchmarks.tools.case_tools",
            "scaffold-case",
            "mixtral",
            framework,
            "--model",
            f"mixtral_{framework}",
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
    written = [str(p.relative_to(repo)) for p in sorted([*repo.glob("cases/mixtral/*/*.py"), *repo.glob("tests/test_mixtral_*.py")])]
    assert len(written) == 3 * 2 + 3 + 2 + 3, written  # __init__.py, settings.py, train.py, model.py (not megatron's), tests
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]'"
    for command in (["check", "--no-fix"], ["format", "--check"]):
        proc = subprocess.run([ruff, *command, *written], cwd=repo, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


FRAMEWORKS = ("deepspeed", "megatron", "paddle")


@pytest.mark.parametrize("framework", [pytest.param(fw, marks=pytest.mark.framework(fw)) for fw in FRAMEWORKS])
def test_a_scaffolded_case_runs_records_its_reference_and_aligns(tmp_path, framework, request):
    request.getfixturevalue(f"{framework}_python")  # the framework's environment, built once
    repo = _repo_copy(tmp_path / "repo")
    model = f"gpt2_{framework}_tiny"
    proc = _run(repo, "-m", "run_benchmarks.tools.case_tools", "scaffold-case", "gpt2", framework, "--model", model, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote cases/gpt2/{framework}/train.py" in proc.stdout and "--record-reference" in proc.stdout, proc.stdout
    reference = repo / "cases" / "gpt2" / framework / "reference" / model / "standard.json"

    logs = tmp_path / "logs"
    first = _run(
        repo, "run_benchmarks/start_task.py", "--vendor", "cpu", "--case_name", f"{model}:{framework}:cpu:1:2", "--log-dir", str(logs)
    )
    (run,) = list(logs.iterdir())
    (rnd,) = json.loads((run / "results.json").read_text())["rounds"]
    assert (first.returncode, rnd["status"]) == (1, "unjudged"), first.stdout[-4000:] + first.stderr[-2000:]
    assert "no reference curve" in rnd["error"], rnd["error"]
    loss = rnd["phases"][0]["loss"]
    assert len(loss) == 30 and loss["30"] < 0.8 * loss["1"], loss  # it learns

    runs = [run / "results.json"]
    for mb in (2, 8):  # the next steps' other micro batches (the config's is 4): curves that differ in rounding
        more = tmp_path / f"logs-mb{mb}"
        case = ("--vendor", "cpu", "--case_name", f"{model}:{framework}:cpu:1:2", "--set", f"train.micro_batch={mb}")
        _run(repo, "run_benchmarks/start_task.py", *case, "--log-dir", str(more))
        runs += [d / "results.json" for d in more.iterdir()]
    rec = _run(repo, "run_benchmarks/start_task.py", "--record-reference", *map(str, runs), timeout=120)
    assert rec.returncode == 0 and reference.is_file(), rec.stdout + rec.stderr
    doc = json.loads(reference.read_text())
    assert len(doc["repeats"]) == 3 and doc["loss"] == pytest.approx([loss[str(s)] for s in range(1, 31)], rel=1e-3), doc.get("spread")

    # unedited, the scaffold passes the project's own checks: the vendor check, the case's own test
    # (the case again, its loss judged against the curve just recorded), every-case discovery and
    # the validated-config rules
    check = _run(repo, "-m", "run_benchmarks.tools.vendor_tools", "check", "cpu", timeout=120)
    assert check.returncode == 0 and check.stdout.strip() == "cpu: ok", check.stdout + check.stderr
    tests = (f"tests/test_gpt2_{framework}_case.py", "tests/test_every_case.py", "tests/test_validated_configs.py")
    gen = _run(
        repo, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *tests, "-k", f"{model} or validated or loss_aligns", timeout=900
    )
    assert gen.returncode == 0, gen.stdout[-4000:] + gen.stderr[-2000:]
    for ran in (f"{tests[0]}::test_the_case_runs_and_its_loss_aligns", f"{tests[1]}::test_the_case_runs_end_to_end[{model}:{framework}]"):
        assert f"PASSED {ran}" in gen.stdout, gen.stdout[-4000:]
