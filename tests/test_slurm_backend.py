"""The slurm backend on a real Slurm cluster (munged, slurmctld, two slurmd nodes on this machine).

The tiny llama3 case runs as ``llama3_tiny:megatron:cpu:2:1`` (two nodes, one gloo
process each) through start_task.py with a cluster file ``backend: slurm``: a clean run,
a run whose node-1 rank dies, a run that hits its Slurm time limit, and a run
interrupted with SIGINT. The unit tests at the top need neither Slurm nor a framework.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.planning.config import ClusterConfig, load
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running.runtimes.slurm import MASTER_PLACEHOLDER, SlurmRuntime, parse_show_job
from run_benchmarks.running.slurm_node import EXIT_NO_SPEC
from tests.slurm.cluster import KNOWN_NAMES, SlurmTestCluster
from tests.slurm.fixtures import slurm_cluster_fixture  # noqa: F401  (the session fixture slurm_cluster)
from training import metriclog as ml

START = str(ROOT / "run_benchmarks" / "start_task.py")
CASE = "llama3_tiny:megatron:cpu:2:1"
LONG = "train.steps=3000"  # a run that outlives what the test does to it
#: LONG with a sleep after each step (vendors/cpu/pace.py): it waits on what is done to it, not on the cores
PACED = ("--variant", "paced", "--set", LONG)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_file(tmp: Path, conf: Path | None, port: bool = True, **slurm: Any) -> Path:
    data = {
        "backend": "slurm",
        # the planner counts hosts against nnodes; named hosts also pin the job (--nodelist)
        "hosts": [{"name": "n1", "address": "127.0.0.2"}, {"name": "n2", "address": "127.0.0.3"}],
        **({"master_port": _port()} if port else {}),  # without: node 0 picks a free one
        "round_timeout_s": 600,
        "slurm": {"time_limit": "00:10:00", **({"slurm_conf": str(conf)} if conf else {}), **slurm},
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_argv(tmp: Path, cfile: Path, python: str, *extra: str) -> list[str]:
    """start_task.py running the test case on the cluster file's Slurm cluster, logs under ``tmp``."""
    return [sys.executable, START, "--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile)] + [
        "--log-dir",
        str(tmp / "logs"),
        "--python",
        python,
        *extra,
    ]


def start(tmp: Path, cfile: Path, python: str, *extra: str) -> subprocess.Popen[str]:
    argv = start_argv(tmp, cfile, python, *extra)
    env = {**os.environ, "FLAGBENCH_PROGRESS_EVERY_S": "1"}  # the plain progress line every second
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(what: str, pred: Callable[[], Any], proc: subprocess.Popen[str], timeout: float = 300) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"start_task exited ({proc.returncode}) before {what}:\n{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"no {what} after {timeout:.0f} s")


def run_dir(tmp: Path) -> Path | None:
    dirs = [p for p in (tmp / "logs").glob("*") if p.is_dir()] if (tmp / "logs").is_dir() else []
    return dirs[0] if dirs else None


def first_step(tmp: Path) -> bool:
    rd = run_dir(tmp)
    ranks = rd / "round1" / "node0" / "ranks" if rd else None
    if not ranks or not ranks.is_dir():
        return False
    return any(ml.parse_file(f).of(ml.EV_STEP) for f in ranks.rglob("*.log") if f.is_file())


def job_id(tmp: Path) -> str | None:
    rd = run_dir(tmp)
    outs = list((rd / "round1" / "slurm").glob("job-*.out")) if rd else []
    return outs[0].stem.removeprefix("job-") if outs else None


def results(tmp: Path) -> dict[str, Any]:
    rd = run_dir(tmp)
    assert rd is not None
    return json.loads((rd / "results.json").read_text())


def processes_of(run_id: str) -> list[str]:
    """Command lines on this machine that mention the run (launchers, ranks, node wrappers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if run_id in cmd:
                found.append(f"{entry.name}: {cmd}")
    return found


def assert_nothing_left(cluster: SlurmTestCluster, run_id: str) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end and (cluster.jobs() or set(cluster.node_processes()) - cluster.daemon_pids()):
        time.sleep(0.5)
    assert cluster.jobs() == [], "Slurm still lists jobs"
    assert set(cluster.node_processes()) - cluster.daemon_pids() == set(), "processes left on the nodes"
    assert processes_of(run_id) == []


def show_job(cluster: SlurmTestCluster, jid: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], env=cluster.env(), capture_output=True, text=True, check=True)
    return parse_show_job(out.stdout.strip())


# --------------------------------------------------------------------------- no cluster needed


def test_parse_show_job_keeps_values_with_spaces() -> None:
    line = "JobId=7 JobName=fb x UserId=root(0) JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15 Command=/a b/job.sh NodeList=n[1-2]"
    info = parse_show_job(line)
    assert info["JobName"] == "fb x" and info["JobState"] == "TIMEOUT" and info["Reason"] == "TimeLimit"
    assert info["Command"] == "/a b/job.sh" and info["NodeList"] == "n[1-2]" and info["ExitCode"] == "0:15"


def test_dry_run_details_show_the_batch_script(tmp_path: Path) -> None:
    cfile = cluster_file(tmp_path, None, partition="batch", account="bench", extra_sbatch=["--gres=gpu:8"], srun_extra=["--mpi=none"])
    cluster = load(ClusterConfig, cfile)
    plan = planning.build(CaseName.parse(CASE), "cpu", cluster, tmp_path / "logs")
    details = SlurmRuntime(cluster).dry_run_details(plan)
    sb = details["sbatch"]
    for opt in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=00:10:00",
        "--partition=batch",
        "--account=bench",
        "--gres=gpu:8",
        "--exclusive",
        "--no-requeue",
        "--nodelist=n1,n2",
        "--parsable",
    ):
        assert opt in sb
    script = details["script"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "exec srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1" in script
    assert "--mpi=none" in script and "-m run_benchmarks.running.slurm_node --spec" in script
    assert details["srun"][0] == "srun"
    nodes = details["spec"]["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    for k, n in enumerate(nodes):  # one planned command per node rank, master left open
        cmd = n["command"]
        assert cmd[cmd.index("--node-rank") + 1] == str(k)
        assert cmd[cmd.index("--master-addr") + 1] == MASTER_PLACEHOLDER
    assert plan.run_dir.exists() is False  # a dry run touches nothing


def test_docker_runs_the_vendor_image_with_the_run_dir_mounted(tmp_path: Path) -> None:
    cfile = cluster_file(tmp_path, None, container_runtime="docker", image="registry.example/fb/{vendor}-{framework}:1")
    data = yaml.safe_load(cfile.read_text())
    cfile.write_text(yaml.safe_dump({**data, "runtime": "container"}))
    cluster = load(ClusterConfig, cfile)
    plan = planning.build(CaseName.parse(CASE), "cpu", cluster, tmp_path / "logs")
    container = SlurmRuntime(cluster).dry_run_details(plan)["spec"]["container"]
    assert container["image"] == "registry.example/fb/cpu-megatron:1"
    opts = container["options"]
    assert opts[:3] == ["--network", "host", "--init"]
    assert f"{plan.run_dir}:{plan.run_dir}" in opts and f"{ROOT}:{ROOT}:ro" in opts
    assert ["--shm-size", plan.vendor.container.shm_size] == opts[3:5]
    assert not (tmp_path / "logs").exists()


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="slurm.container_runtime"):
        SlurmRuntime(ClusterConfig(backend="slurm", runtime="container"))
    bad = cluster_file(tmp_path, None, container_runtime="docker")
    with pytest.raises(InputError, match="needs image"):
        load(ClusterConfig, bad)
    bad = cluster_file(tmp_path, None, time_limit="1h")
    with pytest.raises(InputError, match="slurm.time_limit"):
        load(ClusterConfig, bad)


def test_node_wrapper_says_the_run_dir_is_not_shared(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "run_benchmarks.running.slurm_node", "--spec", str(tmp_path / "gone" / "spec.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == EXIT_NO_SPEC
    assert "filesystem shared by the submit host and every node" in proc.stderr


# --------------------------------------------------------------------------- on the Slurm cluster


@pytest.mark.framework("megatron")
def test_two_nodes_through_slurm(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    """Shared nodes, no master_port, 29500 taken on n1, and n1's name unknown on n2 (the test
    cluster's /etc/hosts): the master is n1's NodeAddr and the port one node 0 found free."""
    assert KNOWN_NAMES["n2"] == ("n2",)
    cfile = cluster_file(tmp_path, slurm_cluster.conf, port=False, exclusive=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 29500))
        taken.listen()
        proc = start(tmp_path, cfile, megatron_python)
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    res = results(tmp_path)
    assert (res["backend"], res["nnodes"], res["nprocs"], res["config_name"]) == ("slurm", 2, 1, "config_cpux2x1")
    (rnd,) = res["rounds"]
    assert rnd["status"] == "ok" and rnd["error"] is None, rnd["error"]
    assert rnd["loss_aligned"] is True and rnd["loss_mre"] < 0.02
    assert rnd["layout"].startswith("PP1DP2TP1")
    nodes = rnd["nodes"]
    assert [(n["node_rank"], n["host"], n["returncode"]) for n in nodes] == [(0, "n1", 0), (1, "n2", 0)]
    jid = nodes[0]["slurm_job_id"]
    assert jid and all(n["slurm_job_id"] == jid and n["slurm_state"] == "COMPLETED" for n in nodes)
    # while it ran: the job's id and state, then the step it was at, from the node agents' progress files
    assert f"round 1: Slurm job {jid} RUNNING on " in out, out
    assert re.search(r"round 1: step \d+/30, [\d,]+ tokens/p/s, loss [\d.]+ \(\d+:\d\d\)", out), out
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["job_id"] == jid and job["state"] == "COMPLETED" and job["submit_to_first_step_s"] > 0
    rd = run_dir(tmp_path)
    assert rd is not None
    port = json.loads((rd / "round1" / "slurm" / "rendezvous.json").read_text())["port"]
    assert port != 29500
    for k, host in ((0, "n1"), (1, "n2")):
        node_dir = rd / "round1" / f"node{k}"
        assert (node_dir / "stdout.log").stat().st_size > 0
        assert (node_dir / "monitor.jsonl").read_text().strip(), "no monitor samples"
        report = json.loads((node_dir / "node.json").read_text())
        assert (report["slurm_node"], report["master_host"], report["master_addr"], report["returncode"]) == (host, "n1", "127.0.0.2", 0)
        cmd = report["command"]
        assert cmd[cmd.index("--master-port") + 1] == str(port) and cmd[cmd.index("--rdzv-id") + 1] == f"{res['run_id']}-round1"
        logs = [f for f in (node_dir / "ranks").rglob("*.log") if f.is_file()]
        assert logs, f"node{k}: no rank logs"
        # the memory record of each rank names the host it ran on
        mem = [r for f in logs for r in ml.parse_file(f).of(ml.EV_MEMORY)]
        assert mem and {r.host for r in mem} == {host}
    assert rnd["monitor"]["node0"]["samples"] > 0 and rnd["monitor"]["node1"]["samples"] > 0
    assert_nothing_left(slurm_cluster, res["run_id"])


@pytest.mark.framework("megatron")
def test_a_rank_dying_on_one_node_fails_the_round(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = start(tmp_path, cfile, megatron_python, *PACED)
    wait_for("a first training step", lambda: first_step(tmp_path), proc)

    def worker_on_n2() -> int | None:
        for pid in slurm_cluster.node_processes("n2"):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(c.endswith(b"train.py") for c in cmd) and b"torch.distributed.run" not in cmd:
                return pid
        return None

    pid = wait_for("the rank process on n2", worker_on_n2, proc)
    os.kill(pid, signal.SIGKILL)  # the rank on node 1 crashes
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    res = results(tmp_path)
    (rnd,) = res["rounds"]
    assert rnd["status"] == "failed"
    assert "node1 (n2): exit status 1" in rnd["error"], rnd["error"]
    n0, n1 = rnd["nodes"]
    assert n1["returncode"] == 1 and n1["slurm_state"] == "FAILED" and n0["slurm_state"] == "FAILED"
    assert n0["returncode"] != 0  # its peer gone: it fails or is stopped (srun --kill-on-bad-exit), never left waiting
    assert_nothing_left(slurm_cluster, res["run_id"])


@pytest.mark.framework("megatron")
def test_time_limit_fails_the_round_as_timeout(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    cfile = cluster_file(tmp_path, slurm_cluster.conf, time_limit="1")  # one minute, Slurm's smallest
    proc = start(tmp_path, cfile, megatron_python, *PACED)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    res = results(tmp_path)
    (rnd,) = res["rounds"]
    assert rnd["status"] == "failed" and "TIMEOUT" in rnd["error"], rnd["error"]
    assert "time limit 00:01:00" in rnd["error"]
    assert {n["slurm_state"] for n in rnd["nodes"]} == {"TIMEOUT"}
    assert rnd["phases"][0]["steps_run"] > 0  # it was training when the limit hit
    assert_nothing_left(slurm_cluster, res["run_id"])


@pytest.mark.framework("megatron")
def test_sigint_cancels_the_job(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = start(tmp_path, cfile, megatron_python, *PACED)
    wait_for("a first training step", lambda: first_step(tmp_path), proc)
    jid = job_id(tmp_path)
    assert jid and show_job(slurm_cluster, jid)["JobState"] == "RUNNING"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    stopped_s = time.monotonic() - t0
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert show_job(slurm_cluster, jid)["JobState"] == "CANCELLED"
    log = (slurm_cluster.base / "log" / "slurmctld.log").read_text(errors="replace")
    assert f"JobId={jid}" in log and "REQUEST_KILL_JOB" in log  # scancel reached the controller
    res = results(tmp_path)
    assert res["finished"] and res["rounds"] == []
    assert_nothing_left(slurm_cluster, res["run_id"])
    assert stopped_s < 60


def test_a_run_dir_the_nodes_cannot_see_fails_clearly(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    """The run directory on a tmpfs private to start_task's mount namespace: not shared."""
    private = tmp_path / "private"
    private.mkdir()
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    argv = [
        sys.executable,
        START,
        "--vendor",
        "cpu",
        "--case_name",
        CASE,
        "--cluster",
        str(cfile),
        "--log-dir",
        str(private / "logs"),
        "--python",
        sys.executable,
    ]
    script = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(private), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "no report from node 0" in out and "must be on a filesystem shared" in out, out
    assert slurm_cluster.jobs() == []


def test_a_job_still_pending_at_the_round_deadline_is_cancelled(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    env = slurm_cluster.env()
    hold = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--exclusive", "--output=/dev/null", "--wrap", "sleep 300"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        cfile = cluster_file(tmp_path, slurm_cluster.conf)
        argv = [
            sys.executable,
            START,
            "--vendor",
            "cpu",
            "--case_name",
            CASE,
            "--cluster",
            str(cfile),
            "--log-dir",
            str(tmp_path / "logs"),
            "--python",
            sys.executable,
            "--round-timeout",
            "4",
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stdout + proc.stderr
    finally:
        subprocess.run(["scancel", hold], env=env, check=True)
    (rnd,) = results(tmp_path)["rounds"]
    assert "still PENDING (Resources) when the round deadline passed; cancelled" in rnd["error"], rnd["error"]
    jid = rnd["nodes"][0]["slurm_job_id"]
    assert f"round 1: Slurm job {jid} PENDING (Resources)" in proc.stderr, proc.stderr  # said while it waited
    assert show_job(slurm_cluster, jid)["JobState"] == "CANCELLED"
    end = time.monotonic() + 30
    while slurm_cluster.jobs() and time.monotonic() < end:
        time.sleep(0.5)
    assert slurm_cluster.jobs() == []


def test_one_translation_of_the_vendors_container_options() -> None:
    """The SSH runtime (engine API) and the Slurm node wrapper (docker run) start the same
    container from the vendor's options: NVIDIA's here, with GPUs, host IPC and its limits."""
    from run_benchmarks.planning.registry import load_vendor
    from run_benchmarks.running.remote.containers import Mount, docker_run_args, vendor_container

    nv = load_vendor("nvidia").container
    spec = vendor_container(
        nv,
        image="img",
        command=["python3", "-V"],
        run_id="r",
        name=None,
        env={"A": "1"},
        mounts=[Mount("/data", "/data", True)],
        workdir="/w",
    )
    assert spec.ipc_mode == "host" and spec.device_requests and spec.shm_size == nv.shm_size and spec.init
    args = docker_run_args(spec)
    assert args[:5] == ["--network", "host", "--init", "--ipc", "host"]
    assert ["--gpus", "all"] == args[args.index("--gpus") : args.index("--gpus") + 2]
    assert "memlock=-1:-1" in args and "A=1" in args and "/data:/data:ro" in args and args[-2:] == ["--workdir", "/w"]


def test_node_0_holds_the_master_port_until_its_wrapper_ends(tmp_path: Path) -> None:
    """Two jobs sharing a node with one ``master_port``: the second job's node 0 is refused
    with the documented line while the first holds the port, though nothing listens on it
    yet (torch binds it only later). Each job runs in a wrapper process of its own."""
    from run_benchmarks.running import slurm_node

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    (tmp_path / "slurm").mkdir()
    (tmp_path / "b" / "slurm").mkdir(parents=True)
    code = (
        "import sys, time; from run_benchmarks.running import slurm_node as n\n"
        "spec = {'round_dir': sys.argv[1], 'master_port': int(sys.argv[2])}\n"
        "print(n.rendezvous_port(spec, 0, 'job-a'), flush=True); time.sleep(60)\n"
    )
    first = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(port)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert first.stdout.readline().strip() == str(port)
        with pytest.raises(ValueError, match=rf"master_port {port} of the cluster file is in use on .*leave it out to use a free port"):
            slurm_node.rendezvous_port({"round_dir": str(tmp_path / "b"), "master_port": port}, 0, "job-b")
    finally:
        first.kill()
        first.wait()
    assert slurm_node.rendezvous_port({"round_dir": str(tmp_path / "b"), "master_port": port}, 0, "job-c") == port


def test_slurm_hosts_need_no_address_ssh_hosts_do(tmp_path: Path) -> None:
    """docs/slurm.md: Slurm finds its nodes by name, the address fields are not used."""
    cfile = tmp_path / "slurm.yaml"
    cfile.write_text(yaml.safe_dump({"backend": "slurm", "hosts": [{"name": "n1"}, {"name": "n2"}]}))
    cluster = load(ClusterConfig, cfile)
    plan = planning.build(CaseName.parse(CASE), "cpu", cluster, tmp_path / "logs")
    assert "--nodelist=n1,n2" in SlurmRuntime(cluster).dry_run_details(plan)["sbatch"]
    ssh = tmp_path / "ssh.yaml"
    ssh.write_text(yaml.safe_dump({"backend": "ssh", "hosts": [{"name": "h1", "address": "10.0.0.1"}, {"name": "h2"}]}))
    with pytest.raises(InputError, match=r"ssh\.yaml: .*hosts h2: field 'address' is needed with backend 'ssh'"):
        load(ClusterConfig, ssh)
