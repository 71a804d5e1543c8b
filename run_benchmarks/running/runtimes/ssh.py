"""The SSH runtime: hosts from the cluster file, reached over SSH, optionally in the vendor's container.

Per run it opens one SSH connection per host (in parallel, reused), copies the
harness's code to ``<work_dir>/code`` on every host (SFTP, unchanged files
skipped), checks each host's data dir, and either builds the framework
environment there (``python -m run_benchmarks.planning.envs ensure``) or uses the
cluster's ``python`` as is.  With ``runtime: container`` it builds (once per
build-context hash) and starts the vendor's image through each host's docker
engine; the image id is recorded.

Before it touches a host, a run takes the host's lock (``remote.hostlock``: a second run
on the same hosts is refused with the host and the run that holds it) and removes what
earlier runs left there (``remote.leftovers``: containers and processes of runs whose
host was lost, said in one line). The rendezvous port is the cluster file's
``master_port`` checked free on the first host, or a free port there.

Per round every node runs the node agent (``python -m run_benchmarks.running.node_agent``)
which starts the monitor, runs the framework launcher and exits with its status;
the orchestrator waits on the real exits (SSH exit status or container exit
code) under the round's deadline, stops every node when one fails, and brings
each node's folder back into ``<round_dir>/node<k>``. A host or engine lost at any
point fails that round with a line naming the host; the next round runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.planning.config import ClusterConfig, HostConfig
from run_benchmarks.planning.plan import NodePlan, Plan, RoundPlan, plan_nodes
from run_benchmarks.planning.registry import ROOT, VENDORS_DIR
from run_benchmarks.running.causes import LOST_KEY
from run_benchmarks.running.remote.errors import RemoteCommandFailed, RemoteError
from run_benchmarks.running.runtimes.base import NodeOutcome, Runtime

# what the nodes need of the repository: the code of both sides, the cases and the vendors
CODE_PARTS = ("run_benchmarks", "training", "cases", "vendors", "setup.cfg")
CODE_EXCLUDE = ("__pycache__", "*.pyc", "*.egg-info")
KILL_GRACE_S = 10.0
POLL_S = 0.2
# Run on the master host: bind the port (0: any free one) and print it, or exit with the reason.
PORT_PROBE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
try:
    s.bind(("", int(sys.argv[1])))
except OSError as e:
    sys.exit(e.strerror)
print(s.getsockname()[1])
"""


# Run on each host before the code is sent: make work_dir and write a file of argv[2] bytes
# there, or exit with what stops it (read-only, no space, permission).
WORK_PROBE = """
import os, sys
work, need = sys.argv[1], int(sys.argv[2])
path = os.path.join(work, ".flagbench-probe-%d" % os.getpid())
try:
    os.makedirs(work, exist_ok=True)
    with open(path, "wb") as fh:
        for done in range(0, need, 1 << 20):
            fh.write(bytes(min(1 << 20, need - done)))
        fh.flush()
        os.fsync(fh.fileno())
except OSError as e:
    sys.exit(e.strerror or str(e))
finally:
    if os.path.exists(path):
        os.unlink(path)
"""
# Run on each host at the start of a run: the run's folder there and its origin.json (argv[2]).
WRITE_ORIGIN = """
import os, sys
os.makedirs(sys.argv[1], exist_ok=True)
with open(os.path.join(sys.argv[1], "origin.json"), "w") as fh:
    fh.write(sys.argv[2])
"""
# Run on a host by --cleanup: {run id: [its node folders, "round<r>/node<k>"]} under argv[1]
LIST_RUNS = """
import json, os, sys
runs = {}
root = sys.argv[1]
for run in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    top = os.path.join(root, run)
    if os.path.isdir(top):
        runs[run] = sorted(
            f"{r}/{n}" for r in os.listdir(top) if r.startswith("round") and os.path.isdir(os.path.join(top, r))
            for n in os.listdir(os.path.join(top, r)) if n.startswith("node") and os.path.isdir(os.path.join(top, r, n))
        )
print(json.dumps(runs))
"""
# Run on each host of a round that has not started training: connect to the master's
# rendezvous port (argv[1:3]) within argv[3] seconds, or exit 1 with why not.
REACH_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as e:
    print(e.strerror or str(e) or type(e).__name__)
    sys.exit(1)
"""
REACH_TIMEOUT_S = 3.0
WORK_ROOM = 4  # the code archive, unpacked beside its old copy, and a round's files


def _expand(path: str | None) -> str | None:
    return os.path.expanduser(path) if path else None


class _Node:
    """One node's running agent: an SSH process or a container."""

    def __init__(self, k: int, host: HostConfig, proc: Any = None, container: Any = None) -> None:
        self.k, self.host, self.proc, self.container = k, host, proc, container
        self.rc: int | None = None
        self.error: str | None = None
        self.stopped = False  # by this run (another node failed, the deadline, a signal)
        self.lost = False  # the node itself went (killed from outside, its engine or host gone)

    def poll(self) -> int | None:
        if self.rc is not None:
            return self.rc
        if self.proc is not None:
            self.rc = self.proc.poll()
            return self.rc
        import docker

        from run_benchmarks.running.remote.containers import engine_errors

        try:
            with engine_errors(self.host.name, "following the container", self.container.container.client.api.timeout):
                self.container.container.reload()
        except docker.errors.NotFound:
            self.rc, self.error, self.lost = -1, self.error or "the container disappeared during the round", True
            return self.rc
        state = self.container.container.attrs["State"]
        if state["Status"] in ("exited", "dead"):
            self.rc = int(state["ExitCode"])
            self._killed(state)
        return self.rc

    def _killed(self, state: dict[str, Any]) -> None:
        """A container that died of a signal this run did not send: the node was lost; say
        so with what its engine recorded."""
        from run_benchmarks.running.causes import STOP_SIGNALS, exit_signal

        sig = exit_signal(self.rc)
        if self.stopped or sig is None or sig in STOP_SIGNALS:
            return
        said = f"OOMKilled {str(state.get('OOMKilled', False)).lower()}, finished {state.get('FinishedAt', '?')}"
        why = f", {state['Error']}" if state.get("Error") else ""
        name = self.container.name
        self.error = self.error or f"container {name} killed by {sig} (exit status {self.rc}; the engine: {said}{why})"
        self.lost = True

    def stop(self) -> None:
        """Stop the agent (its launcher's process group gets SIGTERM, then SIGKILL); keep the container for its logs."""
        self.stopped = True
        try:
            if self.proc is not None:
                self.proc.kill(grace=KILL_GRACE_S)
            elif self.container is not None:
                self.container.container.stop(timeout=int(KILL_GRACE_S))
        except Exception as exc:  # stopping must go on for the other nodes
            self.error = self.error or f"stopping the node failed: {exc}"


class SSHRuntime(Runtime):
    name = "ssh"

    def __init__(self, cluster: ClusterConfig, python: str | None = None) -> None:
        self.cluster = cluster
        self.python_override = python or cluster.python
        self.pool: Any = None
        self.engines: dict[str, Any] = {}
        self.images: dict[str, str] = {}
        self.env_python: str = ""
        self.prefixes: list[str] = []  # the node Python's prefix and base prefix (mounted into cpu containers)
        self.run_id: str | None = None
        self.hosts: list[HostConfig] = []
        self.live: list[_Node] = []
        self.timings: dict[str, float] = {}
        self._archive: tuple[Path, str] | None = None
        self.locks: list[Any] = []  # the hosts' locks (remote.hostlock), held for the whole run
        self.master_port: int | None = None  # chosen on the master in prepare
        self.notes: list[str] = []  # what was said about the hosts (leftovers removed)
        self._stopping = False  # set by cleanup: no node starts after it
        self._starter: ThreadPoolExecutor | None = None  # the round's node starts in flight
        self.watchers: list[Any] = []  # each host's watcher (running/watcher.py), its input ours
        self._watch_lock = threading.Lock()
        self._beat: threading.Thread | None = None
        self._beat_stop = threading.Event()
        self.kept: dict[str, str] = {}  # host -> its run folder, kept: logs that could not come here

    # -- paths ---------------------------------------------------------------------------
    def work(self, host: HostConfig) -> PurePosixPath:
        return PurePosixPath(host.work_dir or self.cluster.work_dir)

    def code_root(self, host: HostConfig) -> PurePosixPath:
        return self.work(host) / "code"

    def node_round_dir(self, plan: Plan, host: HostConfig, round_dir: Path) -> PurePosixPath:
        return self.work(host) / "runs" / plan.run_id / round_dir.name

    def cache_dir(self, host: HostConfig) -> PurePosixPath:
        return self.work(host) / "cache" / "data"

    @property
    def containerized(self) -> bool:
        return self.cluster.runtime == "container"

    def _host_specs(self) -> list[Any]:
        from run_benchmarks.running.remote.ssh import HostSpec

        ssh = self.cluster.ssh
        return [
            HostSpec(
                name=h.name,
                address=h.address,
                port=h.port or ssh.port,
                user=h.user or ssh.user,
                key_file=_expand(h.key_file or ssh.key_file),
                known_hosts=_expand(ssh.known_hosts) or os.path.expanduser("~/.ssh/known_hosts"),
            )
            for h in self.hosts
        ]

    # -- preparation ---------------------------------------------------------------------
    def dry_prepare(self, plan: Plan) -> tuple[str, Path]:
        self.hosts = self.cluster.hosts[: plan.case.nnodes]
        py = self.python_override or "<framework environment built on each host>"
        if self.containerized and not plan.vendor.container.mount_framework_env and not self.python_override:
            py = "python3"
        return py, Path(str(self.code_root(self.hosts[0])))

    def _connect(self, hosts: list[HostConfig], run_id: str | None) -> None:
        """Connect to the hosts and, for a run, take their locks (refused when another run holds one)."""
        from run_benchmarks.running.remote.hostlock import lock_hosts
        from run_benchmarks.running.remote.ssh import SSHPool

        self.hosts = hosts
        self.pool = SSHPool(
            self._host_specs(),
            accept_new_host_keys=self.cluster.ssh.accept_new_host_keys,
            connect_timeout=self.cluster.ssh.connect_timeout_s,
            lost_after=self.cluster.ssh.lost_after_s,
        )
        self.pool.connect()
        if run_id:
            names, timeout = [h.name for h in hosts], self.cluster.ssh.command_timeout_s
            say = lambda line: print(line, file=sys.stderr, flush=True)
            self.locks = lock_hosts(self.pool, names, run_id, timeout, wait_s=self.cluster.lock_wait_s, say=say)

    def prepare(self, plan: Plan, log: Path) -> tuple[str, Path]:
        t0 = time.monotonic()
        self.run_id = plan.run_id
        staging = log.parent / ".code"
        try:
            self._connect(self.cluster.hosts[: plan.case.nnodes], plan.run_id)
            self.timings["connect_s"] = time.monotonic() - t0
            for line in filter(None, self._each(lambda h: self._sweep(h, plan.run_id))):
                self.notes.append(line)
                print(line, file=sys.stderr, flush=True)
            archive, _ = self._code_archive(staging)
            need = WORK_ROOM * archive.stat().st_size
            self._each(lambda h: self._probe_work(h, need))
            self._each(lambda h: self._push_code(h, staging))
            self._each(lambda h: self._start_watcher(h, log.parent))
            self._each(lambda h: self._write_origin(h, log.parent))
            self.timings["code_s"] = time.monotonic() - t0
            data_dir = plan.settings["data"].get("data_dir")
            if data_dir:
                self._each(lambda h: self._check_dir(h, data_dir))
            self.env_python = self._framework_python(plan, log)
            if self.containerized:  # every host that lacks an image is named, not the first alone
                self._each_then_raise(lambda h: self._ensure_image(plan, h))
            self.master_port = self._master_port()
            self.timings["prepare_s"] = time.monotonic() - t0
        except RemoteError as exc:
            raise InputError(f"host {exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.env_python, Path(str(self.code_root(self.hosts[0])))

    def _sweep(self, host: HostConfig, keep_run: str | None) -> str | None:
        """Remove the containers and processes earlier runs left on the host (its lock is ours)."""
        from run_benchmarks.running.remote.leftovers import engine_or_none, sweep_host

        # the engine must answer for a container run; without one, a host has no containers
        engine = self._engine(host) if self.containerized else engine_or_none(lambda: self._engine(host))
        return sweep_host(self.pool, host.name, engine, keep_run, self.cluster.ssh.command_timeout_s)

    def _sweep_any(self, host: HostConfig) -> str | None:
        """Like ``_sweep`` for every run, and a host whose engine is down only loses its processes."""
        from run_benchmarks.running.remote.leftovers import engine_or_none, sweep_host

        engine = engine_or_none(lambda: self._engine(host))
        return sweep_host(self.pool, host.name, engine, None, self.cluster.ssh.command_timeout_s)

    def _master_port(self) -> int:
        """The rendezvous port: the cluster file's, checked free on the master, else a free one there."""
        master = self.hosts[0]
        given = "master_port" in self.cluster.model_fields_set
        port = self.cluster.master_port if given else 0
        res = self.pool.run(master.name, ["python3", "-c", PORT_PROBE, str(port)], timeout=self.cluster.ssh.command_timeout_s)
        if res.rc != 0:
            why = (res.stderr.strip().splitlines() or ["bind failed"])[-1]
            raise InputError(
                f"host {master.name}: master_port {port} of the cluster file is in use there ({why}); "
                "free it, or leave master_port out to use a free port"
            )
        return int(res.stdout.split()[-1])

    def _each(self, fn: Any) -> list[Any]:
        with ThreadPoolExecutor(max_workers=len(self.hosts)) as ex:
            return list(ex.map(fn, self.hosts))

    def _each_then_raise(self, fn: Any) -> None:
        """``fn`` on every host, all run to the end; then one line per host whose call was refused."""
        with ThreadPoolExecutor(max_workers=len(self.hosts)) as ex:
            futures = [ex.submit(fn, h) for h in self.hosts]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if not errors:
            return
        if all(isinstance(e, InputError) for e in errors):
            raise InputError("\n".join(str(e) for e in errors))
        raise next(e for e in errors if not isinstance(e, InputError))

    def _code_archive(self, staging: Path) -> tuple[Path, str]:
        """The harness's code as one tar.gz (built once per run, in the run's log folder) and its content hash."""
        if self._archive is None:
            try:
                self._archive = self._write_archive(staging / "archive")
            except OSError as exc:
                shutil.rmtree(staging, ignore_errors=True)
                raise InputError(
                    f"{staging.parent}: cannot write the code archive in the run's log folder: {exc.strerror or exc}"
                ) from None
        return self._archive

    def _write_archive(self, staging: Path) -> tuple[Path, str]:
        import hashlib
        import tarfile

        from run_benchmarks.running.remote.transfer import excluded

        files = [Path(p) for p in CODE_PARTS if (ROOT / p).is_file()]
        for part in (p for p in CODE_PARTS if (ROOT / p).is_dir()):
            for dirpath, dirnames, filenames in os.walk(ROOT / part):
                rel_dir = Path(dirpath).relative_to(ROOT)
                dirnames[:] = sorted(d for d in dirnames if not excluded(rel_dir / d, CODE_EXCLUDE))
                files += [rel_dir / f for f in sorted(filenames) if not excluded(rel_dir / f, CODE_EXCLUDE)]
        digest = hashlib.sha256()
        for rel in files:
            digest.update(str(rel).encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
        staging.mkdir(parents=True, exist_ok=True)
        path = staging / "code.tar.gz"
        with tarfile.open(path, "w:gz", compresslevel=1) as tar:
            for rel in files:
                tar.add(ROOT / rel, arcname=str(rel), recursive=False)
        return path, digest.hexdigest()[:16]

    def _push_code(self, host: HostConfig, staging: Path) -> None:
        """One archive per host, unpacked only when its hash changed (a marker file records it)."""
        archive, digest = self._code_archive(staging)
        code, work = str(self.code_root(host)), str(self.work(host))
        marker = f"{code}/.flagbench-code-{digest}"
        t = self.cluster.ssh.command_timeout_s
        if self.pool.run(host.name, ["test", "-f", marker], timeout=t).rc == 0:
            return
        self.pool.run(host.name, ["mkdir", "-p", work], timeout=t, check=True)
        self.pool.put_tree(host.name, archive.parent, work)  # the folder holds the archive alone
        script = (
            'set -e; rm -rf "$1.new"; mkdir -p "$1.new"; tar -xzf "$2" -C "$1.new"; rm -rf "$1"; mv "$1.new" "$1"; touch "$3"; rm -f "$2"'
        )
        self.pool.run(host.name, ["sh", "-c", script, "unpack", code, f"{work}/code.tar.gz", marker], timeout=t, check=True)

    def _write_origin(self, host: HostConfig, run_dir: Path) -> None:
        """``<work_dir>/runs/<run>/origin.json`` on the host: the run's folder here, where
        ``--cleanup`` brings back what a run that did not finish left there."""
        folder = str(self.work(host) / "runs" / str(self.run_id))
        origin = json.dumps({"run_id": self.run_id, "run_dir": str(run_dir), "machine": socket.gethostname()})
        self.pool.run(host.name, ["python3", "-c", WRITE_ORIGIN, folder, origin], timeout=self.cluster.ssh.command_timeout_s, check=True)

    def _start_watcher(self, host: HostConfig, run_dir: Path) -> None:
        """The run's watcher on the host (running/watcher.py): it ends the run's ranks and
        containers there when this process is gone (the channel closed, or no heartbeat for
        ``lost_after_s``)."""
        from run_benchmarks.running.watcher import HEARTBEAT_S

        silence = max(self.cluster.ssh.lost_after_s, 5 * HEARTBEAT_S)
        argv = ["python3", "-m", "run_benchmarks.running.watcher", "--run-id", str(self.run_id), "--silence", f"{silence:g}"]
        proc = self.pool.start(
            host.name,
            argv + (["--containers"] if self.containerized else []),
            run_dir / f"watcher-{host.name}.log",
            env={"PYTHONPATH": str(self.code_root(host))},
            cwd=str(self.code_root(host)),
            start_timeout=self.cluster.ssh.command_timeout_s,
            stdin=True,
        )
        with self._watch_lock:
            self.watchers.append(proc)
            if self._beat is None:
                self._beat = threading.Thread(target=self._heartbeat, name="watcher-heartbeat", daemon=True)
                self._beat.start()

    def _heartbeat(self) -> None:
        """A byte to every watcher each HEARTBEAT_S, until the run's cleanup."""
        from run_benchmarks.running.watcher import HEARTBEAT_S

        while not self._beat_stop.wait(HEARTBEAT_S):
            for w in list(self.watchers):
                try:
                    w.send(b".")
                except Exception:  # a lost host: its watcher goes by the silence
                    pass

    def _stop_watchers(self) -> None:
        """End the watchers' input once the run's own cleanup is done: each finds nothing left."""
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        for w in self.watchers:
            try:
                w.close_input()
            except Exception:
                pass
        for w in self.watchers:
            try:
                w.wait(5.0)
            except Exception:
                pass
        self.watchers = []

    def _probe_work(self, host: HostConfig, need: int) -> None:
        """Write ``need`` bytes into the host's work_dir before anything is sent there."""
        argv = ["python3", "-c", WORK_PROBE, str(self.work(host)), str(need)]
        res = self.pool.run(host.name, argv, timeout=self.cluster.ssh.command_timeout_s)
        if res.rc != 0:
            why = (res.stderr.strip().splitlines() or [f"exit status {res.rc}"])[-1]
            raise InputError(f"host {host.name}: work_dir {self.work(host)} cannot take the run's files ({need:,} bytes): {why}")

    def _check_dir(self, host: HostConfig, path: str) -> None:
        res = self.pool.run(host.name, ["test", "-d", path], timeout=self.cluster.ssh.command_timeout_s)
        if res.rc != 0:
            raise InputError(f"host {host.name}: data dir {path} does not exist")

    def _framework_python(self, plan: Plan, log: Path) -> str:
        """The node Python: as given, the image's own, or the framework env built on each host."""
        mount_env = self.containerized and plan.vendor.container.mount_framework_env
        if self.containerized and not mount_env and not self.python_override:
            return "python3"  # the image's
        py = self.python_override
        if not py:
            argv = ["python3", "-m", "run_benchmarks.planning.envs", "ensure", plan.vendor.name, plan.case.framework]
            results = self._each(lambda h: self.pool.run(h.name, argv, timeout=3600, cwd=str(self.code_root(h))))
            paths = set()
            for h, res in zip(self.hosts, results):
                with open(log, "a") as fh:
                    fh.write(f"[{h.name}] {res.stdout}{res.stderr}")
                if res.rc != 0:  # envs says what failed and where pip's output is, on one line
                    why = (res.stderr.strip().splitlines() or [f"exit status {res.rc}"])[-1].removeprefix("error: ")
                    raise InputError(f"host {h.name}: {why}")
                paths.add(res.stdout.strip().splitlines()[-1])
            if len(paths) != 1:
                raise InputError(f"hosts disagree on the environment's path: {sorted(paths)}")
            py = paths.pop()
        probe = [py, "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"]
        for h, res in zip(self.hosts, self._each(lambda h: self.pool.run(h.name, probe, timeout=60))):
            if res.rc != 0:
                raise InputError(f"host {h.name}: python {py} does not run there: {res.stderr.strip()[-200:]}")
        self.prefixes = sorted(set(res.stdout.split()))
        return py

    def _engine(self, host: HostConfig) -> Any:
        from run_benchmarks.running.remote.containers import connect_engine

        if host.name not in self.engines:
            spec = self.pool.hosts[host.name]
            url = host.docker_url or f"ssh://{spec.user}@{spec.address}:{spec.port}"
            # every engine call is bounded as a command is (an image build, load or a container's
            # wait give their own, longer bounds)
            self.engines[host.name] = connect_engine(
                url, pool=self.pool if url.startswith("ssh://") else None, timeout=self.cluster.ssh.command_timeout_s
            )
        return self.engines[host.name]

    def image_name(self, plan: Plan) -> str:
        return f"flagbench/{plan.vendor.name}-{plan.case.framework}"

    def _ensure_image(self, plan: Plan, host: HostConfig) -> None:
        from run_benchmarks.running.remote.containers import ensure_image, image_tag

        context = VENDORS_DIR / plan.vendor.name / plan.case.framework
        if not (context / "Dockerfile").is_file():
            raise InputError(f"vendor {plan.vendor.name} has no image for {plan.case.framework} ({context / 'Dockerfile'} missing)")
        args = dict(self.cluster.image_build_args)
        try:
            image_id = ensure_image(self._engine(host), context, self.image_name(plan), args)
        except RemoteError as exc:
            raise InputError(f"host {host.name}: {exc.detail}") from None
        self.images[host.name] = f"{image_tag(context, self.image_name(plan), args)} {image_id}"

    # -- one round -----------------------------------------------------------------------
    def node_plans(self, plan: Plan, python: str, root: Path, round_dir: Path) -> list[NodePlan]:
        if self.master_port:  # the port chosen on the master (a dry run shows the configured one)
            plan = dataclasses.replace(plan, cluster=plan.cluster.model_copy(update={"master_port": self.master_port}))
        out = []
        for k, host in enumerate(self.hosts or self.cluster.hosts[: plan.case.nnodes]):
            rd = Path(str(self.node_round_dir(plan, host, round_dir)))
            out.append(plan_nodes(plan, python, Path(str(self.code_root(host))), rd)[k])
        return out

    def _agent_spec(self, plan: Plan, host: HostConfig, round_dir: Path, nodes: list[NodePlan]) -> dict[str, Any]:
        from run_benchmarks.running.node_agent import agent_spec

        # the agent runs inside the container here (it is the container's command): none to start
        monitor = {"kind": plan.vendor.monitor, "python": self.env_python, "interval_s": 1.0, "pythonpath": str(self.code_root(host))}
        return agent_spec(str(self.node_round_dir(plan, host, round_dir)), "@@FB_MASTER@@", monitor, None, nodes)

    def _stage(self, plan: Plan, k: int, host: HostConfig, round_dir: Path, nodes: list[NodePlan]) -> None:
        """Write the node's resolved.json and agent spec and send them to the host."""
        stage = round_dir / ".stage" / host.name
        stage.mkdir(parents=True, exist_ok=True)
        rd = self.node_round_dir(plan, host, round_dir)
        round_no = int(round_dir.name.removeprefix("round"))
        resolved = plan.resolved(round_no, str(rd / "output"), str(self.cache_dir(host)))
        (stage / "resolved.json").write_text(json.dumps(resolved, indent=2))
        (stage / "agent.json").write_text(json.dumps(self._agent_spec(plan, host, round_dir, nodes), indent=2))
        for name, text in nodes[k].files.items():
            (stage / name).write_text(text)
        (stage / f"node{k}" / "ranks").mkdir(parents=True, exist_ok=True)
        self.pool.run(host.name, ["mkdir", "-p", str(rd)], timeout=self.cluster.ssh.command_timeout_s, check=True)
        self.pool.put_tree(host.name, stage, str(rd))

    def _agent_argv(self, plan: Plan, host: HostConfig, round_dir: Path, k: int, python: str) -> list[str]:
        rd = self.node_round_dir(plan, host, round_dir)
        return [
            python,
            "-m",
            "run_benchmarks.running.node_agent",
            "--spec",
            str(rd / "agent.json"),
            "--node-rank",
            str(k),
            "--master",
            self.hosts[0].address,
        ]

    def _start(self, plan: Plan, k: int, host: HostConfig, round_dir: Path, node: NodePlan) -> None:
        """Start node k and track it in ``self.live`` at once (a stop signal may come meanwhile)."""
        from run_benchmarks.running.remote.leftovers import RUN_MARK

        if self._stopping:
            raise RemoteCommandFailed(host.name, "not started: the run is stopping")
        local_node = round_dir / f"node{k}"
        argv = self._agent_argv(plan, host, round_dir, k, self.env_python)
        # the run's mark, inherited by everything the agent starts: a later run finds leftovers by it
        mark = {RUN_MARK: plan.run_id}
        if not self.containerized:
            proc = self.pool.start(
                host.name,
                argv,
                local_node / "agent.log",
                env={"PYTHONPATH": str(self.code_root(host)), **mark},
                cwd=str(self.code_root(host)),
                start_timeout=self.cluster.ssh.command_timeout_s,
            )
            self.live.append(_Node(k, host, proc=proc))
            return
        from run_benchmarks.running.remote.containers import Mount, run_container, vendor_container

        opts = plan.vendor.container
        code, rd = str(self.code_root(host)), str(self.node_round_dir(plan, host, round_dir))
        user_cache = self._caches(host)
        mounts = [
            Mount(code, code, True),
            Mount(rd, rd, False),
            Mount(str(self.cache_dir(host)), str(self.cache_dir(host)), False),
            Mount(user_cache, user_cache, False),
        ]
        data_dir = plan.settings["data"].get("data_dir")
        if data_dir:
            mounts.append(Mount(data_dir, data_dir, True))
        if opts.mount_framework_env:
            mounts += [Mount(p, p, True) for p in self.prefixes]
        spec = vendor_container(
            opts,
            image=self.images[host.name].split()[0],
            command=argv,
            run_id=plan.run_id,
            name=f"fb-{plan.run_id[-26:]}-{round_dir.name}-n{k}".replace(":", "-"),
            # XDG_CACHE_HOME: what frameworks build or fetch once (DeepSpeed's JIT ops, hub files)
            # is the host user's, shared with process runs there and kept across containers
            env={"PYTHONPATH": code, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": user_cache, **mark},
            mounts=mounts,
            workdir=code,
        )
        self.live.append(_Node(k, host, container=run_container(self._engine(host), spec)))

    def host_data(self, plan: Plan, spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """The node side of planning/hostdata.py on every host, with the node Python (in the
        vendor's image for a container run, the data_dir mounted read-only as the ranks see it);
        its digests cached in ``<work_dir>/cache/fingerprints`` there."""
        from run_benchmarks.planning import hostdata

        def one(host: HostConfig) -> tuple[str, dict[str, Any]]:
            code, cache = str(self.code_root(host)), str(self.work(host) / "cache" / "fingerprints")
            argv = hostdata.node_argv(self.env_python, spec)
            env = {"PYTHONPATH": code, "FLAGBENCH_CACHE_DIR": cache}
            if not self.containerized:
                res = self.pool.run(host.name, argv, timeout=self.cluster.round_timeout_s, env=env, cwd=code)
                return host.name, hostdata.report(host.name, res.rc, res.stdout, res.stderr)
            return host.name, self._host_data_container(plan, host, argv, env, spec)

        try:
            return self._each(one)
        except RemoteError as exc:
            raise InputError(f"host {exc}") from None

    def _host_data_container(
        self, plan: Plan, host: HostConfig, argv: list[str], env: dict[str, str], spec: dict[str, Any]
    ) -> dict[str, Any]:
        """The node side in a container of the run's image on ``host``, with the mounts the
        ranks' container has (the code, the data_dir read-only): its report."""
        from run_benchmarks.planning import hostdata
        from run_benchmarks.running.remote.containers import Mount, run_container, vendor_container
        from run_benchmarks.running.remote.leftovers import RUN_MARK

        code, cache = env["PYTHONPATH"], env["FLAGBENCH_CACHE_DIR"]
        self.pool.run(host.name, ["mkdir", "-p", cache], timeout=self.cluster.ssh.command_timeout_s, check=True)
        mounts = [Mount(code, code, True), Mount(cache, cache, False)]
        mounts += [Mount(d, d, True) for d in sorted({str(v["data_dir"]) for v in spec["phases"].values()})]
        if plan.vendor.container.mount_framework_env:
            mounts += [Mount(p, p, True) for p in self.prefixes]
        spec = vendor_container(
            plan.vendor.container,
            image=self.images[host.name].split()[0],
            command=argv,
            run_id=plan.run_id,
            name=f"fb-{plan.run_id[-26:]}-data-{host.name}".replace(":", "-"),
            env={**env, "PYTHONUNBUFFERED": "1", RUN_MARK: plan.run_id},
            mounts=mounts,
            workdir=code,
        )
        with run_container(self._engine(host), spec) as handle:
            rc = handle.wait(self.cluster.round_timeout_s)
            return hostdata.report(host.name, rc, handle.logs())

    def _caches(self, host: HostConfig) -> str:
        """Make the run's data cache on the host; the host user's cache folder (~/.cache)."""
        script = "import os, sys; os.makedirs(sys.argv[1], exist_ok=True); c = os.path.expanduser('~/.cache'); os.makedirs(c, exist_ok=True); print(c)"
        res = self.pool.run(
            host.name, ["python3", "-c", script, str(self.cache_dir(host))], timeout=self.cluster.ssh.command_timeout_s, check=True
        )
        return res.stdout.strip().splitlines()[-1]

    def _start_all(self, plan: Plan, round_dir: Path, nodes: list[NodePlan]) -> None:
        """Start every node in parallel; what started is tracked even when another host fails."""
        self._starter = ThreadPoolExecutor(max_workers=len(self.hosts))
        futures = [self._starter.submit(self._start, plan, k, h, round_dir, nodes[k]) for k, h in enumerate(self.hosts)]
        self._starter.shutdown(wait=True)  # cleanup() waits on it too when a signal ends this wait
        self._starter = None
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def run_round(self, plan: Plan, rnd: RoundPlan, timeout_s: float) -> list[NodeOutcome]:
        round_dir, nodes = rnd.dir, list(rnd.nodes)
        t0 = time.monotonic()
        self.aborted = None
        deadline = t0 + timeout_s
        late: set[int] = set()
        failure: RemoteError | None = None  # a host that could not be staged, started or followed
        try:
            for k in range(len(self.hosts)):
                (round_dir / f"node{k}").mkdir(parents=True, exist_ok=True)
            self._each(lambda h: self._stage(plan, self.hosts.index(h), h, round_dir, nodes))
            self._start_all(plan, round_dir, nodes)
            if self._wait(deadline):
                late = {n.k for n in self.live if n.rc is None}
                if self.aborted:  # stopped early for a reason of its own, not the deadline
                    for n in self.live:
                        if n.k in late:
                            n.error = n.error or self.aborted
                    late = set()
        except RemoteError as exc:
            failure = exc
        finally:
            for n in self.live:
                if n.rc is None:
                    n.stop()
                    n.poll()
        by_rank = {n.k: n for n in self.live}
        for n in self.live:
            if failure is not None:
                n.error = n.error or (failure.detail if failure.host == n.host.name else f"stopped: host {failure}")
        if self.live:  # every node's logs come back in parallel
            with ThreadPoolExecutor(max_workers=len(self.live)) as ex:
                list(ex.map(lambda n: self._collect(plan, n, round_dir, round_dir / f"node{n.k}"), self.live))
        outcomes = []
        for k, host in enumerate(self.hosts):
            local = round_dir / f"node{k}"
            n = by_rank.get(k)
            if n is None:  # never started on this host
                why = "not started" if failure is None else failure.detail if failure.host == host.name else f"not started: host {failure}"
                outcomes.append(NodeOutcome(host.name, k, None, False, local, error=why))
            else:
                lost = {LOST_KEY: True} if n.lost else {}
                outcomes.append(NodeOutcome(host.name, k, n.rc, k in late, local, n.error, extra=lost))
        shutil.rmtree(round_dir / ".stage", ignore_errors=True)
        self.timings["last_round_s"] = time.monotonic() - t0
        self.live = []
        return outcomes

    def _collect(self, plan: Plan, n: _Node, round_dir: Path, local: Path) -> None:
        """Bring the node's folder back; keep the container's log; remove the container. What
        could not be written here (this machine's disk full) leads the node's error."""
        from run_benchmarks.running.remote.errors import LocalWriteFailed

        here: list[str] = []  # failures on this machine's side
        if n.container is not None:
            try:
                text = n.container.logs()
                try:
                    (local / "container.log").write_text(text)
                except OSError as exc:
                    here.append(f"{local / 'container.log'}: {exc.strerror or exc} ({len(text.encode()):,} bytes needed)")
            except Exception as exc:
                n.error = n.error or f"container logs unavailable: {exc}"
            try:
                n.container.stop_and_remove()
            except Exception as exc:
                n.error = n.error or f"container not removed: {exc}"
        if n.proc is not None and n.proc.write_error:
            here.append(n.proc.write_error)
        if n.proc is not None and n.rc == -1 and not n.stopped:
            n.error = n.error or "the SSH connection to the host was lost during the round"
            n.lost = True
        remote = str(self.node_round_dir(plan, n.host, round_dir) / f"node{n.k}")
        try:
            self.pool.get_tree(n.host.name, remote, local)
        except LocalWriteFailed as exc:  # the host's copy is the only whole one: it stays
            self.kept[n.host.name] = str(self.work(n.host) / "runs" / str(self.run_id))
            here.append(f"logs not collected: {exc.detail}; {self._kept_line(n.host, remote, local)}")
        except RemoteError as exc:
            n.error = n.error or f"logs not collected: {exc.detail}"
        if here:
            n.error = "; ".join(here + ([n.error] if n.error else []))

    def unreached_master(self) -> str | None:
        """Each node whose host cannot connect to the master's rendezvous port while the master
        itself can: the network between the hosts is cut (each still answers this machine)."""
        if len(self.hosts) < 2 or not self.master_port or self.pool is None:
            return None
        master, port = self.hosts[0], str(self.master_port)
        argv = ["python3", "-c", REACH_PROBE, master.address, port, f"{REACH_TIMEOUT_S:g}"]

        def probe(h: HostConfig) -> tuple[int, str] | None:
            try:
                res = self.pool.run(h.name, argv, timeout=self.cluster.ssh.command_timeout_s)
            except RemoteError:  # the host itself lost: said by its own failure
                return None
            return res.rc, (res.stdout.strip().splitlines() or [f"exit status {res.rc}"])[-1]

        found = self._each(probe)
        if found[0] is None or found[0][0] != 0:  # the master does not answer itself yet: no cut to name
            return None
        cut = [
            f"node{k} ({h.name}) cannot reach the master {master.name} at {master.address}:{port} ({r[1]}), "
            f"which {master.name} answers: the network between the hosts is cut or filtered"
            for k, (h, r) in enumerate(zip(self.hosts, found))
            if k > 0 and r is not None and r[0] != 0
        ]
        return "; ".join(cut) or None

    def _kept_line(self, host: HostConfig, remote: str, local: Path) -> str:
        """Where a host's copy of logs that could not come here stays, and how to fetch it."""
        return (
            f"the host's copy is kept: {host.name}:{remote} (fetch it once this machine has room: "
            f"{self._scp(host, remote, str(local))}; or start_task.py --cluster FILE --cleanup "
            "brings back and removes what runs left there)"
        )

    def _wait(self, deadline: float) -> bool:
        """Wait for every node; on the first failure stop the rest. True if the deadline passed."""
        pending = list(self.live)
        while pending:
            for n in list(pending):
                try:
                    rc = n.poll()
                except Exception as exc:  # engine or connection gone
                    from run_benchmarks.running.remote.containers import brief

                    n.error, rc = f"lost the node: {brief(exc)}", -1
                    n.rc, n.lost = rc, True
                if rc is not None:
                    pending.remove(n)
                    if rc != 0:
                        for other in pending:
                            other.stop()
                            other.error = other.error or f"stopped: node{n.k} ({n.host.name}) failed"
                            other.poll()
            if time.monotonic() > deadline or self.aborted:
                return True
            time.sleep(POLL_S)
        return False

    def host_memory(self) -> dict[str, int]:
        """MemTotal of each host, from its /proc/meminfo."""

        def total(h: HostConfig) -> tuple[str, int]:
            res = self.pool.run(h.name, ["cat", "/proc/meminfo"], timeout=self.cluster.ssh.command_timeout_s, check=True)
            kib = next((int(ln.split()[1]) for ln in res.stdout.splitlines() if ln.startswith("MemTotal:")), 0)
            return h.name, kib * 1024

        try:
            return dict(self._each(total))
        except RemoteError as exc:
            raise InputError(f"host {exc}") from None

    def progress(self, round_dir: Path) -> list[dict[str, Any] | None]:
        """Each live node's progress.json, written on its host by the node agent; once the
        round is over (its nodes' folders brought back), the copies here."""
        from run_benchmarks.running import progress

        if not self.live:
            return super().progress(round_dir)
        out: list[dict[str, Any] | None] = []
        for n in list(self.live):
            path = self.work(n.host) / "runs" / self.run_id / round_dir.name / f"node{n.k}" / progress.FILE
            try:
                data = self.pool.read_bytes(n.host.name, str(path), limit=4096)
                out.append(json.loads(data) if data else None)
            except (RemoteError, ValueError):
                out.append(None)
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": [h.name for h in self.hosts],
            "images": dict(self.images),
            "timings_s": dict(self.timings),
            "master_port": self.master_port,
            "leftovers_removed": list(self.notes),
            "kept_on_hosts": dict(self.kept),  # run folders kept there: logs that could not come here
        }

    def left_behind(self) -> list[str]:
        """Each host the run reached: what of it may be there still, and how to remove it."""
        from run_benchmarks.running.remote.leftovers import RUN_MARK

        what = "containers" if self.containerized else "processes"
        return [
            f"{h.name}: {what} marked {RUN_MARK}={self.run_id} (the next run there or start_task.py "
            f"--cluster FILE --cleanup removes them), the folder {self.work(h) / 'runs' / str(self.run_id)}"
            for h in (self.hosts if self.run_id else [])
        ]

    def cleanup(self) -> None:
        """Stop this run's nodes, remove its containers, free the hosts' locks, close the connections.

        Safe to call more than once, and from the stop-signal path (Ctrl-C, SIGTERM, SIGHUP
        turned into KeyboardInterrupt) at any point of a round: nodes still being started
        are waited for, then stopped with the others; none starts afterwards. What cannot be
        reached now (a lost host) is removed by the next run there."""
        from run_benchmarks.running.remote.containers import cleanup_by_label

        self._stopping = True
        if self._starter is not None:
            self._starter.shutdown(wait=True)
            self._starter = None
        for n in self.live:
            n.stop()
        self.live = []
        for client in list(self.engines.values()):
            try:
                if self.run_id:
                    cleanup_by_label(client, self.run_id)
                client.close()
            except Exception:
                pass
        self.engines.clear()
        self._stop_watchers()
        if self.run_id and self.pool is not None and not self.cluster.keep_remote:
            self._each(self._remove_run_folder)
        for lock in self.locks:
            lock.release()
        self.locks = []
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _left_runs(self, host: HostConfig) -> tuple[list[str], dict[str, str]]:
        """For --cleanup: each run folder an earlier run left on the host, brought back into
        that run's folder here (its origin.json names it) and then removed; kept, and named
        with how to fetch it, when it cannot come here. Its lines, and per local run folder
        what was found of it on this host."""
        from run_benchmarks.running.remote.errors import LocalWriteFailed

        t = self.cluster.ssh.command_timeout_s
        runs_root = str(self.work(host) / "runs")
        res = self.pool.run(host.name, ["python3", "-c", LIST_RUNS, runs_root], timeout=t, check=True)
        lines, found = [], {}
        for run, nodes in json.loads(res.stdout.strip().splitlines()[-1]).items():
            folder = f"{runs_root}/{run}"
            raw = self.pool.read_bytes(host.name, f"{folder}/origin.json", limit=65536)
            try:
                origin = json.loads(raw) if raw else {}
                run_dir = Path(origin["run_dir"]) if origin.get("machine") == socket.gethostname() else None
            except (ValueError, KeyError, TypeError):
                run_dir = None
            if run_dir is None or not run_dir.is_dir():
                where = f"its run folder {run_dir} is not on this machine" if run_dir else "it names no run folder of this machine"
                scp = self._scp(host, folder, "DEST")
                lines.append(f"host {host.name}: kept {folder} ({where}; fetch it with: {scp}, then remove it there)")
                continue
            try:
                for node in nodes:
                    self.pool.get_tree(host.name, f"{folder}/{node}", run_dir / node)
            except LocalWriteFailed as exc:
                scp = self._scp(host, folder, str(run_dir))
                lines.append(f"host {host.name}: kept {folder}: {exc.detail} (fetch it once this machine has room: {scp})")
                found[str(run_dir)] = f"{len(nodes)} node folder(s) on {host.name}, kept there: this machine's side is full"
                continue
            self.pool.run(host.name, ["rm", "-rf", "--", folder], timeout=t, check=True)
            what = f"{len(nodes)} node folder(s) ({', '.join(nodes)})" if nodes else "no node folder"
            lines.append(f"host {host.name}: run {run} left {what}: brought back into {run_dir}, then removed there")
            found[str(run_dir)] = f"{what} on {host.name}, brought back"
        return lines, found

    def _scp(self, host: HostConfig, remote: str, local: str) -> str:
        spec = self.pool.hosts[host.name]
        return shlex.join(["scp", "-r", "-P", str(spec.port), f"{spec.user}@{spec.address}:{remote}/.", local])

    def _remove_run_folder(self, host: HostConfig) -> None:
        """The run's folder on the host, its logs brought back (best effort: a lost host keeps it).
        A host never reached in this run has none, and is not tried again (a hung sshd would
        hold the cleanup for another connect_timeout_s)."""
        if host.name not in self.pool.reached or host.name in self.kept:
            return
        folder = str(self.work(host) / "runs" / str(self.run_id))
        try:
            self.pool.run(host.name, ["rm", "-rf", "--", folder], timeout=self.cluster.ssh.command_timeout_s)
        except RemoteError:
            pass


def clean_hosts(cluster: ClusterConfig) -> list[str]:
    """Remove what earlier runs left on the hosts of a cluster file (their containers and
    processes); one line per host that had any. A host that a run holds is refused, so a
    live run is never touched. For ``start_task.py --cluster FILE cleanup``."""
    import datetime as dt

    _needs_ssh(cluster, "cleanup")
    rt = SSHRuntime(cluster)
    try:
        rt._connect(list(cluster.hosts), f"cleanup-{dt.datetime.now():%Y%m%d-%H%M%S}")
        lines = rt._each(lambda h: rt._sweep_any(h))
        found = rt._each(rt._left_runs)  # the hosts' locks are ours: no live run has a folder there
        lines += [ln for per_host in found for ln in per_host[0]]
        finished: dict[str, list[str]] = {}
        for per_host in found:
            for run_dir, said in per_host[1].items():
                finished.setdefault(run_dir, []).append(said)
        lines += [_finish_orphan(Path(d), said) for d, said in sorted(finished.items())]
    except RemoteError as exc:
        raise InputError(f"host {exc}") from None
    finally:
        rt.cleanup()
    return [ln for ln in lines if ln]


def _finish_orphan(run_dir: Path, found: list[str]) -> str | None:
    """The results.json of a run whose start_task.py ended without finishing it (SIGKILL, a
    second stop signal): finished as failed, saying what --cleanup found; a line saying so."""
    from run_benchmarks.running import orphans

    res = orphans.left_running(run_dir)
    if res is None:
        return None
    error = f"start_task.py ended without finishing the run after {len(res.rounds)} round(s); --cleanup found {'; '.join(found)}"
    return orphans.finish(run_dir, res, error)


def load_base_images(
    cluster: ClusterConfig, vendor: str, frameworks: list[str] | None = None, archive: Path | None = None, source: Any = None
) -> list[str]:
    """Put the base images of the vendor's Dockerfiles (with the cluster's ``image_build_args``)
    on every host that lacks them: from ``archive`` (a ``docker save`` file), else from the
    engine ``source``, else from this machine's docker engine. One line per host.
    For ``start_task.py --cluster FILE --vendor V --load-images [ARCHIVE]``."""
    from run_benchmarks.running.remote.images import dockerfile_bases, load_images

    _needs_ssh(cluster, "--load-images")
    vendor_dir = VENDORS_DIR / vendor
    contexts = [vendor_dir / fw for fw in frameworks] if frameworks else sorted(p for p in vendor_dir.iterdir() if p.is_dir())
    refs = dockerfile_bases(contexts, cluster.image_build_args)
    if not refs:
        raise InputError(f"vendors/{vendor}: no Dockerfile names a base image")
    rt = SSHRuntime(cluster)
    try:
        rt._connect(list(cluster.hosts), None)
        engines = {h.name: rt._engine(h) for h in rt.hosts}
        if archive is None and source is None:
            source = _local_engine(refs)
        return load_images(engines, refs, source, archive)
    except RemoteError as exc:
        raise InputError(f"host {exc}" if exc.host in {h.name for h in cluster.hosts} else str(exc)) from None
    finally:
        rt.cleanup()


def _needs_ssh(cluster: ClusterConfig, what: str) -> None:
    if cluster.backend != "ssh":
        raise InputError(f"{what} works on the hosts of a cluster file with backend: ssh (this one has {cluster.backend!r})")


def _local_engine(refs: list[str]) -> Any:
    import docker

    try:
        return docker.from_env()
    except docker.errors.DockerException as exc:
        raise InputError(
            f"no docker engine on this machine to save {', '.join(refs)} from ({exc}); give a docker save archive of it instead"
        ) from None
