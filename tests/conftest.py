"""Shared fixtures.

Framework environments are the harness's own (run_benchmarks.planning.envs): the cpu
vendor's per-framework virtualenvs, built once and cached.  Tests of a case
find its Python through FB_TEST_<FRAMEWORK>_PYTHON, set here when not given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks.planning import envs

FRAMEWORKS = ("megatron", "deepspeed", "paddle")


def _framework_python(framework: str) -> str | None:
    var = f"FB_TEST_{framework.upper()}_PYTHON"
    if os.environ.get(var):
        return os.environ[var]
    if os.environ.get("FB_TEST_BUILD_ENVS", "1") == "0":
        return None
    log = Path(envs.cache_root()) / f"build-{framework}.log"
    py = str(envs.ensure_env("cpu", framework, log))
    os.environ[var] = py
    return py


def pytest_configure(config: pytest.Config) -> None:
    from tests import parallel

    config.pluginmanager.register(parallel, "flagbench-parallel")  # the suite on several workers
    # the test session's local runs lock among themselves (one at a time, as the tests run),
    # not against a benchmark that may be running on this machine; each xdist worker's among
    # its own (a worker inherits the controller's environment)
    if not os.environ.get("FLAGBENCH_LOCK_DIR") or parallel.is_worker(config):
        import tempfile

        os.environ["FLAGBENCH_LOCK_DIR"] = tempfile.mkdtemp(prefix="flagbench-test-locks-")
    # DeepSpeed's CPU comm op, JIT-built by ninja (about a minute): the local runs and the
    # tests' own launches keep it in a folder of theirs (torch_extensions_dir). In the shared
    # default (~/.cache/torch_extensions) the ssh runtime's runs build it with the framework
    # environment's ninja (node_agent puts its bin/ first on PATH) and these runs with the
    # system's; each ninja reads the other's build log as a changed command and builds it all
    # again, twice a test session. (A DeepSpeed case under Slurm would bring the environment's
    # ninja here too: node_agent runs there, with this environment.)
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        from tests.case_helpers import torch_extensions_dir

        os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()
    for fw in FRAMEWORKS:  # environments already built are used without asking
        var = f"FB_TEST_{fw.upper()}_PYTHON"
        ready = envs.env_dir("cpu", fw) / ".flagbench-ready"
        if not os.environ.get(var) and ready.is_file():
            os.environ[var] = str(envs.python_of(envs.env_dir("cpu", fw)))
    config.addinivalue_line("markers", "framework(name): needs the cpu vendor's environment for a framework")
    config.addinivalue_line("markers", "cluster: needs the network-namespace test cluster (root, sshd, dockerd)")
    config.addinivalue_line(
        "markers", "e2e: runs a framework, a test cluster or a shared run (set from the fixtures; -m 'not e2e' is the fast tier)"
    )
    config.addinivalue_line("markers", "torch_unit: a unit test needing torch, run again in a framework environment by units_in_env")


#: fixtures that start real processes of a framework, a cluster or a shared run: a test using one is e2e
E2E_FIXTURES = {
    "megatron_python",
    "deepspeed_python",
    "paddle_python",
    "cluster",
    "cluster_pool",
    "slurm_cluster",
    "llama3_dp2_run",
    "deepspeed_units",
}


def is_e2e(item: pytest.Item) -> bool:
    """The test runs something real end to end (a framework's training, a test cluster): all but
    the fast tier, ``-m "not e2e"`` (README)."""
    if any(item.iter_markers("framework")) or any(item.iter_markers("cluster")) or any(item.iter_markers("e2e")):
        return True
    return bool(E2E_FIXTURES & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_e2e(item):
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(trylast=True)  # on the tests left to run
def pytest_collection_finish(session: pytest.Session) -> None:
    needed = {m.args[0] for item in session.items for m in item.iter_markers("framework")}
    # build every environment the selected tests need before any test runs
    for fw in sorted(needed):
        _framework_python(fw)


def _environment_fixture(framework: str):  # type: ignore[no-untyped-def]
    """A session fixture giving the cpu vendor's Python for ``framework`` (built once)."""

    @pytest.fixture(scope="session")
    def python() -> str:
        py = _framework_python(framework)
        if not py:
            pytest.skip(f"{framework} environment not available (FB_TEST_BUILD_ENVS=0)")
        return py

    return python


megatron_python = _environment_fixture("megatron")
deepspeed_python = _environment_fixture("deepspeed")
paddle_python = _environment_fixture("paddle")


@pytest.fixture(scope="session")
def deepspeed_units(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The torch-only unit tests of every selected test file whose wrapper asks for this
    fixture, run once, in one session under the deepspeed environment's Python
    (case_helpers.units_of_files_in_env); each wrapper checks its own file's outcomes."""
    from tests.case_helpers import units_of_files_in_env

    files = sorted({str(item.path) for item in request.session.items if "deepspeed_units" in getattr(item, "fixturenames", ())})
    return units_of_files_in_env("FB_TEST_DEEPSPEED_PYTHON", files)


@pytest.fixture(scope="session")
def llama3_dp2_run(tmp_path_factory: pytest.TempPathFactory, megatron_python: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``llama3_tiny:megatron:cpu:1:2`` through start_task.py as committed (config_cpux1x2:
    DP2, 30 steps, judged against its reference curve), once a session, with a plain progress
    line every second: the process and its run folder. tests/test_e2e_local.py and
    tests/test_llama3_megatron_case.py both check it."""
    from run_benchmarks.planning.registry import ROOT

    log_dir = tmp_path_factory.mktemp("llama3_dp2")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run_benchmarks" / "start_task.py"), "--vendor", "cpu"]
        + ["--case_name", "llama3_tiny:megatron:cpu:1:2", "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "FLAGBENCH_PROGRESS_EVERY_S": "1"},
    )
    runs = [p for p in log_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc, runs[0]


# the real test cluster (network namespaces with sshd + dockerd): tests/cluster/
from tests.cluster.fixtures import cluster, cluster_pool, torch_venv  # noqa: F401
