"""The local runtime (the embedded default): this host, no SSH, no container.

Runs each node's launcher command as a child process group, streams its
output into ``node<k>/stdout.log``, waits on the real exit with a deadline,
and kills the whole group on timeout, failure of a peer or Ctrl-C.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from run_benchmarks.errors import InputError
from run_benchmarks.planning.config import ClusterConfig
from run_benchmarks.planning.envs import env_dir, framework_python, python_of
from run_benchmarks.planning.plan import Plan, RoundPlan
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running.monitors import MonitorThread
from run_benchmarks.running.node_agent import descendants, kill_all, remove_leftovers
from run_benchmarks.running.runtimes.base import NodeOutcome, Runtime
from run_benchmarks.running.watcher import LOCAL_MARK

KILL_GRACE_S = 10.0
WAIT_POLL_S = 2.0  # how often a run that waits for a busy host (--wait) tries again


class HostBusy(InputError):
    """Another run holds this host or one of its devices."""

    refused = True  # the run did not start: its status is "refused", not "failed" (typed_results.run_outcome)


def lock_file(name: str = "local") -> Path:
    """This host's run lock (``local``) or one device's (``local.device<i>``); FLAGBENCH_LOCK_DIR
    moves them (a test session's runs lock among themselves, not against a benchmark running on
    the same machine)."""
    folder = os.environ.get("FLAGBENCH_LOCK_DIR") or str(Path.home() / ".cache" / "flagbench" / "locks")
    return Path(folder) / f"{name}.lock"


def claimed_devices(var: str | None) -> list[int] | None:
    """The device indices a run claims by naming them in the vendor's visible-devices variable
    (``CUDA_VISIBLE_DEVICES=2,3``) in this process's environment; None (the whole host) when the
    variable is unset, empty, or names devices by UUID."""
    value = os.environ.get(var) if var else None
    if not value or not value.strip():
        return None
    try:
        return sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        return None


def _flock(path: Path, mode: int) -> IO[str] | None:
    """``path`` opened and flocked with ``mode`` (never waiting); None when another run holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    return fh


def _sign(fh: IO[str], stamp: str) -> None:
    """Write the holding run into a lock file just taken (what a refused run is told)."""
    fh.seek(0)
    fh.truncate()
    fh.write(stamp + "\n")
    fh.flush()


def _holder(path: Path) -> str:
    with open(path) as fh:
        return fh.read().strip() or "another run"


def _device_holders(folder: Path, skip: frozenset[str] = frozenset()) -> list[str]:
    """The runs holding device locks now, each with its devices (a lock file left by an ended run
    is free, not listed), but for the lock files named in ``skip`` (this run's own)."""
    held: dict[str, list[int]] = {}
    found = ((int(m[1]), p) for p in folder.glob("local.device*.lock") if (m := re.fullmatch(r"local\.device(\d+)\.lock", p.name)))
    for device, path in sorted(found):
        if path.name in skip:
            continue
        fh = _flock(path, fcntl.LOCK_EX)
        if fh is None:
            held.setdefault(_holder(path), []).append(device)
        else:
            fh.close()
    return [f"{who} on device{'s' if len(ds) > 1 else ''} {', '.join(map(str, ds))}" for who, ds in held.items()]


def kill_group(proc: subprocess.Popen[bytes], grace: float = KILL_GRACE_S) -> None:
    """Stop a process started in its own session and everything in its group: SIGTERM, then
    SIGKILL after ``grace`` seconds; and every process below it when the stop began, which
    the launcher put in sessions of their own (torchrun's ranks): one that does not go with
    the launcher (a stopped rank) gets SIGKILL once the launcher is gone."""
    if proc.poll() is not None:
        return
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    kill_all(below)


class LocalRuntime(Runtime):
    name = "local"

    def __init__(self, cluster: ClusterConfig | None = None, python: str | None = None) -> None:
        self.python_override = python or (cluster.python if cluster else None)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.locks: list[IO[str]] = []  # the host's flock, and each claimed device's
        self.devices: list[int] | None = None  # the devices claimed; None: the whole host
        self.beside: set[str] = set()  # runs seen holding other devices of this host meanwhile
        self.watcher: subprocess.Popen[bytes] | None = None  # ends the ranks if this process dies

    def _wait_for_lock(self, plan: Plan, wait_s: float) -> None:
        """``_take_lock``, tried again every few seconds for up to ``wait_s`` (--wait) while
        another run holds the host or a device; the holder said once."""
        end, said = time.monotonic() + wait_s, None
        while True:
            try:
                return self._take_lock(plan)
            except HostBusy as exc:
                left = end - time.monotonic()
                if wait_s <= 0:
                    raise
                if left <= 0:
                    raise HostBusy(f"{exc} (still, after waiting {wait_s:g}s: --wait)") from None
                if str(exc) != said:
                    said = str(exc)
                    print(f"waiting: {exc}; up to {left:.0f}s more", file=sys.stderr, flush=True)
                time.sleep(min(WAIT_POLL_S, left))

    def _take_lock(self, plan: Plan) -> None:
        """One run at a time on this host (two would share its devices and skew both): an
        exclusive flock, released by ``cleanup`` or by the kernel when the process ends, so a
        killed run never leaves it behind. A second run is refused with the holder's run.

        A run that names its devices in the vendor's visible-devices variable (for example
        ``CUDA_VISIBLE_DEVICES=2,3``) claims only those: the host lock shared, an exclusive lock
        for each device. Runs on disjoint devices then go side by side (they still share the
        host's CPUs, memory and links); a run on a device in use, or one that takes the whole
        host, is refused with the holder."""
        devices = claimed_devices(plan.vendor.visible_devices_env)
        host = lock_file()
        stamp = f"run {plan.run_id} (pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')})"
        if devices is None:
            fh = _flock(host, fcntl.LOCK_EX)
            if fh is None:
                held = _device_holders(host.parent) or [_holder(host)]
                raise HostBusy(
                    f"this host is busy: {'; '.join(held)} holds {host}; one run at a time per host (wait for it to finish, or stop it)"
                )
            _sign(fh, stamp)
            self.locks = [fh]
            return
        shared = _flock(host, fcntl.LOCK_SH)
        if shared is None:  # a run holding the whole host
            raise HostBusy(
                f"this host is busy: {_holder(host)} holds {host} for the whole host; "
                "one run at a time per host (wait for it to finish, or stop it)"
            )
        self.locks = [shared]
        var = plan.vendor.visible_devices_env
        for d in devices:
            path = lock_file(f"local.device{d}")
            fh = _flock(path, fcntl.LOCK_EX)
            if fh is None:
                holder = _holder(path)
                self.cleanup()
                raise HostBusy(
                    f"device {d} of this host is busy: {holder} holds {path}; one run at a time per device "
                    f"({var}={os.environ.get(var)} names the devices this run takes; wait, or choose others)"
                )
            _sign(fh, stamp)
            self.locks.append(fh)
        self.devices = devices
        self.describe()  # the runs already beside it

    def describe(self) -> dict[str, Any]:
        """For results.json: the devices a run claimed and every run seen holding other devices of
        this host beside it (looked up when the run starts, after each round and at the end), so
        a figure measured beside another benchmark says so."""
        if self.devices is None:
            return {}
        if self.locks:
            own = frozenset(lock_file(f"local.device{d}").name for d in self.devices)
            self.beside.update(_device_holders(lock_file().parent, own))
        return {"devices_claimed": self.devices, "runs_beside": sorted(self.beside)}

    def _start_watcher(self, run_id: str) -> None:
        """The run's watcher (running/watcher.py), in a session of its own, its input a pipe
        from this process: when this process dies (SIGKILL included) the kernel closes the
        pipe, and the watcher kills the run's ranks (their environment carries the run's mark)."""
        argv = [sys.executable, "-m", "run_benchmarks.running.watcher", "--run-id", run_id, "--silence", "0", "--mark", LOCAL_MARK]
        env = {k: v for k, v in os.environ.items() if k != LOCAL_MARK}
        self.watcher = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def _stop_watcher(self) -> None:
        watcher, self.watcher = self.watcher, None
        if watcher is None:
            return
        assert watcher.stdin is not None
        watcher.stdin.close()
        try:
            watcher.wait(10)
        except subprocess.TimeoutExpired:
            watcher.kill()
            watcher.wait()

    def dry_prepare(self, plan: Plan) -> tuple[str, Path]:
        if self.python_override:
            return self.python_override, ROOT
        return str(python_of(env_dir(plan.vendor.name, plan.case.framework))), ROOT

    def prepare(self, plan: Plan, log: Path) -> tuple[str, Path]:
        self._wait_for_lock(plan, plan.cluster.lock_wait_s)
        self._start_watcher(plan.run_id)
        py = framework_python(plan.vendor.name, plan.case.framework, self.python_override, log)
        return str(py), ROOT

    def run_round(self, plan: Plan, rnd: RoundPlan, timeout_s: float) -> list[NodeOutcome]:
        round_dir, nodes = rnd.dir, list(rnd.nodes)
        started = time.monotonic()
        self.aborted = None
        outcomes: list[NodeOutcome] = []
        monitors = []
        files = []
        launched: list[float] = []
        exited: dict[int, float] = {}
        try:
            for node in nodes:
                node_dir = round_dir / f"node{node.node_rank}"
                (node_dir / "ranks").mkdir(parents=True, exist_ok=True)
                out = open(node_dir / "stdout.log", "wb")
                files.append(out)
                env = {**os.environ, **node.env, LOCAL_MARK: plan.run_id}  # the mark the run's watcher knows them by
                if os.environ.get("PYTHONPATH"):  # keep what this host's Python needs (e.g. carried packages)
                    env["PYTHONPATH"] = f"{node.env['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
                proc = subprocess.Popen(
                    node.command,
                    cwd=node.cwd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                self.procs.append(proc)
                launched.append(time.time())
                mon = MonitorThread(plan.vendor.monitor, node_dir / "monitor.jsonl")
                mon.start()
                monitors.append(mon)
            deadline = started + timeout_s
            pending = dict(enumerate(self.procs))
            rcs: dict[int, int | None] = {}
            timed_out = False
            while pending:
                for i, proc in list(pending.items()):
                    try:
                        rcs[i] = proc.wait(timeout=0.2)
                        exited[i] = time.time()
                        del pending[i]
                        if rcs[i] != 0:  # a failed node fails the round: stop its peers
                            for other in pending.values():
                                kill_group(other)
                    except subprocess.TimeoutExpired:
                        pass
                if time.monotonic() > deadline or self.aborted:
                    timed_out = not self.aborted
                    for i, proc in pending.items():
                        kill_group(proc)
                        rcs[i] = None
                    break
            for i, node in enumerate(nodes):
                stopped = rcs.get(i) is None
                outcomes.append(
                    NodeOutcome(
                        node.host,
                        node.node_rank,
                        rcs.get(i),
                        timed_out and stopped,
                        round_dir / f"node{node.node_rank}",
                        error=self.aborted if stopped else None,
                        extra={"launched_at": launched[i], "exited_at": exited.get(i)},
                    )
                )
        finally:
            for proc in self.procs:
                kill_group(proc)
            self.procs.clear()
            for node in nodes:
                remove_leftovers(node.leftovers)
            for mon in monitors:
                mon.stop()
            for fh in files:
                fh.close()
        return outcomes

    def left_behind(self) -> list[str]:
        pids = [str(p.pid) for p in self.procs if p.poll() is None]
        return [f"this host: the round's process groups {', '.join(pids)}"] if pids else []

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_group(proc, grace=2.0)
        self.procs.clear()
        self._stop_watcher()
        for fh in self.locks:
            fh.close()  # releases its flock
        self.locks = []
