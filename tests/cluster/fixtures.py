"""pytest fixtures for the real test cluster (see docs/cluster-testing.md).

``cluster``: a 2-host cluster for the whole session (or the one named by the
``FLAGBENCH_CLUSTER`` environment variable: a directory made by ``python -m
tests.cluster.netns up``). Tests that need it are skipped, with the reason, when not root
or when a tool is missing. ``cluster_pool``: a connected ``SSHPool`` over its hosts.
``torch_venv``: a Python 3.11 virtualenv with the CPU torch build to bind-mount into
containers: ``FLAGBENCH_TORCH_VENV``, else the cpu megatron/deepspeed environment when the
harness has built it, else one built once under ``~/.cache/flagbench/venvs``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import netns

TORCH_VERSION = "2.13.0"
# The interpreter the harness runs on; containers get it bind-mounted at the same path.
HOST_PYTHON_PREFIX = Path(sys.base_prefix)


def cluster_skip_reason() -> str | None:
    """Why a cluster cannot be built here, or None."""
    if os.environ.get("FLAGBENCH_CLUSTER"):
        return None
    missing = netns.missing_requirements()
    if missing:
        return f"the test cluster needs root and these tools (tests/install_system_deps.sh installs them): missing {', '.join(missing)}"
    return None


@pytest.fixture(scope="session")
def cluster() -> Iterator[netns.Cluster]:
    existing = os.environ.get("FLAGBENCH_CLUSTER")
    if existing:
        yield netns.Cluster.load(existing)
        return
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(reason)
    log = lambda msg: print(msg, file=sys.stderr)
    netns.sweep_stale("/tmp/fbc-*", log=log)  # clusters of test runs that were killed
    # A short directory: dockerd and containerd put unix sockets (108-byte limit) under it.
    directory = tempfile.mkdtemp(prefix="fbc-", dir="/tmp")
    try:
        c = netns.up(2, directory, owner_pid=os.getpid(), log=log)
        yield c
    finally:
        netns.down(directory, log=log)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster_pool(cluster: netns.Cluster):
    from run_benchmarks.running.remote.ssh import SSHPool

    pool = SSHPool(cluster.host_specs())
    pool.connect()
    yield pool
    pool.close()


def _build_torch_venv(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "bin" / "python").exists():
            return target
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        python = HOST_PYTHON_PREFIX / "bin" / "python3"
        subprocess.run([str(python), "-m", "venv", str(tmp)], check=True, timeout=300)
        subprocess.run(
            [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}", "numpy"], check=True, timeout=1200
        )
        os.replace(tmp, target)  # bin/python and site-packages do not depend on the path
        return target


def _framework_venv_with_torch() -> Path | None:
    """A cpu framework environment already built by the harness (the conftest exports its
    python as FB_TEST_<FRAMEWORK>_PYTHON) on this interpreter, with torch in it."""
    for var in ("FB_TEST_MEGATRON_PYTHON", "FB_TEST_DEEPSPEED_PYTHON"):
        py = os.environ.get(var)
        if not py:
            continue
        venv = Path(py).parent.parent
        try:
            cfg = (venv / "pyvenv.cfg").read_text()
        except OSError:
            continue
        home = [line.split("=", 1)[1].strip() for line in cfg.splitlines() if line.split("=", 1)[0].strip() == "home"]
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        if home and Path(home[0]) == HOST_PYTHON_PREFIX / "bin" and (venv / "lib" / ver / "site-packages" / "torch").is_dir():
            return venv
    return None


@pytest.fixture(scope="session")
def torch_venv() -> Path:
    """A venv with torch on the harness's interpreter: FLAGBENCH_TORCH_VENV, else a cpu
    framework environment (what real CPU runs mount), else one built for the tests."""
    given = os.environ.get("FLAGBENCH_TORCH_VENV")
    if given:
        return Path(given)
    framework = _framework_venv_with_torch()
    if framework is not None:
        return framework
    cache = Path(os.environ.get("FLAGBENCH_CACHE") or os.path.expanduser("~/.cache/flagbench"))
    ver = f"py{sys.version_info.major}{sys.version_info.minor}"
    return _build_torch_venv(cache / "venvs" / f"torch-{TORCH_VERSION}-cpu-{ver}")


__all__ = ["cluster", "cluster_pool", "cluster_skip_reason", "torch_venv", "HOST_PYTHON_PREFIX", "TORCH_VERSION"]
