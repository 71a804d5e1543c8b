"""What a node runs for a round under the SSH runtime (inside the vendor container or not).

    python -m run_benchmarks.node_agent --spec <node round dir>/agent.json --node-rank K --master ADDR

It starts the monitor, runs the node's framework launcher with its output in
``node<k>/stdout.log``, forwards SIGTERM/SIGINT to the launcher's process
group, stops the monitor, writes ``node<k>/node.json`` and exits with the
launcher's status.  The spec has the same shape as the Slurm node wrapper's
(``run_benchmarks.slurm_node``), which shares this machinery; here the node
rank and master come from the command line instead of Slurm's environment.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from run_benchmarks.slurm_node import Node, resolve, write_report


def iface_towards(address: str) -> str | None:
    """The network interface this node uses to reach ``address`` (for gloo's socket choice)."""
    try:
        import psutil

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # no packet is sent for a UDP connect
            local = s.getsockname()[0]
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == local for a in addrs):
                return name
    except (ImportError, OSError):
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run this node's part of a flagbench round")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--master", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    node = spec["nodes"][args.node_rank]
    cmd, env = resolve(node, spec["master_placeholder"], args.master)
    # gloo binds to the address its host name resolves to (often 127.0.0.1 in a container):
    # point it at the interface that reaches the master unless the vendor chose one
    if "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = iface_towards(args.master)
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
    runner = Node(spec, args.node_rank, args.master)
    (runner.node_dir / "ranks").mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, runner.on_signal)
    report: dict[str, Any] = {
        "node_rank": args.node_rank,
        "hostname": socket.gethostname(),
        "master_addr": args.master,
        "command": cmd,
        "started": time.time(),
    }
    write_report(runner.node_dir, {**report, "returncode": None})
    runner.start_monitor()
    try:
        runner.launch(cmd, env, node["cwd"])
        rc = runner.wait() if runner.proc is not None else 128 + (runner.stop_signal or signal.SIGTERM)
    except OSError as exc:
        print(f"flagbench node_agent: cannot start {cmd[0]}: {exc}", file=sys.stderr, flush=True)
        rc = 127
    finally:
        runner.stop_monitor()
    if rc < 0:
        rc = 128 - rc
    write_report(runner.node_dir, {**report, "returncode": rc, "finished": time.time()})
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
