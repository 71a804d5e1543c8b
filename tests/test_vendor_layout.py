"""Vendor configs are addressed by model and framework: ``vendors/<vendor>/cases/<model>/<framework>/``.

A model served by two frameworks (here llama3_tiny, given a second case on DeepSpeed in a
temporary tree) has one config folder per framework, each resolved through the framework of
the case name; a config left in the model folder (the layout without framework folders) is
refused with the move to make, and ``vendor_tools check`` names every folder out of place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning import plan, registry
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.tools import vendor_tools
from training import shapes

MODEL = "llama3_tiny"
DEEPSPEED_CONFIG = (
    "description: llama3_tiny on DeepSpeed, 2 processes\nvalidated: false\ntrain: {micro_batch: 2}\nparallel: {recompute: full}\n"
)


def _second_case(cases: Path) -> None:
    """cases/llama3/deepspeed: the DeepSpeed case's yaml serving llama3_tiny (the baichuan2 tiny shape)."""
    case = shapes.complete(yaml.safe_load((registry.CASES_DIR / "baichuan2" / "deepspeed" / "case.yaml").read_text()))
    case["family"] = "llama3"
    case["models"] = {MODEL: case["models"]["baichuan2_tiny"]}
    (cases / "llama3" / "deepspeed").mkdir(parents=True)
    (cases / "llama3" / "deepspeed" / "case.yaml").write_text(yaml.safe_dump(case, sort_keys=False))


@pytest.fixture
def tree(tmp_path):
    """(cases dir, vendors dir): llama3_tiny on megatron and deepspeed; the cpu vendor with its configs of each."""
    cases, vendors = tmp_path / "cases", tmp_path / "vendors"
    (cases / "llama3" / "megatron").mkdir(parents=True)
    shutil.copy2(registry.CASES_DIR / "llama3" / "megatron" / "case.yaml", cases / "llama3" / "megatron" / "case.yaml")
    _second_case(cases)
    shutil.copytree(registry.VENDORS_DIR / "cpu", vendors / "cpu", ignore=shutil.ignore_patterns("cases", "__pycache__"))
    megatron = registry.vendor_config_dir("cpu", MODEL, "megatron", vendors)
    shutil.copytree(registry.vendor_config_dir("cpu", MODEL, "megatron"), megatron)
    deepspeed = registry.vendor_config_dir("cpu", MODEL, "deepspeed", vendors)
    deepspeed.mkdir(parents=True)
    (deepspeed / "config_cpux1x2.yaml").write_text(DEEPSPEED_CONFIG)
    return cases, vendors


def test_a_model_on_two_frameworks_has_a_config_for_each(tree):
    cases, vendors = tree
    table = registry.cases(cases)
    assert registry.frameworks_serving(MODEL, table) == ["deepspeed", "megatron"]
    vendor = registry.load_vendor("cpu", vendors)
    resolved = {}
    for fw in ("megatron", "deepspeed"):
        cn = CaseName(MODEL, fw, "cpu", 1, 2)
        path = registry.vendor_config_path("cpu", cn, None, vendors)
        assert path == vendors / "cpu" / "cases" / MODEL / fw / "config_cpux1x2.yaml"
        entry = registry.find_case(cn, cases)
        assert entry.path == cases / "llama3" / fw
        resolved[fw] = plan.resolve(cn, vendor, entry, path)
    meg, ds = resolved["megatron"], resolved["deepspeed"]
    assert (meg.config_file.parent.name, ds.config_file.parent.name) == ("megatron", "deepspeed")
    assert meg.overrides == []  # tp 1, pp 1 and micro batch 1 are the standard's values: no override
    assert {o["param"]: o["value"] for o in ds.overrides} == {"train.micro_batch": 2}  # recompute full is its standard
    assert (meg.settings["train"]["global_batch"], ds.settings["train"]["global_batch"]) == (8, 16)  # each case's own standard
    assert vendor_tools.check_vendor("cpu", vendors_dir=vendors, cases_dir=cases) == []


def test_a_missing_size_lists_the_configs_of_that_framework_only(tree):
    cases, vendors = tree
    with pytest.raises(InputError) as err:
        registry.vendor_config_path("cpu", CaseName(MODEL, "deepspeed", "cpu", 1, 1), None, vendors)
    assert str(err.value) == (
        f"vendor 'cpu' has no config_cpux1x1 for {MODEL} on deepspeed "
        f"(vendors/cpu/cases/{MODEL}/deepspeed/config_cpux1x1.yaml missing); configs that exist: config_cpux1x2"
    )
    # megatron has config_cpux1x1: the two folders are separate
    assert registry.vendor_config_path("cpu", CaseName(MODEL, "megatron", "cpu", 1, 1), None, vendors).parent.name == "megatron"
    with pytest.raises(InputError, match="configs that exist: none$"):
        registry.vendor_config_path("cpu", CaseName(MODEL, "paddle", "cpu", 1, 2), None, vendors)


def test_a_config_in_the_old_layout_is_refused_with_the_move(tree):
    cases, vendors = tree
    model_dir = vendors / "cpu" / "cases" / MODEL
    (model_dir / "megatron" / "config_cpux1x2.yaml").rename(model_dir / "config_cpux1x2.yaml")
    with pytest.raises(InputError) as err:
        registry.vendor_config_path("cpu", CaseName(MODEL, "megatron", "cpu", 1, 2), None, vendors)
    assert str(err.value) == (
        f"vendor 'cpu': vendors/cpu/cases/{MODEL}/config_cpux1x2.yaml is in the old layout (no framework folder); "
        f"configs of {MODEL} on megatron live in vendors/cpu/cases/{MODEL}/megatron/: "
        f"move it to vendors/cpu/cases/{MODEL}/megatron/config_cpux1x2.yaml"
    )
    # another size: the configs left in the model folder are named too
    with pytest.raises(InputError) as err:
        registry.vendor_config_path("cpu", CaseName(MODEL, "megatron", "cpu", 1, 4), None, vendors)
    assert str(err.value).endswith(
        f"; vendors/cpu/cases/{MODEL}/ holds config_cpux1x2.yaml in the old layout: move them into vendors/cpu/cases/{MODEL}/megatron/"
    ), err.value
    # check names it with the move for each framework that serves the model
    assert vendor_tools.check_vendor("cpu", vendors_dir=vendors, cases_dir=cases) == [
        f"{model_dir / 'config_cpux1x2.yaml'}: not read: configs live in a framework folder; move it to "
        f"{model_dir / 'deepspeed' / 'config_cpux1x2.yaml'} or {model_dir / 'megatron' / 'config_cpux1x2.yaml'}"
    ]


def test_check_names_every_folder_out_of_place(tree):
    cases, vendors = tree
    root = vendors / "cpu" / "cases"
    (root / MODEL / "paddle").mkdir()
    (root / MODEL / "paddle" / "config_cpux1x2.yaml").write_text("train: {micro_batch: 1}\n")
    (root / "gpt9_tiny" / "megatron").mkdir(parents=True)
    (root / "gpt9_tiny" / "megatron" / "config_cpux1x2.yaml").write_text("train: {micro_batch: 1}\n")
    (root / "config_cpux1x2.yaml").write_text("train: {micro_batch: 1}\n")
    bad = registry.vendor_config_dir("cpu", MODEL, "deepspeed", vendors) / "config_cpux1x2_TP2.yaml"
    bad.write_text("parallel: {tp: 2}\n")  # a megatron key in the deepspeed folder: judged against the deepspeed case
    problems = vendor_tools.check_vendor("cpu", vendors_dir=vendors, cases_dir=cases)
    assert problems == [
        f"{root / 'config_cpux1x2.yaml'}: not read: configs live in {root}/<model>/<framework>/",
        f"{root / 'gpt9_tiny'}: no case serves model 'gpt9_tiny'; the cases serve llama3_8b, {MODEL}",
        f"{root / MODEL / 'paddle'}: framework 'paddle' does not serve model '{MODEL}'; it is served by deepspeed, megatron",
        f"{bad}: parameter 'parallel.tp' may not be changed by a vendor for this case (allowed: "
        + ", ".join(registry.find_case(CaseName(MODEL, "deepspeed", "cpu", 1, 2), cases).config.vendor_may_change)
        + ")",
    ], problems


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def test_start_task_and_check_in_a_tree_with_two_frameworks(tmp_path):
    """The command line, in a copy of the tree given llama3_tiny on DeepSpeed too."""
    repo = tmp_path / "repo"
    for name in ("run_benchmarks", "training", "cases", "vendors"):
        shutil.copytree(registry.ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy2(registry.ROOT / name, repo / name)
    shutil.copytree(registry.ROOT / "docs" / "results" / "runs", repo / "docs" / "results" / "runs")  # the runs validated_by names
    shutil.rmtree(repo / "cases" / "llama3" / "deepspeed", ignore_errors=True)
    _second_case(repo / "cases")
    deepspeed = registry.vendor_config_dir("cpu", MODEL, "deepspeed", repo / "vendors")
    deepspeed.mkdir()
    (deepspeed / "config_cpux1x2.yaml").write_text(DEEPSPEED_CONFIG)

    check = _run(repo, "-m", "run_benchmarks.tools.vendor_tools", "check", "cpu")
    assert check.returncode == 0 and check.stdout.strip().endswith("cpu: ok"), check.stdout + check.stderr
    plans = {}
    for fw in ("megatron", "deepspeed"):
        proc = _run(
            repo,
            "run_benchmarks/start_task.py",
            "--vendor",
            "cpu",
            "--case_name",
            f"{MODEL}:{fw}:cpu:1:2",
            "--python",
            sys.executable,
            "--dry-run",
            "--json",
        )
        assert proc.returncode == 0, proc.stderr
        plans[fw] = json.loads(proc.stdout)
    for fw, p in plans.items():
        assert p["config_file"] == str(repo / "vendors" / "cpu" / "cases" / MODEL / fw / "config_cpux1x2.yaml")
    assert plans["megatron"]["settings"]["train"]["micro_batch"] == 1 and plans["deepspeed"]["settings"]["train"]["micro_batch"] == 2

    # the deepspeed config moved up into the model folder: one line, exit 2, the move named
    (deepspeed / "config_cpux1x2.yaml").rename(deepspeed.parent / "config_cpux1x2.yaml")
    proc = _run(
        repo,
        "run_benchmarks/start_task.py",
        "--vendor",
        "cpu",
        "--case_name",
        f"{MODEL}:deepspeed:cpu:1:2",
        "--python",
        sys.executable,
        "--dry-run",
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"move it to vendors/cpu/cases/{MODEL}/deepspeed/config_cpux1x2.yaml" in proc.stderr, proc.stderr
    check = _run(repo, "-m", "run_benchmarks.tools.vendor_tools", "check", "cpu")
    assert check.returncode == 1 and "not read: configs live in a framework folder" in check.stdout, check.stdout
