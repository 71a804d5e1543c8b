"""What a node runs for a round under the SSH runtime (inside the vendor container or not).

    python -m run_benchmarks.running.node_agent --spec <node round dir>/agent.json --node-rank K --master ADDR

It starts the monitor, runs the node's framework launcher with its output in
``node<k>/stdout.log``, forwards SIGTERM/SIGINT to the launcher's process
group, stops the monitor, writes ``node<k>/node.json`` and exits with the
launcher's status.  The spec has the same shape as the Slurm node wrapper's
(``run_benchmarks.running.slurm_node``), which calls into this module; here the node
rank and master come from the command line instead of Slurm's environment.
Standard library only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from run_benchmarks.planning.launchers import NODE_ADDR
from run_benchmarks.running import progress  # standard library only, as is everything here

SPEC_VERSION = 1
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL; below Slurm's KillWait (30 s by default)


def agent_spec(
    round_dir: str, master_placeholder: str, monitor: dict[str, Any], container: dict[str, Any] | None, nodes: list[Any], **extra: Any
) -> dict[str, Any]:
    """What a node agent reads (``--spec``), built here for both runtimes that start one (SSH,
    Slurm): ``nodes`` are the planner's NodePlans (node_rank, command, env, cwd); ``extra`` the
    Slurm wrapper's rendezvous fields."""
    return {
        "version": SPEC_VERSION,
        "round_dir": round_dir,
        "master_placeholder": master_placeholder,
        "monitor": monitor,
        "container": container,
        "nodes": [{"node_rank": n.node_rank, "command": n.command, "env": n.env, "cwd": n.cwd, "leftovers": n.leftovers} for n in nodes],
        **extra,
    }


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


def remove_leftovers(patterns: list[str]) -> list[str]:
    """Delete the files matching the launcher's leftover patterns (see Launcher.leftovers);
    the paths removed."""
    removed = []
    for pattern in patterns:
        for path in glob.glob(pattern):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def container_argv(container: dict[str, Any], name: str, env: dict[str, str], cwd: str, argv: list[str]) -> list[str]:
    """``docker run`` of the vendor image around the launcher argv."""
    out = ["docker", "run", "--rm", "--name", name, "--workdir", cwd, *container["options"]]
    for k, v in sorted(env.items()):
        out += ["--env", f"{k}={v}"]
    return out + [container["image"], *argv]


class Node:
    def __init__(self, spec: dict[str, Any], rank: int, master: str, container_name: str | None = None) -> None:
        self.spec, self.rank, self.master = spec, rank, master
        self.default_container_name = container_name or f"fb-node{rank}"
        self.node_dir = Path(spec["round_dir"]) / f"node{rank}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.monitor: subprocess.Popen[bytes] | None = None
        self.container_name: str | None = None
        self.stop_signal: int | None = None
        self.stop_deadline: float | None = None
        self.below: list[tuple[int, int]] = []  # the launcher's descendants when it was stopped
        self.on_stop: Callable[[int], None] | None = None  # called once, on the first stop signal
        self._lock = threading.Lock()

    def start_monitor(self) -> None:
        mon = self.spec["monitor"]
        log = open(self.node_dir / "monitor.log", "ab")
        try:
            self.monitor = subprocess.Popen(
                [
                    mon["python"],
                    "-m",
                    "run_benchmarks.running.monitors",
                    "--kind",
                    mon["kind"],
                    "--out",
                    str(self.node_dir / "monitor.jsonl"),
                    "--interval",
                    str(mon["interval_s"]),
                ],
                env={**os.environ, "PYTHONPATH": mon["pythonpath"]},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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
            self.container_name = self.default_container_name
            argv = container_argv(container, self.container_name, env, cwd, argv)
            full_env = dict(os.environ)
        else:
            full_env = {**os.environ, **env}
        with open(self.node_dir / "stdout.log", "ab") as out, self._lock:
            if self.stop_signal is not None:
                return  # stopped before it started
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

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
        if first and proc is not None and proc.poll() is None:
            self.below = descendants(proc.pid)
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
        kill_all(self.below)  # the ranks in sessions of their own, taken when the stop began (on_signal)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, from /proc; None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """Every process below ``pid`` now, as (pid, start time). Launchers start their ranks in
    sessions of their own (torchrun does), out of reach of a signal to the launcher's group:
    taken while the launcher lives, this list still finds them once it is gone."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry), st[1]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def kill_all(procs: list[tuple[int, int]]) -> None:
    """SIGKILL each (pid, start time) still running as that same process (a pid taken by a
    newer process is left alone). A stopped process (SIGSTOP) dies of it too."""
    for pid, start in procs:
        st = _stat(pid)
        if st is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


#: what Debian-based images set when their Dockerfile sets no PATH
IMAGE_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_path(image: str) -> str:
    """The PATH an image's containers start with (its ``Config.Env``), else Debian's default."""
    try:
        out = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{json .Config.Env}}", image], capture_output=True, text=True, timeout=60
        )
        env = json.loads(out.stdout) if out.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        env = []
    return next((e.split("=", 1)[1] for e in env or [] if e.startswith("PATH=")), IMAGE_DEFAULT_PATH)


def write_report(node_dir: Path, report: dict[str, Any]) -> None:
    tmp = node_dir / "node.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, node_dir / "node.json")


def address_towards(address: str) -> str | None:
    """This node's own address on the route to ``address`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def iface_towards(address: str) -> str | None:
    """The network interface this node uses to reach ``address`` (for gloo's socket choice)."""
    local = address_towards(address)
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def run_node(spec: dict[str, Any], rank: int, master: str, report: dict[str, Any], container_name: str | None = None) -> int:
    """Run node ``rank`` of the spec: monitor, launcher, report; the launcher's exit status."""
    node = spec["nodes"][rank]
    cmd, env = resolve(node, spec["master_placeholder"], master)
    own = address_towards(master) or socket.gethostname()
    cmd, env = [a.replace(NODE_ADDR, own) for a in cmd], {k: v.replace(NODE_ADDR, own) for k, v in env.items()}
    # gloo binds to the address its host name resolves to (often 127.0.0.1 in a container):
    # point it at the interface that reaches the master unless the vendor chose one
    if "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = iface_towards(master)
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
    # the framework environment's tools (ninja for DeepSpeed's JIT-built ops, console scripts)
    # on PATH, as in an activated environment; in front of the image's own PATH for docker run
    if os.path.isabs(cmd[0]):
        image = (spec.get("container") or {}).get("image")
        base = image_path(image) if image else env.get("PATH") or os.environ.get("PATH", os.defpath)
        env["PATH"] = os.pathsep.join([os.path.dirname(cmd[0]), base])
    runner = Node(spec, rank, master, container_name)
    (runner.node_dir / "ranks").mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, runner.on_signal)
    report = {
        **report,
        "node_rank": rank,
        "hostname": socket.gethostname(),
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
    live = progress.writer(runner.node_dir)  # the newest step, for the harness's progress line
    live.start()
    rc: int
    try:
        runner.launch(cmd, env, node["cwd"])
        rc = runner.wait() if runner.proc is not None else 128 + (runner.stop_signal or signal.SIGTERM)
    except OSError as exc:
        print(f"flagbench node agent: cannot start {cmd[0]}: {exc}", file=sys.stderr, flush=True)
        rc = 127
    finally:
        live.stop()
        runner.stop_monitor()
        report["leftovers_removed"] = remove_leftovers(node.get("leftovers", []))
    if rc < 0:  # killed by a signal: the shell convention
        rc = 128 - rc
    write_report(
        runner.node_dir,
        {
            **report,
            "returncode": rc,
            "finished": time.time(),
            "stopped_by_signal": runner.stop_signal and signal.Signals(runner.stop_signal).name,
        },
    )
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run this node's part of a flagbench round")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--master", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    return run_node(spec, args.node_rank, args.master, {})


if __name__ == "__main__":
    raise SystemExit(main())
