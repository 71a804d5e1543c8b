"""The slurm runtime: each round is one batch job of ``nnodes`` whole nodes.

Per round it writes ``<round_dir>/slurm/``: ``spec.json`` (every node's launcher
command, planned with a placeholder for the master address) and ``job.sh`` (the
batch script), submits the script with ``sbatch`` (options as arguments), and
follows the job through ``scontrol show job -o`` until it ends. Inside the job one
``srun`` step starts ``python -m run_benchmarks.running.slurm_node`` once per node; that
wrapper picks its node rank from ``SLURM_NODEID``, puts the allocation's first host
in as the master, runs a monitor beside the launcher and writes the node's logs
straight into ``<round_dir>/node<k>/``.

The run directory, the harness's code and the interpreters must be on a filesystem
that the submit host and every node share (docs/slurm.md). Ctrl-C during a round
cancels its job (``scancel``) and waits until Slurm has nothing left of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.planning import hostdata
from run_benchmarks.planning.config import ClusterConfig, HostConfig, SlurmConfig
from run_benchmarks.planning.envs import env_dir, framework_python, python_of
from run_benchmarks.planning.plan import NodePlan, Plan, RoundPlan, plan_nodes
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running import causes, lease
from run_benchmarks.running.causes import SHARED_KEY
from run_benchmarks.running.node_agent import STOP_GRACE_S, agent_spec
from run_benchmarks.running.runtimes.base import NodeOutcome, Runtime
from run_benchmarks.running.slurm_node import EXIT_BAD_ALLOCATION, EXIT_NO_SPEC
from training import metriclog as ml

#: the master address in planned commands; slurm_node puts the allocation's first node's address in
MASTER_PLACEHOLDER = "fb-slurm-master"
#: the rendezvous port in planned commands; slurm_node puts the port node 0 chose in
PORT_PLACEHOLDER = "@@FB_MASTER_PORT@@"
#: what srun prints when it cannot start the step on a node (its slurmd down or unreachable)
TASK_LAUNCH_FAILED = re.compile(r"srun: error: Task launch for StepId=\S+ failed on node (\S+): (.+)")
APP_LAUNCH_FAILED = re.compile(r"srun: error: Application launch failed: (.+)")
LAUNCH_FAILED_GONE_WAIT_S = 15.0  # a node that cannot be reached keeps the job COMPLETING until Slurm marks it down
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel")
#: job states (scontrol's JobState) while the job waits or runs
WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
ACTIVE = {"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING", "STOPPED"}
#: terminal states other than COMPLETED, FAILED, TIMEOUT, CANCELLED: the job ended by Slurm's hand
ENDED_BY_SLURM = {"NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "DEADLINE", "OUT_OF_MEMORY", "REVOKED"}
#: a pending job's reason when a node it asked for cannot serve; states that say so
UNAVAILABLE_REASON = re.compile(r"ReqNodeNotAvail|NodeDown|Nodes_required_for_job_are_DOWN")
#: a pending job's reason when its partition cannot run it as asked (a limit below what it
#: asks, the partition down): it waits until an admin changes the partition, so never by itself
#: sbatch's line when the controller refuses a job for now (its MaxJobCount reached, say): sbatch
#: would sleep and submit again 15 times, two minutes, saying nothing more
REFUSED_FOR_NOW = re.compile(r"temporarily unable to accept job")
SBATCH_TIMEOUT_S = 120.0
OUT_OF_SERVICE = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE"}
#: srun's word of the node a NODE_FAIL was for, in the batch output
NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
PARTITION_REASON = re.compile(r"PartitionTimeLimit|PartitionNodeLimit|PartitionDown|PartitionInactive")
#: how long the other nodes' launchers may outlive the first to end before their nodes count
#: as lost (a crashed node never reports; Slurm would notice only at its SlurmdTimeout)
PEER_LOST_S = 20.0
LOST_GONE_WAIT_S = 10.0
SILENT_CHECK_AFTER_S = 10.0  # a job still completing this long after its end: which nodes hold it?  # a lost node keeps the job COMPLETING until Slurm marks it down
GONE = "GONE"  # no longer known to the controller (purged after MinJobAge)
GONE_WAIT_S = 60.0
INTERRUPT_CANCEL_S = 10.0  # scancel's bound after Ctrl-C: a healthy controller answers in well under a second
REPORT_WAIT_S = 5.0  # a shared filesystem may show a node's last file a little late
TAIL = 15
LEASE_FILE = "lease"


def parse_show_job(line: str) -> dict[str, str]:
    """``scontrol show job -o`` output -> {field: value}; values may hold spaces."""
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    out = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


@dataclasses.dataclass
class Job:
    """One round's batch job as the harness saw it; times are wall-clock seconds."""

    job_id: str
    name: str
    round: str
    nnodes: int
    submitted_at: float
    state: str = "PENDING"
    reason: str = ""
    exit_code: str = ""
    nodelist: str = ""
    batch_host: str = ""
    time_limit: str = ""
    running_at: float | None = None  # first seen running (poll resolution)
    ended_at: float | None = None  # first seen in a terminal state (poll resolution)
    gone_at: float | None = None  # squeue no longer lists it
    nodes_started_at: float | None = None  # the first node wrapper started (node.json)
    nodes_finished_at: float | None = None  # the last launcher exited (node.json)
    first_step_at: float | None = None  # the first train_step line
    #: "round deadline" | "interrupted" | "cleanup" | "launch failed" | "aborted" | "node unavailable" | "partition limit"
    cancelled_by_harness: str | None = None  # set once scancel said yes
    stopped_by_harness: str | None = None  # why the harness stopped it (scancel, the lease ended), even if scancel failed
    cancel_failed: str | None = None  # scancel's command and error when it could not cancel the job
    unreachable: str | None = None  # Slurm did not answer the harness for unreachable_s: which command, what error
    state_at_cancel: str = ""  # e.g. "PENDING (Resources)"
    launch_failure: str | None = None  # srun could not start the step on a node: why
    unavailable: str | None = None  # the nodes it needs that are DOWN or DRAINED, and why
    req_nodes: str = ""  # the nodes it asked for (ReqNodeList)
    partition: str = ""  # the partition it waits in (Partition)
    num_nodes: str = ""  # the node count it asks for (NumNodes: "2" or "2-2")
    first_end_seen: float | None = None  # monotonic: when a node's launcher was first seen ended
    lost: dict[int, str] = dataclasses.field(default_factory=dict)  # node rank -> why it counts as lost
    #: ended NODE_FAIL: the job's nodes out of service when that was seen, each with Slurm's
    #: state and reason (a node whose slurmd answers is back in service soon after)
    failed_nodes: dict[str, str] | None = None
    shared_with: set[str] = dataclasses.field(default_factory=set)  # other jobs seen running on its nodes
    silent_nodes: str | None = None  # its nodes that stopped answering the controller while it ended
    completing_since: float | None = None  # monotonic: first seen COMPLETING

    def summary(self) -> dict[str, Any]:
        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 3) if a is not None and b is not None else None

        return {
            "job_id": self.job_id,
            "name": self.name,
            "round": self.round,
            "state": self.state,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "nodelist": self.nodelist,
            "batch_host": self.batch_host,
            "time_limit": self.time_limit,
            "cancelled_by_harness": self.cancelled_by_harness,
            "cancel_failed": self.cancel_failed,
            "unreachable": self.unreachable,
            "failed_nodes": self.failed_nodes,
            "state_at_cancel": self.state_at_cancel or None,
            "launch_failure": self.launch_failure,
            "unavailable": self.unavailable,
            "lost_nodes": {str(k): v for k, v in self.lost.items()} or None,
            "shared_with": sorted(self.shared_with, key=int) or None,
            "silent_nodes": self.silent_nodes,
            "submit_to_running_s": span(self.submitted_at, self.running_at),
            "submit_to_nodes_started_s": span(self.submitted_at, self.nodes_started_at),
            "submit_to_first_step_s": span(self.submitted_at, self.first_step_at),
            "nodes_running_s": span(self.nodes_started_at, self.nodes_finished_at),
            # from the last launcher's exit until Slurm has nothing left of the job
            "teardown_s": span(self.nodes_finished_at or self.ended_at, self.gone_at),
        }


class SlurmRuntime(Runtime):
    name = "slurm"
    data_in_rounds = True  # the nodes are known once a round's job runs: its data is checked there

    def __init__(self, cluster: ClusterConfig, python: str | None = None) -> None:
        self.cluster = cluster
        self.conf: SlurmConfig = cluster.slurm or SlurmConfig()
        self.python_override = python or cluster.python
        docker = self.conf.container_runtime == "docker"
        if docker != (cluster.runtime == "container"):
            raise InputError(
                f"cluster file: runtime {cluster.runtime!r} and slurm.container_runtime "
                f"{self.conf.container_runtime!r} disagree (container goes with docker, process with none)"
            )
        self.node_python = self.conf.node_python or sys.executable
        self.jobs: list[Job] = []
        self.notes: list[str] = []  # leftovers of earlier runs removed at prepare
        self.lease: lease.Renewer | None = None  # the round's lease, renewed while its job is followed
        self.silent_since: float | None = None  # monotonic: since when Slurm's commands have failed
        self.silent_error = ""  # the last failing command and its error
        self.said_silent = False
        self.gave_up: str | None = None  # a round's job given up because Slurm did not answer

    # ------------------------------------------------------------------ client commands

    def _check_conf(self) -> None:
        """A ``slurm.slurm_conf`` that names no file, said at once (the clients would wait for
        a controller they cannot find)."""
        if self.conf.slurm_conf and not Path(self.conf.slurm_conf).expanduser().is_file():
            raise InputError(f"cluster file: field 'slurm.slurm_conf': {self.conf.slurm_conf}: no such file")

    def _env(self) -> dict[str, str]:
        # a harness started inside an allocation must not hand that job's variables to sbatch
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        if self.conf.slurm_conf:
            env["SLURM_CONF"] = str(Path(self.conf.slurm_conf).expanduser())
        elif os.environ.get("SLURM_CONF"):
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        return env

    def _run(self, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command; one the controller does not answer in ``timeout`` is a failed
        call (exit 124, as timeout(1) says), read again at the next poll, never a crash."""
        try:
            return subprocess.run(argv, env=self._env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            last = [ln.strip() for ln in said.splitlines() if ln.strip()][-1:]
            return subprocess.CompletedProcess(
                argv,
                124,
                "",
                f"{argv[0]}: no answer from the Slurm controller within {timeout:g} s" + (f" (it said: {last[0]})" if last else ""),
            )

    def _sbatch(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """``_run`` for sbatch, ended (exit 75) at its first line saying the controller refuses
        the job for now (``REFUSED_FOR_NOW``): that line is the answer, not two minutes later."""
        proc = subprocess.Popen(argv, env=self._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None
        said: list[str] = []
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or (said and REFUSED_FOR_NOW.search(said[-1])):
                    proc.kill()
                    proc.communicate()
                    if left <= 0:
                        last = [ln.strip() for ln in said if ln.strip()][-1:]
                        why = f"sbatch: no answer from the Slurm controller within {timeout:g} s" + (
                            f" (it said: {last[0]})" if last else ""
                        )
                        return subprocess.CompletedProcess(argv, 124, "", why)
                    return subprocess.CompletedProcess(argv, 75, "", "".join(said))
                if sel.select(min(left, 0.5)):
                    line = proc.stderr.readline()
                    if not line:
                        break
                    said.append(line)
        out = proc.stdout.read()
        return subprocess.CompletedProcess(argv, proc.wait(), out, "".join(said))

    # ------------------------------------------------------------------ prepare

    def _python(self, plan: Plan, log: Path | None) -> str:
        fw, vendor = plan.case.framework, plan.vendor
        if self.conf.container_runtime == "docker" and not vendor.container.mount_framework_env:
            return self.python_override or "python3"  # the image's interpreter
        if log is None:
            return self.python_override or str(python_of(env_dir(vendor.name, fw)))
        return str(framework_python(vendor.name, fw, self.python_override, log))

    def dry_prepare(self, plan: Plan) -> tuple[str, Path]:
        return self._python(plan, None), ROOT

    def prepare(self, plan: Plan, log: Path) -> tuple[str, Path]:
        missing = [c for c in CLIENTS if shutil.which(c) is None]
        if missing:
            raise InputError(f"backend slurm: {', '.join(missing)} not found on this host (Slurm client commands)")
        self._check_conf()
        ping = self._run(["scontrol", "ping"], timeout=30)
        if ping.returncode != 0 or "DOWN" in ping.stdout:
            # scontrol ping's banner of asterisks ("** RESTORE SLURMCTLD DAEMON TO SERVICE **") says nothing
            why = [ln.strip() for ln in (ping.stdout + ping.stderr).splitlines() if ln.strip() and not ln.strip().startswith("*")]
            said = next((ln for ln in why if "DOWN" in ln), why[-1] if why else f"`scontrol ping` exit status {ping.returncode}")
            raise InputError(f"backend slurm: the Slurm controller does not answer ({said})")
        if not plan.run_dir.is_absolute():
            raise InputError(f"backend slurm: run dir {plan.run_dir} must be an absolute path on a shared filesystem")
        line = self.cancel_orphans()
        if line:
            self.notes.append(line)
            print(line, file=sys.stderr, flush=True)
        return self._python(plan, log), ROOT

    def cancel_orphans(self) -> str | None:
        """Cancel the jobs that runs started from this host left behind when their start_task.py
        died (SIGKILL, a crashed machine): each job's comment names its submitter's host and pid
        (``submitter_comment``), and a pid no longer alive here means nobody follows the job.
        Jobs of other submit hosts and of live runs are never touched. One line, or None."""
        proc = self._run(["squeue", "--noheader", "--me", "--states=all", "--format=%i|%T|%Z|%k"], timeout=30)
        if proc.returncode != 0:
            return None  # the controller answered ping: a transient failure; the next run sweeps
        gone: dict[str, list[str]] = {}
        ended: list[str] = []
        for row in proc.stdout.splitlines():
            job_id, state, workdir, comment = (row.strip().split("|", 3) + ["", "", ""])[:4]
            owner = parse_comment(comment)
            if not owner or owner[0] != socket.gethostname() or _alive_pid(owner[1]):
                continue  # another host's job, or one its start_task.py still follows
            if state not in WAITING | ACTIVE:  # ended by itself (the nodes' lease lapsed, a time limit)
                if finish_abandoned(Path(workdir).parent, job_id, ended=state):
                    ended.append(f"run {owner[2]} (its Slurm job {job_id} ended {state} without it)")
            elif state != "COMPLETING" and self._run(["scancel", job_id], timeout=60).returncode == 0:
                gone.setdefault(owner[2], []).append(job_id)  # COMPLETING: its steps ended, Slurm tidies up
                finish_abandoned(Path(workdir).parent, job_id)  # the job runs in <run_dir>/round<r>
        said = []
        if gone:
            runs = "; ".join(f"job {', '.join(ids)} of run {run}" for run, ids in sorted(gone.items()))
            said.append(f"cancelled Slurm jobs whose start_task.py is gone: {runs}")
        if ended:
            said.append(f"finished the results.json of runs whose start_task.py is gone: {'; '.join(ended)}")
        return "\n".join(said) or None

    # ------------------------------------------------------------------ what a round submits

    def node_plans(self, plan: Plan, python: str, root: Path, round_dir: Path) -> list[NodePlan]:
        """The planner's node commands with the master address and port left as placeholders
        (model_copy does not validate: the port field holds the placeholder text)."""
        hosts = [HostConfig(name=f"slurm-node{k}", address=MASTER_PLACEHOLDER) for k in range(plan.case.nnodes)]
        cluster = plan.cluster.model_copy(update={"hosts": hosts, "master_port": PORT_PLACEHOLDER})
        return plan_nodes(dataclasses.replace(plan, cluster=cluster), python, root, round_dir)

    def _docker_options(self, plan: Plan, python: str, data: dict[str, Any]) -> list[str]:
        """The vendor's container options as ``docker run`` arguments, translated as the SSH
        runtime's are (remote.containers.vendor_container), with the run's mounts."""
        from run_benchmarks.running.remote.containers import Mount, docker_run_args, vendor_container

        mounts = [Mount(str(ROOT), str(ROOT), True), Mount(str(plan.run_dir), str(plan.run_dir))]
        if plan.vendor.container.mount_framework_env:  # the host-built environment and the Python it was made from
            env = Path(python).parent.parent
            home = _venv_home(env)
            mounts += [Mount(str(env), str(env), True)] + ([Mount(str(home), str(home), True)] if home else [])
        if data.get("cache_dir"):
            mounts.append(Mount(data["cache_dir"], data["cache_dir"]))
        if data.get("data_dir"):
            mounts.append(Mount(data["data_dir"], data["data_dir"], True))
        spec = vendor_container(
            plan.vendor.container, image="-", command=["-"], run_id=plan.run_id, name=None, env={}, mounts=mounts, workdir=None
        )
        return docker_run_args(spec)

    def spec(self, plan: Plan, round_dir: Path, nodes: list[NodePlan], python: str) -> dict[str, Any]:
        container = None
        if self.conf.container_runtime == "docker":
            image = (self.conf.image or "").format(vendor=plan.vendor.name, framework=plan.case.framework)
            resolved = round_dir / "resolved.json"
            data = json.loads(resolved.read_text())["data"] if resolved.is_file() else plan.settings["data"]
            container = {"runtime": "docker", "image": image, "options": self._docker_options(plan, python, data)}
        monitor = {"kind": plan.vendor.monitor, "python": self.node_python, "interval_s": 1.0, "pythonpath": str(ROOT)}
        data_spec = hostdata.node_spec(plan)
        extra: dict[str, Any] = {}
        if data_spec is not None:  # data on the nodes only: checked there before the launcher (slurm_node.check_data)
            env = {"PYTHONPATH": str(ROOT)}
            if container:  # the node's own cache (~/.cache/flagbench) is not the container's
                resolved = round_dir / "resolved.json"
                cache = (json.loads(resolved.read_text())["data"].get("cache_dir") if resolved.is_file() else None) or ""
                env["FLAGBENCH_CACHE_DIR"] = str(Path(cache) / "fingerprints") if cache else str(round_dir / "fingerprints")
            argv = hostdata.node_argv(python, data_spec)
            extra["data_check"] = {
                "argv": argv,
                "env": env,
                "cwd": str(ROOT),
                "timeout_s": self.cluster.round_timeout_s,
                "found": data_spec["found"],  # by an earlier round's nodes: this round's must find it too
            }
        return agent_spec(
            str(round_dir),
            MASTER_PLACEHOLDER,
            monitor,
            container,
            nodes,
            run_id=plan.run_id,
            port_placeholder=PORT_PLACEHOLDER,
            # the nodes stop the ranks when the orchestrator stops renewing it (running/lease.py)
            lease={"path": str(round_dir / "slurm" / LEASE_FILE), "lease_s": self.conf.lease_s},
            # the cluster file's port, checked free on node 0; None: node 0 picks a free one
            master_port=self.cluster.master_port if "master_port" in self.cluster.model_fields_set else None,
            **extra,
        )

    def job_name(self, plan: Plan, round_dir: Path) -> str:
        return f"fb-{plan.run_id}-{round_dir.name}"

    def sbatch_argv(self, plan: Plan, round_dir: Path) -> list[str]:
        c, n = self.conf, plan.case.nnodes
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={self.job_name(plan, round_dir)}",
            f"--nodes={n}",
            "--ntasks-per-node=1",
            f"--time={c.time_limit}",
            "--no-requeue",
            f"--chdir={round_dir}",
            f"--output={round_dir / 'slurm' / 'job-%j.out'}",
            f"--comment={submitter_comment(plan.run_id)}",
        ]
        if c.exclusive:
            argv.append("--exclusive")
        if c.partition:
            argv.append(f"--partition={c.partition}")
        if c.account:
            argv.append(f"--account={c.account}")
        if "hosts" in self.cluster.model_fields_set:  # named hosts pin the job to those nodes
            argv.append("--nodelist=" + ",".join(h.name for h in self.cluster.hosts[:n]))
        return argv + list(c.extra_sbatch) + [str(round_dir / "slurm" / "job.sh")]

    def srun_argv(self, plan: Plan, round_dir: Path) -> list[str]:
        n = plan.case.nnodes
        return [
            "srun",
            f"--nodes={n}",
            f"--ntasks={n}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            *self.conf.srun_extra,
            self.node_python,
            "-m",
            "run_benchmarks.running.slurm_node",
            "--spec",
            str(round_dir / "slurm" / "spec.json"),
        ]

    def batch_script(self, plan: Plan, round_dir: Path) -> str:
        q = shlex.quote
        srun = self.srun_argv(plan, round_dir)
        spec = round_dir / "slurm" / "spec.json"
        # every CPU the job has on a node goes to that node's one task (the launcher's ranks)
        srun_line = f'{shlex.join(srun[:5])} --cpus-per-task="$SLURM_CPUS_ON_NODE" {shlex.join(srun[5:])}'
        return "\n".join(
            [
                "#!/bin/bash",
                f"# flagbench {plan.run_id} {round_dir.name}: {plan.case} on {plan.case.nnodes} node(s), one task per node",
                f"# submitted as: {shlex.join(self.sbatch_argv(plan, round_dir))}",
                "set -u",
                f"if [ ! -r {q(str(spec))} ]; then",
                (
                    f'  echo "flagbench: {q(str(spec))} is not readable on $(hostname): the run directory must be on a'
                    ' filesystem shared by the submit host and every node" >&2'
                ),
                f"  exit {EXIT_NO_SPEC}",
                "fi",
                f'export PYTHONPATH={q(str(ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
                f"exec {srun_line}",
                "",
            ]
        )

    def dry_run_details(self, plan: Plan, rnd: RoundPlan | None = None) -> dict[str, Any]:
        rnd = rnd or self.dry_round(plan)
        round_dir, python, nodes = rnd.dir, rnd.python, list(rnd.nodes)
        return {
            "backend": "slurm",
            "sbatch": self.sbatch_argv(plan, round_dir),
            "script": self.batch_script(plan, round_dir),
            "srun": self.srun_argv(plan, round_dir),
            "master": (
                f"address of the allocation's first node (Slurm's NodeAddr), in place of {MASTER_PLACEHOLDER!r}; "
                f"port chosen on it, in place of {PORT_PLACEHOLDER!r}; node rank = SLURM_NODEID"
            ),
            "spec": self.spec(plan, round_dir, nodes, python),
        }

    # ------------------------------------------------------------------ a round

    def run_round(self, plan: Plan, rnd: RoundPlan, timeout_s: float) -> list[NodeOutcome]:
        round_dir, python, planned = rnd.dir, rnd.python, list(rnd.nodes)
        slurm_dir = round_dir / "slurm"
        slurm_dir.mkdir(parents=True, exist_ok=True)
        for n in planned:  # the layout the orchestrator reads, even if a node never writes
            (round_dir / f"node{n.node_rank}" / "ranks").mkdir(parents=True, exist_ok=True)
            (round_dir / f"node{n.node_rank}" / "stdout.log").touch()
        spec = self.spec(plan, round_dir, planned, python)
        if spec["container"]:  # a volume docker would otherwise create as an empty root-owned dir
            cache = json.loads((round_dir / "resolved.json").read_text())["data"].get("cache_dir")
            if cache:
                Path(cache).mkdir(parents=True, exist_ok=True)
        (slurm_dir / "spec.json").write_text(json.dumps(spec, indent=2))
        (slurm_dir / "job.sh").write_text(self.batch_script(plan, round_dir))
        self.aborted = None
        if self.gave_up and self._run(["scontrol", "ping"], timeout=30).returncode != 0:
            return [
                NodeOutcome("no job submitted", n.node_rank, None, False, round_dir / f"node{n.node_rank}", f"not started: {self.gave_up}")
                for n in planned
            ]
        self.lease = lease.Renewer(slurm_dir / LEASE_FILE)
        self.lease.start()
        try:
            job = self._submit(plan, round_dir)
            try:
                self._follow(job, time.monotonic() + timeout_s, slurm_dir / f"job-{job.job_id}.out")
            except KeyboardInterrupt:
                self._interrupted(job, round_dir)
                raise
            self._wait_gone(job, LOST_GONE_WAIT_S if job.lost else LAUNCH_FAILED_GONE_WAIT_S if job.launch_failure else GONE_WAIT_S)
        finally:
            self.lease.stop()
        return self._outcomes(plan, job, round_dir)

    def round_data(self, plan: Plan, rnd: RoundPlan) -> list[tuple[str, dict[str, Any]]] | None:
        """The nodes' data checks of the round's job (``node<k>/data.json``, slurm_node.check_data),
        by node rank; None where a node wrote none (the job did not get that far). InputError
        naming the node whose data is missing or bad."""
        out = []
        for n in rnd.nodes:
            try:
                said = json.loads((rnd.dir / f"node{n.node_rank}" / "data.json").read_text())
            except (OSError, ValueError):
                return None
            out.append((str(said["node"]), hostdata.report(str(said["node"]), said["rc"], said["stdout"], said["stderr"])))
        return out

    def _submit(self, plan: Plan, round_dir: Path) -> Job:
        argv = self.sbatch_argv(plan, round_dir)
        name = self.job_name(plan, round_dir)
        # known by name before its id is: an interrupt during sbatch still finds the job
        placeholder = Job("", name, round_dir.name, plan.case.nnodes, time.time())
        self.jobs.append(placeholder)
        proc = self._sbatch(argv, timeout=SBATCH_TIMEOUT_S)
        if proc.returncode in (75, 124):  # sbatch ended here: a job it was submitting meanwhile goes too
            self._cancel(placeholder, "refused")
        if proc.returncode != 0:
            self.jobs.remove(placeholder)
            said = " ".join(ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip())
            if proc.returncode == 75:
                raise InputError(
                    f"the Slurm controller refused the job for now ({said}): its job limit (MaxJobCount) reached, "
                    f"or it is overloaded; sbatch stopped (submitted: {shlex.join(argv)})"
                )
            unknown = self._unknown_hosts(plan) if "Invalid node name" in said else []
            if unknown:
                raise InputError(
                    f"sbatch refused the job: {said}: {', '.join(unknown)} of the cluster file's hosts "
                    f"{'is not a node' if len(unknown) == 1 else 'are not nodes'} of this Slurm cluster (not in its slurm.conf)"
                )
            raise InputError(f"sbatch refused the job: {said} (submitted: {shlex.join(argv)})")
        placeholder.job_id = proc.stdout.strip().split(";")[0]
        return placeholder

    def _unknown_hosts(self, plan: Plan) -> list[str]:
        """The hosts the job is pinned to (``--nodelist``) that the controller does not know."""
        names = [h.name for h in self.cluster.hosts[: plan.case.nnodes]] if "hosts" in self.cluster.model_fields_set else []
        unknown = []
        for name in names:
            proc = self._run(["scontrol", "show", "node", "-o", name], timeout=30)
            if proc.returncode != 0 and f"Node {name} not found" in proc.stdout + proc.stderr:
                unknown.append(name)
        return unknown

    def _show(self, job: Job) -> None:
        asked = time.monotonic()
        proc = self._run(["scontrol", "show", "job", "-o", job.job_id], timeout=self._poll_timeout())
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            if self.silent_since is None:
                self.silent_since = asked
            self.silent_error = f"`{shlex.join(proc.args)}`: {slurm_error(proc)}"
            if proc.returncode == 124:  # no word at all (a munged whose socket is left refuses; Slurm retries for a minute)
                self.silent_error += self._munge_says()
            return  # a controller hiccup: read it again next time, until unreachable_s
        self.silent_since = None
        if proc.returncode != 0:
            job.state = GONE if job.state in WAITING | ACTIVE else job.state
            return
        info = parse_show_job(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "")
        job.state = info.get("JobState", job.state)
        if job.state == "NODE_FAIL" and job.failed_nodes is None:
            job.failed_nodes = self._out_of_service(self._hostnames(job.nodelist or info.get("NodeList", "")))
        job.reason = info.get("Reason", job.reason)
        job.exit_code = info.get("ExitCode", job.exit_code)
        job.time_limit = info.get("TimeLimit", job.time_limit)
        job.partition = info.get("Partition", job.partition)
        job.num_nodes = info.get("NumNodes", job.num_nodes)
        if info.get("NodeList") and info["NodeList"] != "(null)" and not job.nodelist:
            job.nodelist = info["NodeList"]  # the allocation (it shrinks while nodes complete)
        job.batch_host = info.get("BatchHost", job.batch_host)
        if info.get("ReqNodeList") and info["ReqNodeList"] != "(null)":
            job.req_nodes = info["ReqNodeList"]

    def _follow(self, job: Job, deadline: float, batch_out: Path) -> None:
        while True:
            self._show(job)
            if self.silent_since is not None and self._unreachable(job, batch_out.parent.parent):
                return
            if job.state in ACTIVE and job.running_at is None:
                job.running_at = time.time()
            if job.state == "RUNNING" and not self.conf.exclusive and job.nodelist:
                self._note_sharers(job)
            if job.state == "RUNNING" and self._lost_peers(job, batch_out.parent.parent):
                self._cancel(job, "node lost")
                return
            if job.state in ACTIVE and job.launch_failure is None:
                job.launch_failure = launch_failure(batch_out)
                if job.launch_failure:  # the step cannot run on every node: no use waiting for it
                    self._cancel(job, "launch failed")
                    return
            if job.state == "COMPLETING":  # its steps ended; a node that does not confirm keeps it so
                job.completing_since = job.completing_since or time.monotonic()
                if time.monotonic() - job.completing_since > SILENT_CHECK_AFTER_S and job.stopped_by_harness is None:
                    self._check_silent(job)
            if job.state not in WAITING | ACTIVE or job.silent_nodes:
                job.ended_at = time.time()
                job.launch_failure = job.launch_failure or launch_failure(batch_out)
                return
            if job.state in WAITING and job.unavailable is None and UNAVAILABLE_REASON.match(job.reason):
                job.unavailable = self._unavailable_nodes(job)
                if job.unavailable:  # it can never start: no use waiting for the deadline
                    self._cancel(job, "node unavailable")
                    return
            if job.state in WAITING and job.unavailable is None and PARTITION_REASON.fullmatch(job.reason):
                job.unavailable = self._partition_refuses(job)
                if job.unavailable:
                    self._cancel(job, "partition limit")
                    return
            if time.monotonic() > deadline:
                self._cancel(job, "round deadline")
                return
            if self.aborted:
                self._cancel(job, "aborted")
                return
            time.sleep(self.conf.poll_interval_s)

    def _poll_timeout(self) -> float:
        return min(30.0, self.conf.unreachable_s / 2)

    def _munge_says(self) -> str:
        """ "; `munge -n`: <its error>" when munge cannot make a credential here (its socket
        as slurm.conf's AuthInfo names it), else ""."""
        conf = Path(self._env().get("SLURM_CONF") or "/etc/slurm/slurm.conf")
        try:
            text = conf.read_text(errors="replace")
        except OSError:
            text = ""
        sock = re.search(r"^\s*AuthInfo\s*=\s*\S*?socket=([^,\s]+)", text, re.M | re.I)
        argv = ["munge", "-n", *(["--socket", sock.group(1)] if sock else [])]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        if proc.returncode == 0:
            return ""
        said = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()][-1:]
        return f"; `{shlex.join(argv)}`: {said[0].removeprefix('munge: Error: ') if said else f'exit status {proc.returncode}'}"

    def _unreachable(self, job: Job, round_dir: Path) -> bool:
        """Slurm's commands fail (munge lost, the controller gone): said once, then, after
        ``unreachable_s``, the job is given up: the lease ended (the nodes stop their ranks
        themselves, running/lease.py), scancel tried once, the nodes' reports awaited briefly."""
        assert self.silent_since is not None
        waited = time.monotonic() - self.silent_since
        if not self.said_silent and waited >= 2 * self.conf.poll_interval_s:
            self.said_silent = True
            print(
                f"Slurm job {job.job_id}: Slurm does not answer ({self.silent_error}); trying for {self.conf.unreachable_s:g} s",
                file=sys.stderr,
                flush=True,
            )
        if waited < self.conf.unreachable_s:
            return False
        job.unreachable = f"Slurm did not answer the harness for {self.conf.unreachable_s:g} s ({self.silent_error})"
        self.gave_up = job.unreachable
        self._cancel(job, "slurm unreachable")
        self._await_nodes_stopped(job, round_dir)
        return True

    def _await_nodes_stopped(self, job: Job, round_dir: Path) -> None:
        """The nodes' own stop of their ranks, the lease ended (their reports), within the
        lease's bound: what ends the job where Slurm does not answer."""
        end = time.monotonic() + lease.CHECK_S + STOP_GRACE_S + 10
        while (
            time.monotonic() < end
            and len([r for r in _read_reports(round_dir, job.nnodes, False).values() if r.get("finished")]) < job.nnodes
        ):
            time.sleep(0.5)
        job.ended_at = time.time()

    def _interrupted(self, job: Job, round_dir: Path) -> None:
        """Ctrl-C: the lease ended at once (the nodes stop their ranks themselves) and scancel
        given ``INTERRUPT_CANCEL_S``. Where it did not reach Slurm (munge lost, the controller
        silent), the nodes' stop is awaited, not Slurm's answers."""
        self._cancel(job, "interrupted", timeout=INTERRUPT_CANCEL_S)
        if job.cancel_failed:
            self._await_nodes_stopped(job, round_dir)
        else:
            self._wait_gone(job)

    def node_states(self, nodes: str) -> list[dict[str, str]]:
        """``scontrol show node -o`` of a node list: each node's fields (NodeName, State, Reason)."""
        proc = self._run(["scontrol", "show", "node", "-o", nodes], timeout=30)
        return [parse_show_job(ln) for ln in proc.stdout.splitlines() if ln.strip()] if proc.returncode == 0 else []

    def _unavailable_nodes(self, job: Job) -> str | None:
        """ "node n2 is DOWN (reason: ...)" for each node the job asked for that cannot serve."""
        if not job.req_nodes:
            return None
        bad = [n for n in self.node_states(job.req_nodes) if set(re.split(r"[+*~#$@%!^-]", n.get("State", ""))) & OUT_OF_SERVICE]
        said = [f"node {n.get('NodeName')} is {n.get('State')}" + (f" (reason: {n['Reason']})" if n.get("Reason") else "") for n in bad]
        return "; ".join(said) or None

    def _partition_refuses(self, job: Job) -> str | None:
        """What of the job's partition keeps it pending (its reason one of ``PARTITION_REASON``):
        "its time limit 00:10:00 is above partition debug's MaxTime 00:01:00 (PartitionTimeLimit)"."""
        proc = self._run(["scontrol", "show", "partition", "-o", job.partition], timeout=30)
        if proc.returncode != 0 or not job.partition:
            return None  # the controller did not answer: read again at the next poll
        part = parse_show_job(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "")
        name, why = job.partition, f"({job.reason})"
        if job.reason == "PartitionTimeLimit":
            return f"its time limit {job.time_limit} is above partition {name}'s MaxTime {part.get('MaxTime', '?')} {why}"
        if job.reason in ("PartitionDown", "PartitionInactive"):
            return f"partition {name} is {part.get('State', job.reason.removeprefix('Partition').upper())} {why}"
        asked = job.num_nodes.split("-")[0] or str(job.nnodes)
        wanted = int(asked) if asked.isdigit() else job.nnodes
        limits = [
            (key, int(part[key]), op)
            for key, op in (("TotalNodes", "has"), ("MaxNodes", "allows at most"), ("MinNodes", "needs at least"))
            if part.get(key, "").isdigit()
        ]
        for key, value, op in limits:
            if (key != "MinNodes" and wanted > value) or (key == "MinNodes" and wanted < value):
                return f"it asks for {wanted} node{'s' * (wanted != 1)}, partition {name} {op} {value} ({key} {value}) {why}"
        return f"partition {name} refuses it as asked: {job.num_nodes} nodes, time limit {job.time_limit} {why}"

    def _note_sharers(self, job: Job) -> None:
        """Other jobs running on the job's nodes (``exclusive: false``): its figures are not
        of whole nodes."""
        proc = self._run(["squeue", "--noheader", "--states=RUNNING", f"--nodelist={job.nodelist}", "--format=%i"], timeout=30)
        if proc.returncode == 0:
            job.shared_with |= {i.strip() for i in proc.stdout.split() if i.strip() and i.strip() != job.job_id}

    def _check_silent(self, job: Job) -> None:
        job.silent_nodes = self._silent_nodes(job)
        if job.silent_nodes:
            print(f"Slurm job {job.job_id}: {job.silent_nodes}; not waiting for Slurm to end the job", file=sys.stderr, flush=True)

    def _silent_nodes(self, job: Job) -> str | None:
        """ "node n2 has not confirmed the job's end ..." for each node the ended job still
        holds (the allocation shrinks as nodes confirm)."""
        proc = self._run(["squeue", "--noheader", "--jobs", job.job_id, "--states=COMPLETING", "--format=%N"], timeout=30)
        held = proc.stdout.strip() if proc.returncode == 0 else ""
        said = [
            f"node {n.get('NodeName')} has not confirmed the job's end within {SILENT_CHECK_AFTER_S:g} s "
            f"(state {n.get('State')}): is its slurmd running?"
            for n in (self.node_states(held) if held else [])
        ]
        return "; ".join(said) or None

    def _lost_peers(self, job: Job, round_dir: Path) -> bool:
        """Once a node's launcher has ended, the nodes whose launchers have not ended
        ``PEER_LOST_S`` later (srun stops the others at once when one fails) are lost: named in
        ``job.lost`` with what Slurm says of them."""
        reports = _read_reports(round_dir, job.nnodes, wait=False)
        ended = sorted((r["finished"], k) for k, r in reports.items() if r.get("finished"))
        if not ended:
            return False
        now = time.monotonic()
        job.first_end_seen = job.first_end_seen or now
        if now - job.first_end_seen < PEER_LOST_S:
            return False
        hosts = self._node_names(job.nodelist, job.nnodes)
        first = reports[ended[0][1]].get("slurm_node") or f"node {ended[0][1]}"
        for k in range(job.nnodes):
            if not reports.get(k, {}).get("finished"):
                host = reports.get(k, {}).get("slurm_node") or hosts[k]
                state = next((n.get("State", "") for n in self.node_states(host)), "") or "unknown"
                job.lost[k] = (
                    f"node {host} lost: its launcher had not ended {PEER_LOST_S:g} s after {first}'s (Slurm's node state: {state})"
                )
        return bool(job.lost)

    def _cancel(self, job: Job, why: str, timeout: float | None = None) -> None:
        if self.lease is not None:  # the nodes stop the ranks themselves too, should scancel not reach Slurm
            self.lease.end(why)
        if job.stopped_by_harness is None:
            job.stopped_by_harness = why
            job.state_at_cancel = f"{job.state} ({job.reason})" if job.reason and job.reason != "None" else job.state
        target = [job.job_id] if job.job_id else [f"--name={job.name}"]
        if timeout is None:
            timeout = self._poll_timeout() if self.silent_since is not None else 60
        proc = self._run(["scancel", *target], timeout=timeout)
        if proc.returncode == 0:
            job.cancelled_by_harness = job.cancelled_by_harness or job.stopped_by_harness
        elif job.cancel_failed is None and "already complet" not in proc.stderr:  # never a cancel recorded that was not made
            job.cancel_failed = f"`{shlex.join(proc.args)}`: {slurm_error(proc)}"
            if job.job_id:
                print(
                    f"Slurm job {job.job_id} could not be cancelled ({job.cancel_failed}): it may still be running, "
                    f"its nodes told to stop the ranks through the run's lease; cancel it with `scancel {job.job_id}` once Slurm answers",
                    file=sys.stderr,
                    flush=True,
                )

    def _listed(self, job: Job) -> bool | None:
        """Whether squeue lists the job; None where it does not answer."""
        target = ["--jobs", job.job_id] if job.job_id else ["--name", job.name]
        proc = self._run(["squeue", "--noheader", "--format=%i %T", *target], timeout=30)
        return bool(proc.stdout.strip()) if proc.returncode == 0 else None

    def _alive(self, job: Job) -> bool:
        return self._listed(job) is True

    def _wait_gone(self, job: Job, limit: float = GONE_WAIT_S) -> None:
        """Until squeue no longer lists the job (its steps and processes are gone), or one of
        its nodes no longer answers the controller (its slurmd gone: the job would stay
        COMPLETING until Slurm marks the node down), which is said, naming the node."""
        if job.unreachable:
            return  # not known to be gone: Slurm is not asked again
        start = time.monotonic()
        listed = self._listed(job)
        while listed is not False and time.monotonic() < start + limit and not job.silent_nodes:
            if time.monotonic() - start > SILENT_CHECK_AFTER_S and job.stopped_by_harness is None:
                self._check_silent(job)
            time.sleep(min(self.conf.poll_interval_s, 0.5))
            listed = self._listed(job)
        if listed is None:
            return  # not known to be gone: squeue did not answer
        job.gone_at = time.time()
        if job.ended_at is None:
            job.ended_at = job.gone_at
        self._show(job)

    def _out_of_service(self, hosts: list[str]) -> dict[str, str]:
        """Those of ``hosts`` out of service now, each with what Slurm says of it
        ("DOWN+NOT_RESPONDING (reason: ...)")."""
        if not hosts:
            return {}
        said = {}
        for n in self.node_states(",".join(hosts)):
            if set(re.split(r"[+*~#$@%!^-]", n.get("State", ""))) & OUT_OF_SERVICE:
                said[n.get("NodeName", "")] = n.get("State", "") + (f" (reason: {n['Reason']})" if n.get("Reason") else "")
        return said

    def _outcomes(self, plan: Plan, job: Job, round_dir: Path) -> list[NodeOutcome]:
        hosts = self._node_names(job.nodelist, job.nnodes)
        reports = _read_reports(round_dir, job.nnodes, wait=job.state == "COMPLETED")
        if job.state == "NODE_FAIL" and not job.failed_nodes:  # no node out of service any more: srun named it
            job.failed_nodes = self._failed_in_service(round_dir / "slurm" / f"job-{job.job_id}.out")
        failed = job.failed_nodes or {}
        started = [r["started"] for r in reports.values() if r.get("started")]
        finished = [r["finished"] for r in reports.values() if r.get("finished")]
        job.nodes_started_at = min(started) if started else None
        job.nodes_finished_at = max(finished) if finished else None
        job.first_step_at = _first_step_time(round_dir)
        batch_out = round_dir / "slurm" / f"job-{job.job_id}.out"
        outcomes = []
        for k in range(job.nnodes):
            rep = reports.get(k)
            host = (rep or {}).get("slurm_node") or hosts[k]
            rc = rep.get("returncode") if rep else None
            extra = {
                "slurm_job_id": job.job_id,
                "slurm_state": job.state,
                "slurm_reason": job.reason,
                "slurm_exit_code": job.exit_code,
                "slurm_node": host,
            }
            if job.shared_with:  # beside the round's figures: they are not of whole nodes
                extra[SHARED_KEY] = [f"Slurm job {i}" for i in sorted(job.shared_with, key=int)]
            error, timed_out = None, False
            if job.unreachable:
                stopped = sum(1 for r in reports.values() if r.get("finished"))
                fate = (
                    "cancelled"
                    if job.cancelled_by_harness
                    else f"may still be running: cancel it with `scancel {job.job_id}` once Slurm answers"
                )
                error = f"{job.unreachable}; the nodes stopped their ranks through the run's lease ({stopped} of {job.nnodes} confirmed); Slurm job {job.job_id} {fate}"
                extra[causes.LOST_KEY] = True  # the cause: it leads the ranks' errors that follow the stop
            elif k in job.lost:
                error, extra[causes.LOST_KEY] = f"{job.lost[k]}; Slurm job {job.job_id} cancelled", True
            elif job.lost:
                error = None  # stopped because the lost node's ranks were gone: its exit status says so
            elif job.unavailable:
                error = f"Slurm job {job.job_id} can never start: {job.unavailable}; cancelled"
            elif job.launch_failure:
                error = f"Slurm job {job.job_id} could not start its step: {job.launch_failure}"
            elif rep is not None and rep.get("error"):  # the node wrapper said why it stopped
                error = f"{rep['error']} (Slurm job {job.job_id})"
            elif job.stopped_by_harness == "aborted":
                error = f"{self.aborted} (Slurm job {job.job_id} cancelled)"
            elif job.stopped_by_harness == "round deadline":
                timed_out = True
                if job.running_at is None:
                    error = f"Slurm job {job.job_id} still {job.state_at_cancel} when the round deadline passed; cancelled"
            elif job.state == "TIMEOUT":
                timed_out = True
                error = f"Slurm job {job.job_id} reached its time limit {job.time_limit or self.conf.time_limit} (TIMEOUT)"
            elif job.state == "CANCELLED":
                error = f"Slurm job {job.job_id} was CANCELLED outside the harness"
            elif host in failed:  # the node Slurm's NODE_FAIL was for leads the round's error
                error, extra[causes.LOST_KEY] = f"Slurm job {job.job_id} ended NODE_FAIL: node {host} is {failed[host]}", True
            elif failed:
                error = f"stopped: Slurm job {job.job_id} ended NODE_FAIL for node {', '.join(sorted(failed))}"
            elif job.state in ENDED_BY_SLURM:
                error = f"Slurm job {job.job_id} ended {job.state} (reason {job.reason})"
            elif rep is None:
                error = _no_report(job, k, host, plan.run_dir, batch_out)
            elif rc is None:
                error = f"node report says it never finished (job {job.job_id} {job.state})"
            outcomes.append(NodeOutcome(host, k, rc, timed_out, round_dir / f"node{k}", error, extra))
        return outcomes

    def _failed_in_service(self, batch_out: Path) -> dict[str, str]:
        """The nodes srun saw fail (``NODE_FAILURE``) that Slurm has back in service already,
        with their state now: under ``ReturnToService=2`` a node an administrator set DOWN is
        back as soon as its slurmd answers, its reason gone (under 0 or 1 it stays DOWN, and
        ``_out_of_service`` gives the reason)."""
        try:
            names = dict.fromkeys(NODE_FAILURE.findall(batch_out.read_text(errors="replace")))
        except OSError:
            return {}
        states = {n.get("NodeName", ""): n.get("State", "") for n in self.node_states(",".join(names))} if names else {}
        return {
            name: f"{states.get(name) or 'unknown'} again (srun: Node failure on {name}; Slurm put it back in service, its reason gone)"
            for name in names
        }

    def _node_names(self, nodelist: str, nnodes: int) -> list[str]:
        """The job's nodes by name, as many as it has: Slurm's names, else "not allocated" (Slurm
        gave the job no nodes) or "one of <its node list>" (scontrol could not expand it)."""
        hosts = self._hostnames(nodelist)[:nnodes]
        return hosts + ["one of " + nodelist if nodelist else "not allocated"] * (nnodes - len(hosts))

    def _hostnames(self, nodelist: str) -> list[str]:
        if not nodelist:
            return []
        proc = self._run(["scontrol", "show", "hostnames", nodelist], timeout=30)
        return proc.stdout.split() if proc.returncode == 0 else []

    # ------------------------------------------------------------------ facts and teardown

    def describe(self) -> dict[str, Any]:
        c = self.conf
        return {
            "slurm": {
                "partition": c.partition,
                "account": c.account,
                "time_limit": c.time_limit,
                "container_runtime": c.container_runtime,
                "image": c.image,
                "exclusive": c.exclusive,
                "node_python": self.node_python,
                "jobs": [j.summary() for j in self.jobs if j.job_id],
            },
            "leftovers_removed": list(self.notes),
        }

    def host_memory(self) -> dict[str, int]:
        return {}  # the nodes are known once the job runs: not checked before

    def running_since(self) -> float | None:
        job = next((j for j in reversed(self.jobs) if j.gone_at is None), None)
        if job is None or job.running_at is None:
            return float("inf")  # queued: the startup clock has not started
        return job.running_at

    def note(self) -> str | None:
        """The round's job: "Slurm job 57 PENDING (Resources)", "Slurm job 57 RUNNING on n[1-2]"."""
        job = next((j for j in reversed(self.jobs) if j.job_id and j.gone_at is None), None)
        if job is None:
            return None
        text = f"Slurm job {job.job_id} {job.state}"
        if job.state in WAITING and job.reason and job.reason != "None":
            text += f" ({job.reason})"
        elif job.state in ACTIVE and job.nodelist:
            text += f" on {job.nodelist}"
        return text

    def cleanup(self) -> None:
        for job in self.jobs:  # a job whose cancel failed was named already, with the command to cancel it
            if job.gone_at is None and not job.unreachable and not job.cancel_failed and self._alive(job):
                self._cancel(job, "cleanup")
                self._wait_gone(job, limit=30.0)


COMMENT_TAG = "flagbench"


def submitter_comment(run_id: str) -> str:
    """A job's comment: who follows it ("flagbench submitter=HOST:PID run=RUN_ID")."""
    return f"{COMMENT_TAG} submitter={socket.gethostname()}:{os.getpid()} run={run_id}"


#: the lines of a failing Slurm command that say why, most telling first
_WHY = (
    re.compile(r"[Mm]unge \w+ failed"),
    re.compile(r"Unable to contact|Connection refused|no answer|timed out"),
    re.compile(r"authentication"),
)


def slurm_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The line of a failed Slurm command that says why, its "scontrol: error: " cut."""
    lines = [ln.strip() for ln in ((proc.stderr or "") + "\n" + (proc.stdout or "")).splitlines() if ln.strip()]
    line = next((ln for pat in _WHY for ln in lines if pat.search(ln)), lines[-1] if lines else f"exit status {proc.returncode}")
    return re.sub(r"^\S+: error: ", "", line)


def parse_comment(comment: str) -> tuple[str, int, str] | None:
    """(host, pid, run id) of a ``submitter_comment``; None for any other comment."""
    m = re.fullmatch(rf"{COMMENT_TAG} submitter=(\S+):(\d+) run=(\S+)", comment.strip())
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def _alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_jobs(cluster: ClusterConfig) -> list[str]:
    """``start_task.py --cluster FILE --cleanup`` for a Slurm cluster: the jobs of runs whose
    start_task.py is gone, cancelled (``SlurmRuntime.cancel_orphans``)."""
    rt = SlurmRuntime(cluster)
    missing = [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        raise InputError(f"backend slurm: {', '.join(missing)} not found on this host (Slurm client commands)")
    rt._check_conf()
    line = rt.cancel_orphans()
    return [line] if line else []


def finish_abandoned(run_dir: Path, job_id: str, ended: str | None = None) -> bool:
    """The results.json of a run whose start_task.py died while its job ran: finished as
    failed, saying so, when it still says running (another run's or a finished file is kept).
    ``ended``: the job's state when it ended by itself (None: --cleanup cancelled it). Whether
    it was finished."""
    from run_benchmarks.running import orphans

    res = orphans.left_running(run_dir)
    if res is None:  # another run's or a finished file, or none: nothing of ours to finish
        return False
    error = f"start_task.py ended without finishing the run; its Slurm job {job_id} was cancelled by --cleanup"
    if ended:
        lapsed = any("lease_lapsed" in _json(f) for f in run_dir.glob("round*/node*/node.json"))
        error = f"start_task.py ended without finishing the run; its Slurm job {job_id} ended {ended} without it" + (
            ": its nodes stopped the ranks when the run's lease lapsed" if lapsed else ""
        )
    orphans.mark_failed(run_dir, res, error)
    return True


def _json(path: Path) -> dict[str, Any]:
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


def _venv_home(env: Path) -> Path | None:
    """The installation a virtualenv was made from (``home`` in pyvenv.cfg), one level up from bin."""
    cfg = env / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    for line in cfg.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return Path(value.strip()).parent
    return None


def _read_reports(round_dir: Path, nnodes: int, wait: bool) -> dict[int, dict[str, Any]]:
    end = time.monotonic() + (REPORT_WAIT_S if wait else 0.0)
    while True:
        reports = {}
        for k in range(nnodes):
            try:
                reports[k] = json.loads((round_dir / f"node{k}" / "node.json").read_text())
            except (OSError, ValueError):
                pass
        if len(reports) == nnodes or time.monotonic() >= end:
            return reports
        time.sleep(0.2)


def _no_report(job: Job, k: int, host: str, run_dir: Path, batch_out: Path) -> str:
    lines = batch_out.read_text(errors="replace").splitlines()[-TAIL:] if batch_out.is_file() else []
    text = "\n".join(lines)
    if not batch_out.is_file() or job.exit_code.startswith(f"{EXIT_NO_SPEC}:") or "filesystem shared by" in text:
        hint = (
            f"; nothing came back from {host}: the run directory {run_dir} must be on a filesystem "
            "shared by this host and every node (docs/slurm.md)"
        )
    elif job.exit_code.startswith(f"{EXIT_BAD_ALLOCATION}:"):
        hint = "; the allocation did not match the plan (one task per node)"
    else:
        hint = ""
    tail = f"\n{batch_out.name}:\n{text}" if text else ""
    return f"no report from node {k} (Slurm job {job.job_id} {job.state}, exit code {job.exit_code}){hint}{tail}"


def launch_failure(batch_out: Path) -> str | None:
    """srun's word that it could not start the step on a node, as one line, or None."""
    try:
        text = batch_out.read_text(errors="replace")
    except OSError:
        return None
    task = TASK_LAUNCH_FAILED.search(text)
    if task:
        return f"srun could not launch on node {task.group(1)} ({task.group(2).strip()}): is slurmd running there?"
    app = APP_LAUNCH_FAILED.search(text)
    return f"srun: Application launch failed ({app.group(1).strip()})" if app else None


def _first_step_time(round_dir: Path) -> float | None:
    ranks = round_dir / "node0" / "ranks"
    files = [p for p in ranks.rglob("*") if p.is_file()] if ranks.is_dir() else []
    times = [r.t for f in files for r in ml.parse_file(f).of(ml.EV_STEP, ml.K_TRAIN_STEP)]
    return min(times) if times else None
