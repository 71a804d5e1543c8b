"""``flagbench <command>``: one name for every tool, each command's options under its --help, and
the older forms (start_task.py's flags, ``flagbench`` followed directly by options) unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks import cli
from run_benchmarks.planning.registry import ROOT


def flagbench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "run_benchmarks.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_help_lists_every_command():
    proc = flagbench("--help")
    assert proc.returncode == 0
    listed = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert listed == list(cli.COMMANDS) and {"run", "verify", "judge", "compare", "record-reference", "nightly", "check"} <= set(listed)


@pytest.mark.parametrize(
    "command, option",
    [
        ("run", "--case_name"),
        ("verify", "RESULTS.json"),
        ("judge", "--update"),
        ("record-reference", "--why"),
        ("nightly", "--check"),
        ("cleanup", "--cluster"),
        ("scaffold-case", "--model"),
        ("scaffold-config", "case_name"),
        ("check", "vendor"),
    ],
)
def test_each_command_lists_its_own_options(command, option):
    proc = flagbench(command, "--help")
    assert proc.returncode == 0 and option in proc.stdout, proc.stdout + proc.stderr


def test_a_command_and_the_older_forms_plan_alike(tmp_path):
    args = ["--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--dry-run", "--json", "--log-dir", str(tmp_path)]
    plans = [flagbench("run", *args), flagbench(*args)]
    plans.append(
        subprocess.run([sys.executable, "run_benchmarks/start_task.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    )
    docs = [json.loads(p.stdout) for p in plans]
    assert all(p.returncode == 0 for p in plans)
    assert len({json.dumps(d["settings"], sort_keys=True) for d in docs}) == 1 and {d["config_name"] for d in docs} == {"config_cpux1x2"}


def test_an_unknown_command_is_named_with_the_closest():
    proc = flagbench("verfy", "x.json")
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == "error: flagbench has no command 'verfy'; did you mean 'verify'? (flagbench --help lists them)"
    )
    assert flagbench().returncode == 2


def test_verify_through_the_command(tmp_path):
    proc = flagbench("verify", "docs/results/runs/2026-11-29_llama3_8b_H200x1_short-micro2.json")
    assert proc.returncode == 0 and "every figure of 1 round(s) matches its records" in proc.stdout, proc.stdout + proc.stderr


def test_the_installed_console_script_runs_from_outside_the_checkout(tmp_path):
    """``flagbench`` as the README's first command installs it (``pip install -e .``), run from a
    folder that is no checkout: it plans a case (its settings check imports the case's package)
    and checks a vendor folder without a false problem."""
    script = shutil.which("flagbench")
    if script is None:
        pytest.skip("the flagbench console script is not installed (pip install -e . installs it)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plan = subprocess.run(
        [script, "run", "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--dry-run", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert json.loads(plan.stdout)["case"] == "llama3_tiny:megatron:cpu:1:2:1"
    check = subprocess.run([script, "check", "cpu"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip().endswith("cpu: ok"), check.stdout + check.stderr


def test_the_installed_command_works_on_the_checkout_it_runs_inside(tmp_path):
    """Run inside another checkout, the installed ``flagbench`` plans that checkout's configs and
    scaffolds into it, saying so; outside any checkout it works on the installed one."""
    script = shutil.which("flagbench")
    if script is None:
        pytest.skip("the flagbench console script is not installed (pip install -e . installs it)")
    installed = Path(
        subprocess.run(
            [sys.executable, "-c", "import run_benchmarks; print(run_benchmarks.__file__)"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        ).stdout.strip()
    ).parents[1]
    other = tmp_path / "other"
    for name in ("run_benchmarks", "training", "cases", "vendors"):
        shutil.copytree(ROOT / name, other / name, ignore=shutil.ignore_patterns("__pycache__", "logs"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLAGBENCH_CHECKOUT")}
    plan_args = [script, "run", "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--dry-run", "--json"]
    inside = subprocess.run(plan_args, cwd=other / "cases", env=env, capture_output=True, text=True, timeout=120)
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert json.loads(inside.stdout)["config_file"] == str(other / "vendors/cpu/cases/llama3_tiny/megatron/config_cpux1x2.yaml")
    assert f"flagbench: the checkout at {other} (the installed one is {installed})" in inside.stderr
    made = subprocess.run(
        [script, "scaffold-case", "qwen2", "paddle", "--model", "qwen2_tiny"],
        cwd=other,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0 and (other / "cases/qwen2/paddle/case.yaml").is_file(), made.stdout + made.stderr
    assert not (installed / "cases" / "qwen2").exists()
    outside = subprocess.run(plan_args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert outside.returncode == 0 and "flagbench: the checkout at" not in outside.stderr, outside.stderr
    assert json.loads(outside.stdout)["config_file"].startswith(str(installed / "vendors"))


def test_each_older_flag_is_an_alias_of_one_command():
    """start_task.py's flags name the commands they are aliases of, in one table, and are taken
    out of the arguments the command is called with (``--flag=value`` keeps its value)."""
    flags = {c.alias: name for name, c in cli.COMMANDS.items() if c.alias}
    assert flags == {
        "--verify": "verify",
        "--judge": "judge",
        "--compare": "compare",
        "--record-reference": "record-reference",
        "--ceiling": "ceiling",
        "--conformance": "conformance",
        "--nightly": "nightly",
        "--cleanup": "cleanup",
        "--load-images": "load-images",
    }
    assert cli.aliased(["--reference", "r.json", "--judge", "a.json", "b.json", "--update"]) == (
        "judge",
        ["--reference", "r.json", "a.json", "b.json", "--update"],
    )
    assert cli.aliased(["--verify=a.json"]) == ("verify", ["a.json"])
    assert cli.aliased(["--vendor", "cpu", "--case_name", "x:megatron:cpu:1:1"]) is None  # a run


def test_every_command_names_a_function_that_exists():
    import importlib

    for name, command in cli.COMMANDS.items():
        module, _, function = command.function.partition(":")
        assert callable(getattr(importlib.import_module(f"run_benchmarks.{module}"), function, None)), name
