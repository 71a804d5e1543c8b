"""start_task.py SIGKILLed mid-run (its machine lost, an operator's kill -9): nothing of the
run trains on, and ``--cleanup`` then brings back what it left on the hosts and finishes its
results.json. Each host's watcher (running/watcher.py) sees its input end and ends the
run's ranks and containers there; the local runtime's watcher its ranks. A results.json left
running with nothing of its run left on the hosts is found from this machine's side: its
``writer.json`` names a start_task.py that is gone. Real runs, a real SIGKILL; the bound is
the watcher's reaction plus ``docker rm -f``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_benchmarks.judging import results
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running import orphans
from run_benchmarks.running.watcher import LOCAL_MARK, marked_processes
from tests.test_results_models import fake_run
from tests.test_ssh_runtime import CASE, START, cluster_file, leftovers

#: from the SIGKILL to nothing of the run left: the watcher reads the end of its input at
#: once; removing 2 containers took 1.5 s on the 2-core test machine, 2026-12-01
BOUND_S = 20.0


def _start(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, START, "--vendor", "cpu", *argv, "--set", "train.steps=100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )


def _training(log_dir: Path, p: subprocess.Popen[str], ranks: str, timeout: float = 300) -> str:
    """Until a rank log of the run logging into ``log_dir`` is under ``ranks`` (a glob from the
    run id); the run id."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert p.poll() is None, f"start_task.py ended: {p.returncode}"
        run_id = next((d.name for d in log_dir.iterdir()), None) if log_dir.is_dir() else None
        if run_id and list(Path("/").glob(ranks.format(run_id=run_id).lstrip("/"))):
            time.sleep(3)  # a few steps in
            return run_id
        time.sleep(0.5)
    p.kill()
    pytest.fail("no rank started training")


def _cleanup(*argv: str, code: int = 0) -> list[str]:
    """``start_task.py --cleanup`` with ``argv``: its lines, once it exits ``code``."""
    c = subprocess.run([sys.executable, START, "--cleanup", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert c.returncode == code, c.stdout + c.stderr
    return (c.stdout + c.stderr).splitlines()


def _gone_error(pid: int, rounds: int = 0) -> str:
    return (
        f"start_task.py ended without finishing the run after {rounds} round(s) (pid {pid} on {socket.gethostname()} gone); "
        "--cleanup found nothing of it left on the hosts"
    )


def _gone_within(what, bound: float) -> float:
    """Seconds until ``what()`` is empty; fails past ``bound``."""
    t0 = time.monotonic()
    while (left := what()) and time.monotonic() - t0 < bound:
        time.sleep(0.2)
    assert not left, f"still there {bound:g} s after the SIGKILL: {left}"
    return time.monotonic() - t0


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.framework("megatron")
def test_the_local_ranks_end_with_a_killed_orchestrator(megatron_python, tmp_path):
    log_dir = tmp_path / "logs"
    p = _start(["--case_name", "llama3_tiny:megatron:cpu:1:2", "--log-dir", str(log_dir)])
    try:
        run_id = _training(log_dir, p, f"{log_dir}/{{run_id}}/round1/node0/ranks/*/*")
        assert marked_processes(run_id, LOCAL_MARK), "the ranks carry no mark"
        path = log_dir / run_id / "results.json"
        assert _cleanup("--log-dir", str(log_dir)) == [f"{path}: left running: its start_task.py (pid {p.pid}) is still running"]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        took = _gone_within(lambda: marked_processes(run_id, LOCAL_MARK), BOUND_S)
        print(f"local ranks gone {took:.1f} s after the SIGKILL")
        # nothing of the run is left but its results.json saying running: --cleanup finishes it
        assert json.loads(path.read_text())["status"] == "running"
        said = _cleanup("--log-dir", str(log_dir))
        res = json.loads(path.read_text())
        assert res["status"] == "failed" and res["finished"] and res["error"] == _gone_error(p.pid), res
        assert said == [f"{path}: finished as failed (it said running): {res['error']}"]
    finally:
        p.kill()
        for pid in marked_processes(run_id, LOCAL_MARK) if "run_id" in locals() else []:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.cluster
@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.framework("megatron")
@pytest.mark.parametrize("runtime", ["container", "process"])
def test_the_hosts_ranks_end_with_a_killed_orchestrator(cluster, megatron_python, tmp_path, runtime):
    cfile = cluster_file(cluster, tmp_path, megatron_python, runtime=runtime)
    log_dir = tmp_path / "logs"
    p = _start(["--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(log_dir)])
    h2 = cluster.host("h2")
    try:
        run_id = _training(log_dir, p, f"{h2.workdir}/fb/runs/{{run_id}}/round1/node1/ranks/*/*")
        assert len(leftovers(cluster, run_id)) >= 2  # a container or processes of the run on each host
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        took = _gone_within(lambda: leftovers(cluster, run_id), BOUND_S)
        print(f"the hosts' {runtime} ranks gone {took:.1f} s after the SIGKILL")
        run_dir = log_dir / run_id
        if runtime == "process":  # the hosts' folders removed by hand: results.json is found from this side
            for h in cluster.hosts:
                subprocess.run(["rm", "-rf", "--", str(Path(h.workdir, "fb", "runs", run_id))], check=True)
            said = _cleanup("--cluster", str(cfile), "--log-dir", str(log_dir))
            res = json.loads((run_dir / "results.json").read_text())
            assert res["status"] == "failed" and res["finished"] and res["error"] == _gone_error(p.pid), res
            assert said == ["nothing left on the hosts", f"{run_dir}/results.json: finished as failed (it said running): {res['error']}"]
            return
        # --cleanup brings back what the run left on the hosts, removes it there, finishes results.json
        c = subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, text=True, timeout=300)
        assert c.returncode == 0, c.stdout + c.stderr
        for k, h in enumerate(cluster.hosts):
            said = f"host {h.name}: run {run_id} left 1 node folder(s) (round1/node{k}): brought back into {run_dir}, then removed there"
            assert said in c.stdout.splitlines(), c.stdout
            assert not Path(h.workdir, "fb", "runs", run_id).exists()
            assert list((run_dir / "round1" / f"node{k}" / "ranks").rglob("stdout.log")), f"node{k}: no rank log here"
        res = json.loads((run_dir / "results.json").read_text())
        assert res["status"] == "failed" and res["finished"], res["status"]
        assert res["error"] == (
            "start_task.py ended without finishing the run after 0 round(s); --cleanup found "
            "1 node folder(s) (round1/node0) on h1, brought back; 1 node folder(s) (round1/node1) on h2, brought back"
        ), res["error"]
        assert f"{run_dir}/results.json: finished as failed (it said running): {res['error']}" in c.stdout.splitlines(), c.stdout
    finally:
        p.kill()
        if "run_id" in locals() and leftovers(cluster, run_id):  # the next tests find the hosts clean
            subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, timeout=300)


def _left_running(log_dir: Path, name: str, writer: dict | None, backend: str = "local") -> Path:
    """A run folder whose results.json says running, ``writer`` its writer.json (None: none)."""
    run_dir = log_dir / name
    res = fake_run(run_id=name).model_copy(update={"status": "running", "finished": None, "rounds": [], "backend": backend})
    results.write(res, run_dir)
    if writer is not None:
        (run_dir / orphans.WRITER).write_text(json.dumps(writer))
    return run_dir / "results.json"


def test_cleanup_finishes_only_the_runs_whose_writer_is_gone(tmp_path):
    """Real processes as writers: one alive, one ended, and this one under another start (a
    reused pid); a run of another host, one before writers were recorded, one on ssh hosts."""
    here, log_dir = socket.gethostname(), tmp_path / "logs"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        started = orphans.process_start(ended.pid)
        ended.wait()
        paths = {
            "alive": _left_running(log_dir, "alive", {"host": here, "pid": alive.pid, "started": orphans.process_start(alive.pid)}),
            "ended": _left_running(log_dir, "ended", {"host": here, "pid": ended.pid, "started": started}),
            "reused": _left_running(log_dir, "reused", {"host": here, "pid": os.getpid(), "started": "another start"}),
            "other": _left_running(log_dir, "other", {"host": "elsewhere", "pid": 1, "started": "x"}),
            "older": _left_running(log_dir, "older", None),
            "ssh": _left_running(log_dir, "ssh", {"host": here, "pid": ended.pid, "started": started}, backend="ssh"),
        }
        said = _cleanup("--log-dir", str(log_dir))
        assert said == [
            f"{paths['alive']}: left running: its start_task.py (pid {alive.pid}) is still running",
            f"{paths['ended']}: finished as failed (it said running): {_gone_error(ended.pid)}",
            f"{paths['older']}: left running: it names no writer (writer.json), so whether its start_task.py is gone cannot be told",
            f"{paths['other']}: left running: written on elsewhere, not this host (--cleanup there finishes it)",
            f"{paths['reused']}: finished as failed (it said running): {_gone_error(os.getpid())}",
            f"{paths['ssh']}: left running: its run was on ssh hosts, not looked at (give --cluster FILE of them)",
        ]
        for name, path in paths.items():
            res = json.loads(path.read_text())
            finished = ("failed", True) if name in ("ended", "reused") else ("running", False)
            assert (res["status"], bool(res["finished"])) == finished, name
        assert _cleanup("--log-dir", str(log_dir / "ended")) == [f"no results.json left running in {log_dir / 'ended'}"]
        assert _cleanup("--log-dir", str(tmp_path / "none"), code=2) == [f"error: --log-dir {tmp_path / 'none'}: no such folder"]
    finally:
        alive.kill()
        alive.wait()
