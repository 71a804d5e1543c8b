"""Helpers shared by the case tests (llama3/megatron, gpt3/paddle, baichuan2 and llava/deepspeed)."""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

ROOT = Path(__file__).resolve().parent.parent
START = str(ROOT / "run_benchmarks" / "start_task.py")


def start_task(*args: str, timeout: float = 900, cwd: Path | str | None = None, **env: str) -> subprocess.CompletedProcess:
    """``start_task.py args`` under this Python, its output captured; ``env`` added to this
    process's environment."""
    return subprocess.run(
        [sys.executable, START, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **env}
    )


def framework_python(var: str, skip_reason: str) -> str:
    """The framework environment's Python named by ``var``; skip the test when it is not set."""
    py = os.environ.get(var)
    if not py:
        pytest.skip(f"{var} is not set: {skip_reason}")
    return py


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: DeepSpeed's CPU all-reduce maps one 66 MB file per rank here, named by the rendezvous's
#: address and port, and never unlinks it (run_benchmarks/planning/launchers.py)
SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def remove_shm_buffers(port: int | str) -> None:
    """Remove the all-reduce buffers of the launch at ``port``, once its ranks have ended. Only
    that launch's: another one starting beside it (the other xdist worker's) finds its peers'
    buffers by name, and one removed between its creation and its peer's open leaves that peer
    waiting forever, holding the interpreter lock in DeepSpeed's C++ (shm.cpp's open loop)."""
    for path in glob.glob(f"{SHM_BUFFERS}_{port}_*"):
        Path(path).unlink(missing_ok=True)


def torch_extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its CPU shared-memory comm op: ``TORCH_EXTENSIONS_DIR`` when
    set, else a ``torch_extensions`` folder beside the framework environments, so the build
    (about a minute) is kept between test runs."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path(os.environ.get("FLAGBENCH_ENV_DIR", Path.home() / ".cache" / "flagbench" / "envs")).parent / "torch_extensions"
    )


def deepspeed_launch(py: str, tmp: Path, cfg: dict, train_py: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """A DeepSpeed case's ``train_py`` on 2 local CPU ranks of ``cfg`` (its resolved config,
    written to ``tmp/resolved.json``), started as the harness does (DeepSpeed's per-node
    launcher, run_benchmarks/planning/launchers.py), with the ranks' output on the launcher's
    rather than in files; it is kept in ``tmp/stdout.log`` and ``tmp/stderr.log``."""
    import json

    from run_benchmarks.planning.launchers import DeepSpeed, LaunchSpec

    path = tmp / "resolved.json"
    path.write_text(json.dumps(cfg, indent=1))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "FB_RUN_ID": cfg["run_id"],
        "OMP_NUM_THREADS": "1",
        # DeepSpeed JIT-builds its CPU shared-memory comm op once (about a minute); keep it in a cache
        "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
    }
    port = free_port()
    spec = LaunchSpec(py, 1, 2, 0, "127.0.0.1", port, str(train_py), str(path), log_dir=str(tmp), device="cpu")
    cmd = DeepSpeed().command(spec)
    del cmd[cmd.index("--enable_each_rank_log") : cmd.index("--enable_each_rank_log") + 2]
    # its own process group: on a timeout the ranks go with the launcher, not left running
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        finally:
            remove_shm_buffers(port)
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    (tmp / "stdout.log").write_text(proc.stdout)
    (tmp / "stderr.log").write_text(proc.stderr)
    return proc


def pytest_in(py: str, test_file: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run pytest on ``test_file`` under another Python (a framework environment's), from the
    repository root with it on ``PYTHONPATH`` and without building environments."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "FB_TEST_BUILD_ENVS": "0", **(env or {})}
    return subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def torch_unit(available: bool, reason: str = "torch is not importable here (runs in the framework env)") -> Callable[[F], F]:
    """Decorator of a unit test that needs torch: skipped where torch is not importable, and
    marked ``torch_unit``, the tests :func:`units_in_env` runs in a framework environment."""

    def mark(fn: F) -> F:
        return pytest.mark.torch_unit(pytest.mark.skipif(not available, reason=reason)(fn))

    return mark


@dataclasses.dataclass
class EnvUnits:
    """One pytest session of several files' torch-only unit tests in a framework environment
    (:func:`units_of_files_in_env`): the process, and each file's outcomes."""

    proc: subprocess.CompletedProcess
    outcomes: dict[str, collections.Counter]  # test file name -> passed / failed / error / skipped

    def of(self, test_file: str | Path) -> collections.Counter:
        """``test_file``'s outcomes there; asserts that none failed or erred and that some ran."""
        got = self.outcomes.get(Path(test_file).name, collections.Counter())
        tail = self.proc.stdout[-4000:] + self.proc.stderr[-2000:]
        assert got["failed"] == got["error"] == 0 and got["passed"] > 0, (Path(test_file).name, dict(got), tail)
        return got


def units_of_files_in_env(var: str, test_files: Sequence[str | Path], timeout: int = 900) -> EnvUnits:
    """The torch-only unit tests (:func:`torch_unit`) of ``test_files``, in one pytest session
    under the framework Python named by ``var`` (skip when it is unset; ``var`` cleared there):
    torch and the framework are imported once for all of them, not once a file. A file that
    cannot be collected there counts as an error of that file, the others still run."""
    py = framework_python(var, "no Python with torch to run the unit tests")
    with tempfile.TemporaryDirectory(prefix="fb-units-") as tmp:
        report = Path(tmp) / "units.xml"
        proc = pytest_in(
            py,
            *(str(f) for f in test_files),
            "-m",
            "torch_unit",
            "--continue-on-collection-errors",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit1",
            env={var: ""},
            timeout=timeout,
        )
        assert report.is_file(), proc.stdout[-4000:] + proc.stderr[-2000:]
        outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for case in ET.parse(report).iter("testcase"):
            # a test: file="tests/test_x.py"; a file that could not be collected: name="tests.test_x"
            name = (
                Path(case.get("file")).name if case.get("file") else (case.get("classname") or case.get("name", "")).split(".")[-1] + ".py"
            )
            kinds = {child.tag for child in case}
            kind = "error" if "error" in kinds else "failed" if "failure" in kinds else "skipped" if "skipped" in kinds else "passed"
            outcomes[name][kind] += 1
    return EnvUnits(proc, dict(outcomes))


def units_in_env(var: str, test_file: Path, *args: str, timeout: int = 600) -> str:
    """Run ``test_file``'s torch-only unit tests (those marked by :func:`torch_unit`; ``args``: e.g.
    ``-k``) in the framework Python named by ``var`` (skip when it is unset), with ``var`` cleared
    there so the wrapper does not recurse; assert they passed and return pytest's summary line.
    The file's other tests (end to end through start_task.py) ran in this interpreter already."""
    py = framework_python(var, "no Python with torch to run the unit tests")
    proc = pytest_in(py, test_file, "-m", "torch_unit", *args, env={var: ""}, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]
