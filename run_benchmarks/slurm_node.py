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
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from run_benchmarks.node_agent import SPEC_VERSION, address_of, run_node

EXIT_NO_SPEC = 97  # the spec is not visible on this node (run dir not shared)
EXIT_BAD_ALLOCATION = 98  # the allocation does not match the plan


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
    report: dict[str, Any] = {
        "slurm_node": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "job_id": env.get("SLURM_JOB_ID"),
        "step_id": env.get("SLURM_STEP_ID"),
        "master_host": master_host,
    }
    return run_node(spec, rank, master, report, container_name=f"fb-{env.get('SLURM_JOB_ID', 'job')}-node{rank}")


if __name__ == "__main__":
    raise SystemExit(main())
