"""What each node of a Slurm job runs: ``python -m run_benchmarks.running.slurm_node --spec FILE``.

The slurm runtime (``run_benchmarks.running.runtimes.slurm``) writes one spec per round,
``<round_dir>/slurm/spec.json``, holding every node's launcher command as the planner
made it, with the rendezvous master's address left as a placeholder. ``srun`` starts
this module once per allocated node; it

1. picks its node's command by ``SLURM_NODEID`` (node rank k = the k-th node of the
   allocation, the order of ``scontrol show hostnames $SLURM_JOB_NODELIST``),
2. replaces the master placeholder with the address of the allocation's first node:
   Slurm's ``NodeAddr`` for it, else what its name resolves to on this node; when
   neither gives an address it stops with a line saying so (a name that does not
   resolve would have the launcher retry until the deadline),
3. replaces the port placeholder with the rendezvous port: node 0 takes the cluster
   file's ``master_port`` if it is free there, else any free port, and publishes it in
   ``<round_dir>/slurm/rendezvous.json``, which the other nodes wait for (jobs that
   share a node never collide on one fixed port),
4. starts ``python -m run_benchmarks.running.monitors`` in the background, writing
   ``node<k>/monitor.jsonl``,
5. where the run's data is on the nodes only, checks it there (``check_data``: every node's
   fingerprint must be one, else it stops, saying why, before any training),
6. watches the round's lease (``running/lease.py``): when the orchestrator stops renewing
   it (SIGKILLed, its machine lost) or ends it, stops its launcher as scancel would,
7. runs the launcher (a plain process, or ``docker run`` of the vendor image) with its
   output in ``node<k>/stdout.log``, forwarding SIGTERM/SIGINT (scancel, time limit,
   a failed peer under ``srun --kill-on-bad-exit``) to it,
8. stops the monitor, writes ``node<k>/node.json`` (host, master, exit status) and
   exits with the launcher's status, so ``srun`` and the job state carry a failure.

Everything it reads and writes lives in the run directory, which must be on a
filesystem shared by the submit host and all nodes. Standard library only: it runs
under whatever interpreter the site gives the nodes (the data check itself runs with the
framework's Python, or in the vendor's image).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from run_benchmarks.running import lease
from run_benchmarks.running.node_agent import SPEC_VERSION, address_of, container_argv, run_node, write_report

EXIT_NO_SPEC = 97  # the spec is not visible on this node (run dir not shared)
EXIT_BAD_ALLOCATION = 98  # the allocation does not match the plan
EXIT_NO_RENDEZVOUS = 96  # no master address or port (the message says why)
EXIT_BAD_DATA = 95  # the data on a node is missing or bad, or the nodes hold other data (node<k>/data.json)
PORT_WAIT_S = 120.0  # how long the other nodes wait for node 0's port


def fail(code: int, message: str) -> int:
    print(f"flagbench slurm_node on {socket.gethostname()}: {message}", file=sys.stderr, flush=True)
    return code


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``n[1-2]`` -> ``n1``), as scontrol expands it."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True).stdout.split()
    if not out:
        raise ValueError(f"scontrol show hostnames {nodelist!r} printed nothing")
    return out[0]


def master_address(node: str) -> str:
    """The address of Slurm node ``node``: its NodeAddr when that is an address, else what
    the NodeAddr (or name) resolves to here; ValueError with the reason otherwise."""
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=30).stdout
    addr = next((f.split("=", 1)[1] for f in out.split() if f.startswith("NodeAddr=")), node)
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    resolved = address_of(addr)
    if resolved == addr:
        raise ValueError(
            f"the master node {node} (NodeAddr {addr}) has no address on {socket.gethostname()}: "
            "give it a NodeAddr in slurm.conf or make its name resolve on every node"
        )
    return resolved


def free_port(port: int) -> int:
    """``port`` if nothing listens on it here (0: any free port); OSError when taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
        s.bind(("", port))
        return int(s.getsockname()[1])


#: the lock files of the ports this node wrapper holds for its launcher, open while it lives
HELD: list[int] = []


def hold_port(port: int) -> None:
    """Hold ``port`` on this host while this wrapper lives: between the check and torch's bind
    the port itself is free, so a lock file named by it is what a second job's node 0 finds
    taken (OSError EADDRINUSE)."""
    fd = os.open(Path(tempfile.gettempdir()) / f"flagbench-port-{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise OSError(errno.EADDRINUSE, "held by another flagbench job's node 0 on this host") from None
    HELD.append(fd)


def rendezvous_port(spec: dict[str, Any], rank: int, job_id: str) -> int:
    """Node 0 picks the port and publishes it in the shared run dir; the others read it.
    ValueError with the reason when there is none."""
    path = Path(spec["round_dir"]) / "slurm" / "rendezvous.json"
    if rank == 0:
        try:
            port = free_port(spec.get("master_port") or 0)
            hold_port(port)
            info: dict[str, Any] = {"job_id": job_id, "port": port}
        except OSError as exc:
            info = {
                "job_id": job_id,
                "error": f"master_port {spec.get('master_port')} of the cluster file is in use on "
                f"{socket.gethostname()} ({exc.strerror}); leave it out to use a free port",
            }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)
    else:
        end = time.monotonic() + PORT_WAIT_S
        while True:
            try:
                info = json.loads(path.read_text())
                if info.get("job_id") == job_id:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > end:
                raise ValueError(f"node 0 published no rendezvous port in {path} within {PORT_WAIT_S:.0f} s")
            time.sleep(0.2)
    if "error" in info:
        raise ValueError(info["error"])
    return int(info["port"])


def check_data(spec: dict[str, Any], rank: int, job_id: str, name: str) -> str | None:
    """The data on the hosts only, checked on this node before its launcher starts
    (planning/hostdata.py's node side, in the vendor image where the round runs in one): its
    answer written to ``node<k>/data.json`` in the shared run dir, then every node's read.
    None when every node found the same data; else the one line that says what is wrong."""
    from run_benchmarks.errors import InputError
    from run_benchmarks.planning import hostdata

    check = spec["data_check"]
    argv = list(check["argv"])
    if spec.get("container"):
        argv = container_argv(spec["container"], f"fb-{job_id}-data{rank}", check["env"], check["cwd"], argv)
    try:
        proc = subprocess.run(
            argv, env={**os.environ, **check["env"]}, cwd=check["cwd"], capture_output=True, text=True, timeout=check["timeout_s"]
        )
        said = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-4000:]}
    except (OSError, subprocess.TimeoutExpired) as exc:
        said = {"rc": -1, "stdout": "", "stderr": str(exc)}
    round_dir = Path(spec["round_dir"])
    mine = round_dir / f"node{rank}" / "data.json"
    mine.parent.mkdir(parents=True, exist_ok=True)
    tmp = mine.with_suffix(".tmp")
    tmp.write_text(json.dumps({"job_id": job_id, "node": name, **said}))
    os.replace(tmp, mine)
    end = time.monotonic() + float(check["timeout_s"])
    reports = []
    for k in range(len(spec["nodes"])):
        while True:
            try:
                theirs = json.loads((round_dir / f"node{k}" / "data.json").read_text())
                if theirs.get("job_id") == job_id:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > end:
                return f"node {k} wrote no data check to {round_dir / f'node{k}' / 'data.json'} within {check['timeout_s']:g} s"
            time.sleep(0.2)
        try:
            reports.append((theirs["node"], hostdata.report(theirs["node"], theirs["rc"], theirs["stdout"], theirs["stderr"])))
        except InputError as exc:
            return str(exc)
    return hostdata.disagreement(reports, check.get("found"))


def fill_port(node: dict[str, Any], placeholder: str, port: int) -> dict[str, Any]:
    p = str(port)
    return {
        **node,
        "command": [a.replace(placeholder, p) for a in node["command"]],
        "env": {k: v.replace(placeholder, p) for k, v in node["env"].items()},
        "leftovers": [g.replace(placeholder, p) for g in node.get("leftovers", [])],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run this Slurm node's part of a flagbench round")
    ap.add_argument("--spec", required=True, help="the round's spec.json, written by the slurm runtime")
    args = ap.parse_args(argv)
    spec_path = Path(args.spec)
    try:
        spec = json.loads(spec_path.read_text())
    except FileNotFoundError:
        return fail(
            EXIT_NO_SPEC,
            f"{spec_path} is not visible on this node: the run directory must be on a filesystem shared by the submit host and every node",
        )
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
        return fail(
            EXIT_BAD_ALLOCATION,
            f"allocation of {nnodes} node(s), node id {rank}, task {procid}: the plan needs {len(nodes)} nodes with one task each",
        )
    lapsed: list[str] = []
    if spec.get("lease"):

        def on_lapse(why: str) -> None:
            lapsed.append(why)
            print(f"flagbench slurm_node on {socket.gethostname()}: {why}; stopping the ranks", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # as scancel: the launcher stopped, the report written

        lease.watch(Path(spec["lease"]["path"]), float(spec["lease"]["lease_s"]), on_lapse)
    master_host = first_host(nodelist)
    job_id = env.get("SLURM_JOB_ID", "")
    try:
        # an address, not a name: other nodes and containers need not resolve node names
        master = env.get("FB_MASTER_ADDR") or master_address(master_host)
        if spec.get("port_placeholder"):
            port = rendezvous_port(spec, rank, job_id)
            spec["nodes"] = [fill_port(n, spec["port_placeholder"], port) for n in nodes]
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        node_dir = Path(spec["round_dir"]) / f"node{rank}"
        node_dir.mkdir(parents=True, exist_ok=True)  # the report carries the reason to the harness
        write_report(
            node_dir,
            {
                "node_rank": rank,
                "slurm_node": env.get("SLURMD_NODENAME") or socket.gethostname(),
                "job_id": job_id,
                "returncode": EXIT_NO_RENDEZVOUS,
                "error": str(exc),
            },
        )
        return fail(EXIT_NO_RENDEZVOUS, str(exc))
    name = env.get("SLURMD_NODENAME") or socket.gethostname()
    if spec.get("data_check"):
        why = check_data(spec, rank, job_id, name)
        if why:
            bad = {"node_rank": rank, "slurm_node": name, "job_id": job_id, "returncode": EXIT_BAD_DATA, "error": why}
            write_report(Path(spec["round_dir"]) / f"node{rank}", bad)
            return fail(EXIT_BAD_DATA, why)
    report: dict[str, Any] = {
        "slurm_node": name,
        "job_id": env.get("SLURM_JOB_ID"),
        "step_id": env.get("SLURM_STEP_ID"),
        "master_host": master_host,
    }
    rc = run_node(spec, rank, master, report, container_name=f"fb-{env.get('SLURM_JOB_ID', 'job')}-node{rank}")
    node_dir = Path(spec["round_dir"]) / f"node{rank}"
    try:
        said = json.loads((node_dir / "node.json").read_text())
    except (OSError, ValueError):
        return rc
    if lapsed:  # why the launcher was stopped, for the harness's --cleanup
        write_report(node_dir, {**said, "lease_lapsed": lapsed[0]})
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
