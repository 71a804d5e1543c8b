"""A real Slurm cluster on this machine: munged, slurmctld and two slurmd nodes.

Every piece of state (config, munge key and socket, spool, logs, pid files) lives in
one temporary directory. Each ``slurmd`` runs in its own UTS and mount namespace with
its own hostname (``n1``, ``n2``) and a private ``/etc/hosts``: n1's maps both node names
(to 127.0.0.2 and 127.0.0.3); n2's knows only itself, as on sites where node names
resolve on the controller alone, so a run must take n1's address from Slurm (NodeAddr).
The nodes share this machine's filesystem (the shared-filesystem assumption of the slurm
backend holds trivially) and its network namespace.

Everything started here is stopped by PID in ``stop()``; nothing is left behind. Client
commands (sbatch, squeue, ...) find the cluster through ``SLURM_CONF`` (``env()``).

Run ``python -m tests.slurm.cluster`` to start one by hand; Ctrl-C stops it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from run_benchmarks.running.runtimes.local import kill_group

NODES = (("n1", "127.0.0.2"), ("n2", "127.0.0.3"))
KNOWN_NAMES = {"n1": ("n1", "n2"), "n2": ("n2",)}  # the node names each node's /etc/hosts maps
CPUS_PER_NODE = 2
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "unshare")


class ClusterError(RuntimeError):
    pass


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class SlurmTestCluster:
    """Start with ``start()`` (or ``with SlurmTestCluster() as c:``), stop with ``stop()``."""

    def __init__(self, base: Path | None = None, cpus_per_node: int = CPUS_PER_NODE) -> None:
        self._own_base = base is None
        self.base = Path(base or tempfile.mkdtemp(prefix="fb-slurm-"))
        self.cpus = cpus_per_node
        self.conf = self.base / "etc" / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.timings: dict[str, float] = {}
        self.nodes = [name for name, _ in NODES]
        self.node_namespaces: dict[str, str] = {}  # node name -> its UTS namespace
        self.retired_namespaces: set[str] = set()  # of slurmd processes killed and started again
        # an open descriptor of each namespace noted above keeps it alive, so the kernel cannot
        # give its inode number to a new namespace (another test's container) while it is
        # matched by node_processes, which SIGKILLs what it finds
        self._pins: dict[str, int] = {}

    # ------------------------------------------------------------------ config

    def env(self) -> dict[str, str]:
        """The environment client commands need to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        b = self.base
        for sub in ("etc", "munge", "state", "spool", "run", "log"):
            (b / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o700)
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={name} NodeAddr={addr} Port={port} CPUs={self.cpus} State=UNKNOWN"
            for (name, addr), port in zip(NODES, node_ports)
        )
        self.conf.write_text(
            f"""\
ClusterName=fbtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
# a batch job is scheduled when it is submitted, not up to 3 s later (Slurm's default)
SchedulerParameters=batch_sched_delay=0
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        for node in self.nodes:
            known = "".join(f"{addr} {name}\n" for name, addr in NODES if name in KNOWN_NAMES[node])
            (b / "etc" / f"hosts-{node}").write_text("127.0.0.1 localhost\n" + known)

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "ab")
        try:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        finally:
            log.close()

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                out = (self.base / "log" / f"{name}.out").read_text(errors="replace")[-2000:]
                raise ClusterError(f"{name} exited with status {proc.returncode}:\n{out}")

    def _wait(self, what: str, ready, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if ready():
                return
            time.sleep(0.1)
        raise ClusterError(f"{what} not ready after {timeout:.0f} s; logs in {self.base / 'log'}")

    def _scontrol(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=20)

    def _nodes_idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True, text=True, timeout=20
        ).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    def start(self) -> SlurmTestCluster:
        missing = missing_programs()
        if missing:
            raise ClusterError(f"missing {', '.join(missing)}: run tests/install_system_deps.sh")
        t0 = time.monotonic()
        self._write_config()
        key = self.base / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self._spawn_munged()
        self._wait("munged", self.munge_socket.exists)
        self.timings["munge_s"] = time.monotonic() - t0
        try:
            t1 = time.monotonic()
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            self._wait("slurmctld", lambda: self._scontrol("ping").returncode == 0)
            self.timings["slurmctld_s"] = time.monotonic() - t1
            t2 = time.monotonic()
            for name, _ in NODES:
                self._spawn_node(name)
            self._wait("nodes idle", self._nodes_idle)
            self._note_namespaces()
            self.timings["nodes_idle_s"] = time.monotonic() - t2
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def _spawn_munged(self) -> None:
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={self.base / 'munge' / 'munge.key'}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.base / 'run' / 'munged.pid'}",
                f"--seed-file={self.base / 'munge' / 'seed'}",
                f"--log-file={self.base / 'log' / 'munged.log'}",
            ],
        )

    def kill_munge(self) -> None:
        """SIGKILL munged: every Slurm message (the clients', the daemons') fails to authenticate."""
        proc = self.procs.pop("munged")
        proc.kill()
        proc.wait()

    def restart_munge(self) -> None:
        """Start munged again (if killed) and wait until the controller answers through it."""
        if "munged" not in self.procs:
            self._spawn_munged()
        self._wait("munged and slurmctld", lambda: self._scontrol("ping").returncode == 0)

    def _spawn_node(self, name: str) -> None:
        hosts = self.base / "etc" / f"hosts-{name}"
        script = 'mount --bind "$1" /etc/hosts && hostname "$2" && exec slurmd -D -N "$2" -f "$3"'
        self._spawn(
            f"slurmd-{name}",
            [
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "slurmd-node",
                str(hosts),
                name,
                str(self.conf),
            ],
        )

    def _note_namespaces(self) -> None:
        """Each node's UTS namespace, read once its slurmd runs (before, unshare may not have made it)."""
        for n, proc in self.procs.items():
            if n.startswith("slurmd-"):
                ns = os.readlink(f"/proc/{proc.pid}/ns/uts")
                if ns == os.readlink("/proc/self/ns/uts"):
                    raise ClusterError(f"{n} runs in this machine's UTS namespace")
                if ns not in self._pins:
                    fd = os.open(f"/proc/{proc.pid}/ns/uts", os.O_RDONLY)
                    if os.readlink(f"/proc/self/fd/{fd}") != ns:  # slurmd was replaced in between
                        os.close(fd)
                        raise ClusterError(f"{n}: its UTS namespace changed while it was noted")
                    self._pins[ns] = fd
                self.node_namespaces[n.removeprefix("slurmd-")] = ns

    def kill_node(self, name: str) -> None:
        """SIGKILL a node's slurmd, as a crash would. Its namespace is kept in
        ``retired_namespaces`` so that ``node_processes`` still finds what ran there."""
        proc = self.procs.pop(f"slurmd-{name}")
        proc.kill()
        proc.wait()
        self.retired_namespaces.add(self.node_namespaces.pop(name))

    def restart_node(self, name: str) -> None:
        """Start a killed node's slurmd again and wait until every node is idle.

        A job that ran on the node while its slurmd was down stays COMPLETING there until
        the controller sends its terminate request again (every 30 s or so); the node is
        set down and resumed, as an administrator would, which ends that at once."""
        self._spawn_node(name)
        pid, own = self.procs[f"slurmd-{name}"].pid, os.readlink("/proc/self/ns/uts")
        self._wait(
            f"slurmd of {name}", lambda: os.readlink(f"/proc/{pid}/ns/uts") != own and "slurmd" in Path(f"/proc/{pid}/comm").read_text()
        )
        for state in (["State=DOWN", "Reason=slurmd restarted"], ["State=RESUME"]):
            done = self._scontrol("update", f"NodeName={name}", *state)
            # ReturnToService=2: the slurmd's registration, when it comes after the DOWN, puts the
            # node back in service itself, and a RESUME of a node in service is refused so
            back = state == ["State=RESUME"] and "Invalid node state specified" in done.stderr
            if done.returncode != 0 and not back:
                raise ClusterError(f"scontrol update NodeName={name} {' '.join(state)}: {done.stderr.strip()}")
        self._wait("nodes idle", self._nodes_idle, timeout=90)
        self._note_namespaces()

    def restart_controller(self, **settings: str) -> None:
        """Restart slurmctld with its job state kept, slurm.conf having ``settings`` (e.g.
        ``MaxJobCount="1"``, which only a restart applies) after the cluster's own lines; with
        none, the cluster's own configuration again. Returns once every node is idle."""
        text = self.conf.read_text().split("# restart_controller\n", 1)[0]
        self.conf.write_text(text + ("# restart_controller\n" + "".join(f"{k}={v}\n" for k, v in settings.items()) if settings else ""))
        proc = self.procs.pop("slurmctld")
        kill_group(proc, grace=10.0)
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])  # no -c: its jobs and nodes kept
        self._wait("slurmctld", lambda: self._scontrol("ping").returncode == 0)
        self._wait("nodes idle", self._nodes_idle, timeout=90)

    @contextlib.contextmanager
    def controller_frozen(self) -> Iterator[None]:
        """slurmctld stopped (SIGSTOP) inside the block: its port takes connections and answers
        nothing; continued whatever the block's outcome."""
        pid = self.procs["slurmctld"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def jobs(self) -> list[str]:
        """Job ids the controller still lists as pending or running."""
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env(), capture_output=True, text=True, timeout=20).stdout
        return [ln.split()[0] for ln in out.splitlines() if ln.strip()]

    def node_processes(self, node: str | None = None) -> list[int]:
        """PIDs of processes running inside a node, or inside any node (slurmd, job steps, tasks)."""
        wanted = {self.node_namespaces[node]} if node else set(self.node_namespaces.values()) | self.retired_namespaces
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns" / "uts") in wanted:
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def daemon_pids(self) -> set[int]:
        return {proc.pid for proc in self.procs.values()}

    def stop(self) -> None:
        """Cancel every job, stop the daemons by PID (slurmd, slurmctld, munged), then any
        process left inside a node's namespace (an orphaned job step)."""
        t0 = time.monotonic()
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                ids = self.jobs()
                if ids:
                    subprocess.run(["scancel", *ids], env=self.env(), capture_output=True, timeout=20)
                deadline = time.monotonic() + 15
                while ids and time.monotonic() < deadline:
                    time.sleep(0.2)
                    ids = self.jobs()
            except (subprocess.SubprocessError, OSError):
                pass
        order = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None:
                kill_group(proc, grace=10.0)
        self.procs.clear()
        for pid in self.node_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for fd in self._pins.values():
            os.close(fd)
        self._pins.clear()
        self.timings["stop_s"] = time.monotonic() - t0
        if self._own_base and os.environ.get("FB_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> SlurmTestCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    with SlurmTestCluster() as c:
        print(f"export SLURM_CONF={c.conf}  # started in {c.timings['start_s']:.1f} s; SIGINT/SIGTERM stops it", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)  # wake from pause() and stop
        signal.pause()
