"""What earlier runs left on a host: their containers and processes, found by label and removed.

A host lost mid-run (sshd or the network gone, the engine stopped) keeps what the run had
started there: the harness cannot reach it to clean up. Every container of a run carries
the label ``flagbench.run_id``, and every process a run starts on a host carries the
environment variable ``FLAGBENCH_RUN_ID`` (children inherit it: launcher, ranks, monitor).
Once a run holds the host's lock (``hostlock``), nothing else of flagbench may run there,
so whatever carries another run's id is a leftover: it is removed, and the caller says so
in one line.
"""

from __future__ import annotations

import json
from typing import Any

from .containers import remove_other_runs
from .errors import RemoteError
from .ssh import SSHPool

RUN_MARK = "FLAGBENCH_RUN_ID"
# Kills (SIGKILL) the processes marked with another run's id; prints {run id: [pids]}.
# Only processes in this host's network namespace: hosts that share one kernel (containers
# with their own network, the test cluster's namespace hosts) see each other's /proc.
SWEEP = r"""
import json, os, signal, sys
mark, keep = sys.argv[1].encode() + b"=", sys.argv[2].encode()
me, net = os.getpid(), os.readlink("/proc/self/ns/net")
found = {}
for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
        if pid == me or os.readlink(f"/proc/{pid}/ns/net") != net:
            continue
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        continue
    run = next((e[len(mark):] for e in env if e.startswith(mark)), None)
    if run is not None and run != keep:
        try:
            os.kill(pid, signal.SIGKILL)
            found.setdefault(run.decode(errors="replace"), []).append(pid)
        except OSError:
            pass
print(json.dumps(found))
"""


def kill_processes(pool: SSHPool, host: str, keep_run: str | None, timeout: float) -> dict[str, list[int]]:
    """Kill the host's processes of every run but ``keep_run``: {run id: pids}."""
    res = pool.run(host, ["python3", "-c", SWEEP, RUN_MARK, keep_run or ""], timeout=timeout, check=True)
    found: dict[str, list[int]] = json.loads(res.stdout.strip().splitlines()[-1])
    return found


def sweep_host(pool: SSHPool, host: str, engine: Any, keep_run: str | None, timeout: float) -> str | None:
    """Remove the containers (when ``engine`` is given) and processes of earlier runs on a
    host; one line saying what went, or None when nothing was there."""
    containers = remove_other_runs(engine, keep_run) if engine is not None else {}
    processes = kill_processes(pool, host, keep_run, timeout)
    if not containers and not processes:
        return None
    parts = []
    for run in sorted(set(containers) | set(processes)):
        what = []
        if containers.get(run):
            what.append(f"{len(containers[run])} container(s) {', '.join(sorted(containers[run]))}")
        if processes.get(run):
            what.append(f"{len(processes[run])} process(es)")
        parts.append(f"{' and '.join(what)} of run {run}")
    return f"host {host}: removed what earlier runs left there: {'; '.join(parts)}"


def engine_or_none(connect: Any) -> Any:
    """The host's engine when it answers, else None (a host without docker has no containers to remove)."""
    try:
        return connect()
    except RemoteError:
        return None


__all__ = ["RUN_MARK", "SWEEP", "engine_or_none", "kill_processes", "sweep_host"]
