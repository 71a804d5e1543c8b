"""What ends a run's ranks on a node when the orchestrator that started them is gone.

    python3 -m run_benchmarks.running.watcher --run-id RUN [--silence S] [--mark VAR] [--containers]

The orchestrator starts one watcher per host and run, beside the ranks (over an SSH channel
of the run's connection; for the local runtime, as a child of its own session), and holds
its standard input: it writes a byte there every ``HEARTBEAT_S`` seconds. The watcher ends
the run on the node when that input ends (the orchestrator killed: its end of the channel
or pipe is closed by the kernel) or stays silent for ``--silence`` seconds (its machine or
the network to it lost): every process of this network namespace carrying
``FLAGBENCH_RUN_ID=RUN`` gets SIGKILL, and with ``--containers`` every container labelled
``flagbench.run_id=RUN`` is removed (``docker rm -f``). A run that ends as planned closes
the input after its own cleanup, so the watcher then finds nothing and exits.
Standard library only: it runs on the host's ``python3``.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

RUN_MARK = "FLAGBENCH_RUN_ID"
#: the local runtime's mark: a run of the SSH runtime on this same host, which removes what
#: carries another run's RUN_MARK (remote.leftovers), leaves a local run alone
LOCAL_MARK = "FLAGBENCH_LOCAL_RUN_ID"
RUN_LABEL = "flagbench.run_id"
HEARTBEAT_S = 2.0  # how often the orchestrator writes to a watcher's input
DOCKER_TIMEOUT_S = 60.0


def marked_processes(run_id: str, mark_name: str = RUN_MARK) -> list[int]:
    """The processes of this network namespace whose environment carries the run's mark."""
    mark, me = f"{mark_name}={run_id}".encode(), os.getpid()
    net = os.readlink("/proc/self/ns/net")
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if pid == me or os.readlink(f"/proc/{pid}/ns/net") != net:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if mark in fh.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def end_run(run_id: str, containers: bool, mark_name: str = RUN_MARK) -> list[str]:
    """SIGKILL the run's processes here, remove its containers; what was ended."""
    said = []
    if containers:
        try:
            ls = ["docker", "ps", "-aq", "--filter", f"label={RUN_LABEL}={run_id}"]
            ids = subprocess.run(ls, capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S).stdout.split()
            if ids:
                subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=DOCKER_TIMEOUT_S)
                said.append(f"{len(ids)} container(s)")
        except (OSError, subprocess.TimeoutExpired) as exc:
            said.append(f"containers not removed: {exc}")
    pids = marked_processes(run_id, mark_name)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if pids:
        said.append(f"{len(pids)} process(es)")
    return said


def watch(fd: int, silence_s: float) -> str:
    """Read ``fd`` until it ends or is silent for ``silence_s``; which of the two."""
    last = time.monotonic()
    while True:
        left = last + silence_s - time.monotonic() if silence_s > 0 else None
        if left is not None and left <= 0:
            return f"no word from the orchestrator for {silence_s:g} s"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:
                return "the orchestrator's end closed"
            last = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="end a flagbench run's ranks here once its orchestrator is gone")
    ap.add_argument("--run-id", required=True)
    ap.add_argument(
        "--silence",
        type=float,
        default=30.0,
        help="seconds without a heartbeat that mean the orchestrator is gone (0: only the input's end does)",
    )
    ap.add_argument("--mark", default=RUN_MARK, help=f"the environment variable the run's processes carry (default {RUN_MARK})")
    ap.add_argument("--containers", action="store_true", help="remove the run's containers too (docker rm -f)")
    args = ap.parse_args(argv)
    for sig in (signal.SIGHUP, signal.SIGPIPE):  # the session's end is read from the input, not from a signal
        signal.signal(sig, signal.SIG_IGN)
    why = watch(sys.stdin.fileno(), args.silence)
    ended = end_run(args.run_id, args.containers, args.mark)
    print(f"flagbench watcher: {why}: ended {', '.join(ended) or 'nothing (none left)'} of run {args.run_id}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
