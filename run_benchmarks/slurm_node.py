"""What each node of a Slurm job runs: ``python -m run_benchmarks.slurm_node --spec FILE``.

The slurm runtime (``run_benchmarks.runtimes.slurm``) writes one spec per round,
``<round_dir>/slurm/spec.json``, holding every node's launcher command as the planner
made it, with the rendezvous master's address left as a placeholder. ``srun`` starts
this module once per allocated node; it

1. picks its node's command by ``SLURM_NODEID`` (node rank k = the k-th node of the
   allocation, the order of ``scontrol show hostnames $SLURM_JOB_NODELIST``),
2. replaces the master placeholder with the allocation's first host name (for a
   container, the address this node resolves that name to),
3. starts ``python -m run_benchmarks.monitors`` in the background, writing
   ``node<k>/monitor.jsonl``,
4. runs the launcher (a plain process, or ``docker run`` of the vendor image) with its
   output in ``node<k>/stdout.log``, forwarding SIGTERM/SIGINT (scancel, time limit,
   a failed peer under ``srun --kill-on-bad-exit``) to it,
5. stops the monitor, writes ``node<k>/node.json`` (host, master, exit status) and
   exits with the launcher's status, so ``srun`` and the job state carry a failure.

Everything it reads and writes lives in the run directory, which must be on a
filesystem shared by the submit host and all nodes. Standard library only: it runs
under whatever interpreter the site gives the nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

SPEC_VERSION = 1
EXIT_NO_SPEC = 97  # the spec is not visible on this node (run dir not shared)
EXIT_BAD_ALLOCATION = 98  # the allocation does not match the plan
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL; below Slurm's KillWait (30 s by default)


def fail(code: int, message: str) -> int:
    print(f"flagbench slurm_node on {socket.gethostname()}: {message}", file=sys.stderr, flush=True)
    return code


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``n[1-2]`` -> ``n1``), as scontrol expands it."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    if not out:
        raise ValueError(f"scontrol show hostnames {nodelist!r} printed nothing")
    return out[0]


def address_of(host: str) -> str:
    """The address this node resolves ``host`` to (IPv4 first), else the name itself."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return host
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return str(infos[0][4][0]) if infos else host


def resolve(node: dict[str, Any], placeholder: str, master: str) -> tuple[list[str], dict[str, str]]:
    """The node's argv and env with the master placeholder replaced by the real host."""
    argv = [a.replace(placeholder, master) for a in node["command"]]
    env = {k: v.replace(placeholder, master) for k, v in node["env"].items()}
    return argv, env


def container_argv(container: dict[str, Any], name: str, env: dict[str, str], cwd: str, argv: list[str]) -> list[str]:
    """``docker run`` of the vendor image around the launcher argv."""
    out = ["docker", "run", "--rm", "--name", name, "--workdir", cwd, *container["options"]]
    for k, v in sorted(env.items()):
        out += ["--env", f"{k}={v}"]
    return out + [container["image"], *argv]


class Node:
    def __init__(self, spec: dict[str, Any], rank: int, master: str) -> None:
        self.spec, self.rank, self.master = spec, rank, master
        self.node_dir = Path(spec["round_dir"]) / f"node{rank}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.monitor: subprocess.Popen[bytes] | None = None
        self.container_name: str | None = None
        self.stop_signal: int | None = None
        self.stop_deadline: float | None = None
        self.on_stop: Callable[[int], None] | None = None  # called once, on the first stop signal
        self._lock = threading.Lock()

    def start_monitor(self) -> None:
        mon = self.spec["monitor"]
        log = open(self.node_dir / "monitor.log", "ab")
        try:
            self.monitor = subprocess.Popen(
                [mon["python"], "-m", "run_benchmarks.monitors", "--kind", mon["kind"],
                 "--out", str(self.node_dir / "monitor.jsonl"), "--interval", str(mon["interval_s"])],
                env={**os.environ, "PYTHONPATH": mon["pythonpath"]}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:  # a monitor must never fail the round
            log.write(f"monitor not started: {exc}\n".encode())
        finally:
            log.close()

    def stop_monitor(self) -> None:
        mon, self.monitor = self.monitor, None
        if mon is None or mon.poll() is not None:
            return
        mon.terminate()
        try:
            mon.wait(5)
        except subprocess.TimeoutExpired:
            mon.kill()
            mon.wait()

    def launch(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        container = self.spec.get("container")
        if container:
            self.container_name = f"fb-{os.environ.get('SLURM_JOB_ID', 'job')}-node{self.rank}"
            argv = container_argv(container, self.container_name, env, cwd, argv)
            full_env = dict(os.environ)
        else:
            full_env = {**os.environ, **env}
        with open(self.node_dir / "stdout.log", "ab") as out, self._lock:
            if self.stop_signal is not None:
                return  # stopped before it started
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def on_signal(self, signum: int, _frame: object) -> None:
        """scancel, a time limit or a failed peer: stop the launcher's whole process group.

        SIGTERM first; what is still there after ``STOP_GRACE_S`` gets SIGKILL from ``wait``,
        so that this wrapper reports before Slurm's own SIGKILL (after KillWait) arrives."""
        with self._lock:
            first = self.stop_signal is None
            if first:
                self.stop_signal = signum
                self.stop_deadline = time.monotonic() + STOP_GRACE_S
            proc = self.proc
        if first and self.on_stop is not None:
            self.on_stop(signum)
        if self.container_name:
            subprocess.run(["docker", "kill", "--signal", "TERM", self.container_name], capture_output=True, timeout=30)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        assert self.proc is not None
        while True:
            try:
                rc = self.proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
                    self._kill_now()
        self._kill_now()  # the launcher is gone; so must be anything it left in its group
        return rc

    def _kill_now(self) -> None:
        assert self.proc is not None
        if self.container_name:
            subprocess.run(["docker", "kill", self.container_name], capture_output=True, timeout=30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def write_report(node_dir: Path, report: dict[str, Any]) -> None:
    tmp = node_dir / "node.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, node_dir / "node.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run this Slurm node's part of a flagbench round")
    ap.add_argument("--spec", required=True, help="the round's spec.json, written by the slurm runtime")
    args = ap.parse_args(argv)
    spec_path = Path(args.spec)
    try:
        spec = json.loads(spec_path.read_text())
    except FileNotFoundError:
        return fail(EXIT_NO_SPEC, f"{spec_path} is not visible on this node: the run directory must be on a "
                                  "filesystem shared by the submit host and every node")  # fmt: skip
    if spec.get("version") != SPEC_VERSION:
        return fail(EXIT_NO_SPEC, f"{spec_path}: spec version {spec.get('version')!r}, expected {SPEC_VERSION}")

    env = os.environ
    try:
        rank, procid, nnodes = int(env["SLURM_NODEID"]), int(env["SLURM_PROCID"]), int(env["SLURM_NNODES"])
        nodelist = env["SLURM_JOB_NODELIST"]
    except (KeyError, ValueError) as exc:
        return fail(EXIT_BAD_ALLOCATION, f"not inside a Slurm job step ({exc})")
    nodes = spec["nodes"]
    if nnodes != len(nodes) or rank != procid or not 0 <= rank < len(nodes):
        return fail(EXIT_BAD_ALLOCATION, f"allocation of {nnodes} node(s), node id {rank}, task {procid}: "
                                         f"the plan needs {len(nodes)} nodes with one task each")  # fmt: skip
    master_host = env.get("FB_MASTER_ADDR") or first_host(nodelist)
    # a container resolves names its own way (its /etc/hosts): give it the node's answer
    master = address_of(master_host) if spec.get("container") else master_host
    node = nodes[rank]
    cmd, node_env = resolve(node, spec["master_placeholder"], master)

    runner = Node(spec, rank, master)
    (runner.node_dir / "ranks").mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, runner.on_signal)
    report: dict[str, Any] = {
        "node_rank": rank,
        "slurm_node": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "hostname": socket.gethostname(),
        "job_id": env.get("SLURM_JOB_ID"),
        "step_id": env.get("SLURM_STEP_ID"),
        "master_host": master_host,
        "master_addr": master,
        "command": cmd,
        "image": (spec.get("container") or {}).get("image"),
        "started": time.time(),
    }
    write_report(runner.node_dir, {**report, "returncode": None})
    runner.on_stop = lambda signum: write_report(
        runner.node_dir, {**report, "returncode": None, "stopped_by_signal": signal.Signals(signum).name}
    )
    runner.start_monitor()
    rc: int
    try:
        runner.launch(cmd, node_env, node["cwd"])
        rc = runner.wait() if runner.proc is not None else 128 + (runner.stop_signal or signal.SIGTERM)
    except OSError as exc:
        print(f"flagbench slurm_node: cannot start {cmd[0]}: {exc}", file=sys.stderr, flush=True)
        rc = 127
    finally:
        runner.stop_monitor()
    if rc < 0:  # killed by a signal: the shell convention
        rc = 128 - rc
    write_report(runner.node_dir, {
        **report, "returncode": rc, "finished": time.time(),
        "stopped_by_signal": runner.stop_signal and signal.Signals(runner.stop_signal).name,
    })  # fmt: skip
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
