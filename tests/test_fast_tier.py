"""The fast tier (``-m "not e2e"``, README): the tests that start no framework, test cluster or
shared run. A test is marked e2e from its marks and fixtures (tests/conftest.py ``is_e2e``)."""

from __future__ import annotations

import os
import subprocess
import sys

from run_benchmarks.planning.registry import ROOT


def _env() -> dict[str, str]:
    """This run's environment less PYTEST_ADDOPTS, whose options (``-v``) would change what
    ``--collect-only -q`` prints."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "FB_TEST_BUILD_ENVS": "0"}


def _collected(*args: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_fast_tier_leaves_out_what_runs_a_framework_or_a_cluster() -> None:
    files = ["tests/test_recipe_teeth.py", "tests/test_validated_configs.py", "tests/test_failures_slurm.py"]
    every, fast, slow = _collected(*files), _collected("-m", "not e2e", *files), _collected("-m", "e2e", *files)
    assert sorted(fast + slow) == sorted(every) and not set(fast) & set(slow)
    assert [t for t in every if t.startswith("tests/test_recipe_teeth.py::")] == [
        t for t in slow if t.startswith("tests/test_recipe_teeth.py::")
    ]
    assert all(t.startswith("tests/test_validated_configs.py::") for t in every if t not in slow and "slurm" not in t)
    assert "tests/test_failures_slurm.py::test_a_wrong_slurm_conf_is_named_at_once" in fast  # no cluster: the tier keeps it
    assert "tests/test_failures_slurm.py::test_a_host_not_in_slurm_conf_is_named" in slow  # the Slurm cluster
