"""Hosts that fail under a run, on a 2-host test cluster of this module's own (tests/cluster/).

Each test breaks something real (dockerd stopped, sshd killed, a port taken, a full log
disk, a base image missing, a host without network) and checks the one line the user gets,
the exit status or round status, and that no container or process of any run is left.
The cluster is this module's own because the tests stop and start its daemons; h2's SSH
sessions see pip without its configuration and an empty environment cache, as a host
without a package mirror would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from run_benchmarks.planning.config import ClusterConfig, load
from tests.cluster import netns
from tests.cluster.fixtures import cluster_skip_reason
from tests.test_ssh_runtime import CASE, PACED, START, cluster_file, leftovers, only_run, run

pytestmark = [pytest.mark.cluster, pytest.mark.framework("megatron")]


@pytest.fixture(scope="session")  # this file's alone test runs after the rest of the suite's (tests/parallel.py)
def fc() -> Iterator[netns.Cluster]:
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(reason)
    directory = tempfile.mkdtemp(prefix="fbc-", dir="/tmp")
    no_mirror = {"PIP_CONFIG_FILE": "/dev/null", "FLAGBENCH_ENV_DIR": f"{directory}/hosts/h2/envs"}
    try:
        yield netns.up(2, directory, owner_pid=os.getpid(), ssh_env={"h2": no_mirror}, log=lambda m: None)
    finally:
        netns.down(directory, log=lambda m: None)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _daemons_back(fc: netns.Cluster) -> Iterator[None]:
    """A test that stops a daemon and fails before starting it again leaves the next
    tests a host without it: they would fail for that, not for what they test."""
    yield
    for p in _STARTED:  # a test that failed mid-run must not leave its run holding the hosts
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # as Ctrl-C: the harness stops what it started on the hosts
            try:
                p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    _STARTED.clear()
    netns.restore(fc)


_STARTED: list[subprocess.Popen[str]] = []


def start(cfile: Path, log_dir: Path, *extra: str, case: str = CASE) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, START, "--vendor", "cpu", "--case_name", case, "--cluster", str(cfile), "--log-dir", str(log_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=START.rsplit("/run_benchmarks", 1)[0],
        start_new_session=True,  # its own process group, which _daemons_back can stop whole
    )
    _STARTED.append(p)
    return p


def wait_training_on(host: netns.HostInfo, log_dir: Path, p: subprocess.Popen[str], timeout: float = 300) -> str:
    """Until the host's rank of the run logging into ``log_dir`` writes its log (the hosts
    share this machine's filesystem); the run's id."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        run_id = next((d.name for d in log_dir.iterdir()), None) if log_dir.is_dir() else None
        if run_id and list(Path(host.workdir, "fb", "runs", run_id).rglob("node*/ranks/**/stdout.log")):
            time.sleep(3)  # a few steps in
            return run_id
        time.sleep(0.5)
    p.kill()
    pytest.fail(f"no rank log on {host.name}: {p.communicate()}")


def one_line(err: str) -> str:
    """The one line of an error, past the plan's notes (which reference judges the run)."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("reference (")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_engine_stopped_mid_round_fails_both_rounds_and_cleanup_removes_its_container(fc, megatron_python, tmp_path):
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    p = start(cfile, tmp_path / "logs", *PACED, case=CASE + ":2")
    wait_training_on(fc.host("h2"), tmp_path / "logs", p)
    netns.stop_daemon(fc, "h2", "dockerd")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "Traceback" not in err, out + err
    _, res = only_run(tmp_path / "logs")
    r1, r2 = res["rounds"]
    assert r1["status"] == r2["status"] == "failed"
    assert "node1 (h2)" in r1["error"], r1["error"]
    assert "node1 (h2): docker engine not answering" in r2["error"], r2["error"]  # round 2 could not start there
    # the failing host leads; the node that was only stopped because of it comes after
    assert r2["error"].startswith("node1 (h2): docker engine not answering"), r2["error"]
    assert "\nnode0 (h1): stopped: host h2: docker engine not answering" in r2["error"], r2["error"]
    # a run while the engine is still down stops before anything starts, with one line
    p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "down")], timeout=120)
    assert p.returncode == 2 and one_line(p.stderr).startswith("error: host h2: docker engine not answering"), p.stderr
    netns.start_daemon(fc, "h2", "dockerd")  # the host comes back with the dead container
    assert leftovers(fc, res["run_id"]), "the stopped engine kept no container"
    p = run(["--cluster", str(cfile), "--cleanup"], timeout=120)  # the cleanup command
    (line,) = p.stdout.splitlines()
    assert p.returncode == 0 and line.startswith("host h2: removed what earlier runs left there: 1 container(s) fb-"), p.stdout + p.stderr
    assert line.endswith(f"of run {res['run_id']}"), line
    assert leftovers(fc, res["run_id"]) == []
    p = run(["--cluster", str(cfile), "--cleanup"], timeout=120)
    assert (p.returncode, p.stdout.strip()) == (0, "nothing left on the hosts"), p.stdout + p.stderr


def test_host_lost_then_next_run_cleans_up_refuses_a_second_run_and_stops_on_sigterm(fc, megatron_python, tmp_path):
    import docker

    # run B: h2's sshd (daemon and sessions) killed in round 1 of 2
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process")
    p = start(cfile, tmp_path / "b", *PACED, case=CASE + ":2")
    wait_training_on(fc.host("h2"), tmp_path / "b", p)
    netns.stop_daemon(fc, "h2", "sshd")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "Traceback" not in err, out + err
    _, b = only_run(tmp_path / "b")
    r1, r2 = b["rounds"]
    assert r1["status"] == r2["status"] == "failed"
    assert "node1 (h2)" in r1["error"] and ("connection to the host was lost" in r1["error"] or "lost the node" in r1["error"]), r1["error"]
    assert "h2" in r2["error"] and "cannot connect" in r2["error"], r2["error"]
    # h1's side was stopped by the harness: nothing of the run is left there
    assert subprocess.run(["pgrep", "-f", f"{fc.host('h1').workdir}/fb/runs/{b['run_id']}"], capture_output=True).stdout == b""

    # h2 comes back with what a lost run leaves: a container and a process of run "old-run"
    netns.start_daemon(fc, "h2", "sshd")
    h2 = fc.host("h2")
    stranded = subprocess.Popen(["ip", "netns", "exec", h2.netns, "env", "FLAGBENCH_RUN_ID=old-run", "sleep", "600"])
    engine = docker.DockerClient(base_url=f"unix://{h2.docker_socket}")
    engine.containers.create(fc.image, ["true"], name="fb-old-run-n1", labels={"flagbench.run_id": "old-run"})

    # run C, the next run there: removes them, holds the hosts, uses a free port
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    doc = yaml.safe_load(cfile.read_text())
    del doc["master_port"]
    cfile.write_text(yaml.safe_dump(doc))
    c = start(cfile, tmp_path / "c", *PACED)
    c_id = wait_training_on(fc.host("h1"), tmp_path / "c", c)
    assert stranded.wait(timeout=10) == -signal.SIGKILL
    assert engine.containers.list(all=True, filters={"label": "flagbench.run_id=old-run"}) == []

    # run D at the same time on the same hosts: refused, naming the host and run C
    d = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "d")], timeout=120)
    assert d.returncode == 2, d.stdout + d.stderr
    assert one_line(d.stderr).startswith(f"error: host h1: in use by run {c_id} (")

    # SIGTERM stops C as Ctrl-C does
    c.send_signal(signal.SIGTERM)
    out, err = c.communicate(timeout=120)
    assert c.returncode == 128 + signal.SIGTERM, out + err
    assert "interrupted" in err
    swept = [ln for ln in err.splitlines() if ln.startswith("host h2: removed what earlier runs left there:")]
    assert len(swept) == 1 and "1 container(s) fb-old-run-n1 and 1 process(es) of run old-run" in swept[0], err
    run_dir, res = only_run(tmp_path / "c")
    assert res["finished"] and res["runtime_info"]["leftovers_removed"] == swept
    port = res["runtime_info"]["master_port"]
    command = json.loads((run_dir / "round1" / "plan.json").read_text())["nodes"][0]["command"]
    assert command[command.index("--master-port") + 1] == str(port) and port != 29500
    assert command[command.index("--rdzv-id") + 1] == f"{c_id}-round1"
    for run_id in (b["run_id"], c_id, "old-run"):
        assert leftovers(fc, run_id) == [], run_id
    engine.close()


def test_master_port_in_use_on_the_master(fc, megatron_python, tmp_path):
    h1 = fc.host("h1")
    holder = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            h1.netns,
            sys.executable,
            "-c",
            "import socket, time; s = socket.socket(); s.bind(('', 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(holder.stdout.readline())
        cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process", master_port=port)
        p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "logs")], timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 2, p.stdout + p.stderr
    assert one_line(p.stderr) == (
        f"error: host h1: master_port {port} of the cluster file is in use there (Address already in use); "
        "free it, or leave master_port out to use a free port"
    )
    _, res = only_run(tmp_path / "logs")
    assert leftovers(fc, res["run_id"]) == []


def test_full_log_disk_is_named(fc, megatron_python, tmp_path):
    """The log dir on a 128 KiB tmpfs (in a mount namespace of start_task's own): results.json
    fits, the code archive does not."""
    full = tmp_path / "full"
    full.mkdir()
    runs = {h.name: set(Path(h.workdir, "fb", "runs").glob("*")) for h in fc.hosts}
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process")
    argv = [sys.executable, START, "--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(full / "logs")]
    script = 'mount -t tmpfs -o size=128k tmpfs "$1" && shift && exec "$@"'
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(full), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    line = one_line(p.stderr)
    assert line.startswith(f"error: {full}/logs/llama3_tiny_megatron_cpux2x1_") and line.endswith(
        ": cannot write the code archive in the run's log folder: No space left on device"
    ), line
    for h in fc.hosts:  # nothing of the run reached the hosts
        assert set(Path(h.workdir, "fb", "runs").glob("*")) == runs[h.name]
    run_id = line.split(f"{full}/logs/", 1)[1].split(":", 1)[0]  # this run's only: others of the case may be running
    assert leftovers(fc, run_id) == []


def test_missing_base_image_is_named_then_loaded_over_ssh(fc, megatron_python, tmp_path):
    import docker

    from run_benchmarks.running.remote.containers import connect_engine
    from run_benchmarks.running.runtimes.ssh import load_base_images

    base = "flagbench/cpu-base:bookworm"
    h2 = docker.DockerClient(base_url=f"unix://{fc.host('h2').docker_socket}")
    for image in h2.images.list(name="flagbench/cpu-*"):  # the base and the images built on it
        for tag in image.tags:
            h2.images.remove(tag)
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    doc = yaml.safe_load(cfile.read_text())
    del doc["image_build_args"]  # the Dockerfiles' default base
    cfile.write_text(yaml.safe_dump(doc))
    p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "logs")], timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    line = one_line(p.stderr)
    assert line.startswith(f"error: host h2: base image {base} of flagbench/cpu-megatron:") and line.endswith(
        "is not on the engine; images are never pulled: load it there (start_task.py --cluster FILE --load-images, docs/clusters.md)"
    ), line

    here = connect_engine(fc.host("h1").docker_socket)  # stands for this machine's engine
    t0 = time.monotonic()
    lines = load_base_images(load(ClusterConfig, cfile), "cpu", ["megatron"], source=here)
    took = time.monotonic() - t0
    assert lines[0] == f"host h1: has {base}" and lines[1].startswith(f"host h2: loaded {base} ("), lines
    assert h2.images.get(base).id == here.images.get(base).id
    assert load_base_images(load(ClusterConfig, cfile), "cpu", ["megatron"], source=here) == [
        f"host h1: has {base}",
        f"host h2: has {base}",
    ]
    print(f"base image loaded over SSH in {took:.1f} s")
    here.close()
    h2.close()


def test_missing_environment_on_a_host_without_network(fc, megatron_python, tmp_path):
    """No python: in the cluster file: each host builds or finds the environment with its own
    python3 (Debian's, another patch version than this one). h1 finds the one built here
    (same major.minor); h2 has none and no package index: said in seconds, with the log."""
    from run_benchmarks.planning import envs

    cfile = cluster_file(fc, tmp_path, None, runtime="process")
    t0 = time.monotonic()
    p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "logs")], timeout=300)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stdout + p.stderr
    line = one_line(p.stderr)
    env = Path(fc.dir) / "hosts" / "h2" / "envs" / envs.env_dir("cpu", "megatron").name
    log = env.with_name(env.name + ".build.log")
    assert line.startswith(
        f"error: host h2: the megatron environment for vendor cpu is not built at {env} and pip cannot get torch "
        f"from its package index here (no network?; see {log}): copy an environment built from requirements.txt "
        f"with Python 3.11 to that path, or set python: in the cluster file"
    ), line
    assert "index versions torch" in log.read_text()  # pip's own output is kept
    assert took < 90, f"{took:.0f} s to say so"
    assert not env.exists()
    run_dir, res = only_run(tmp_path / "logs")
    # h1's python3 (Debian's 3.11.2) found the environment this Python (3.11.7) built
    assert f"[h1] {envs.python_of(envs.env_dir('cpu', 'megatron'))}\n" in (run_dir / "env_build.log").read_text()
    assert leftovers(fc, res["run_id"]) == []


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_rank_stopped_in_its_container_is_found_at_the_stall_timeout(fc, megatron_python, tmp_path):
    """h2's rank, in its container, is stopped (SIGSTOP) a few steps in: h1's rank waits for it.
    The round fails as hung long before its deadline, h1's rank's stack (written in its
    container, brought back over SSH) names where it waited, h2's says it wrote none; no
    container or process of the run is left."""
    import psutil

    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    p = start(cfile, tmp_path / "logs", *PACED, "--stall-timeout", "4")
    run_id = wait_training_on(fc.host("h2"), tmp_path / "logs", p)
    end = time.monotonic() + 240
    while time.monotonic() < end and p.poll() is None:  # a few steps in (h1 holds the reporting rank)
        logs = Path(fc.host("h1").workdir, "fb", "runs", run_id).rglob("node0/ranks/**/stdout.log")
        if any(f.read_text(errors="replace").count('"train_step"') >= 3 for f in logs):
            break
        time.sleep(0.2)
    if p.poll() is not None:  # the run must still be training for the stop to mean anything
        pytest.fail(f"the run ended before h2's rank could be stopped (exit {p.returncode}): {p.communicate()}")
    ranks = [
        q
        for q in psutil.process_iter(["cmdline"])
        if "train.py" in " ".join(q.info["cmdline"] or []) and run_id in " ".join(q.info["cmdline"] or [])
    ]
    victims = [q for q in ranks if q.environ().get("RANK") == "1"]
    assert len(victims) == 1, f"rank 1 of {run_id}: {len(victims)} processes among {[q.info['cmdline'] for q in ranks]}"
    os.kill(victims[0].pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "Traceback" not in err, out + err
    assert time.monotonic() - stopped_at < 150, f"{time.monotonic() - stopped_at:.0f} s after the stop"
    _, res = only_run(tmp_path / "logs")
    (rnd,) = res["rounds"]
    lines = rnd["error"].splitlines()
    stall = r"no record from any rank for 4 s after step \d+ \(stall_timeout_s\): the ranks hang; stopped"
    # named: the nodes whose ranks stood still first (h2's stopped rank, h1's waiting for it within the second)
    assert re.fullmatch(rf"(node0 \(h1\), node1 \(h2\)|node1 \(h2\)): {stall}", lines[0]), rnd["error"]
    assert any(
        re.fullmatch(
            r"rank 0 on node0 \(h1\): waited in \S+ \(\S+:\d+\), called from \S+ \((?:cases/llama3/megatron|training)/\S+:\d+\)", ln
        )
        for ln in lines
    ), rnd["error"]
    assert any(ln.startswith("rank 1 on node1 (h2): no stack written by its timeout") for ln in lines), rnd["error"]
    assert leftovers(fc, run_id) == []


def test_engine_crashed_twice_comes_back_each_time(fc):
    """The test cluster's own crash and restart of an engine, twice in a row, with a
    container running each time: the pid files of the crashed engine and its containerd
    are gone (a new engine would take a containerd not yet reaped for a running one and
    give up after 15 s), and restore starts what a test left stopped."""
    import docker

    h = fc.host("h1")
    hdir = Path(fc.dir) / "hosts" / "h1"
    for _ in range(2):
        client = docker.DockerClient(base_url=f"unix://{h.docker_socket}", timeout=60)
        ctr = client.containers.run(fc.image, ["sleep", "600"], detach=True, network_mode="none")
        client.close()
        netns.stop_daemon(fc, "h1", "dockerd")
        assert not (hdir / "dockerd.pid").exists() and not (hdir / "docker-exec" / "containerd" / "containerd.pid").exists()
        assert netns.restore(fc) == ["h1 dockerd"]
        client = docker.DockerClient(base_url=f"unix://{h.docker_socket}", timeout=60)
        client.containers.get(ctr.id).remove(force=True)
        client.close()
    assert netns.restore(fc) == []


def test_log_folder_filling_mid_run_fails_the_round_naming_it(fc, megatron_python, tmp_path):
    """The log dir on an 8 MiB tmpfs (in a mount namespace of start_task's own), filled while
    the ranks train: the round fails naming this machine's full path, exit 1, results.json
    finished with its status and error, no temporary file left."""
    full = tmp_path / "full"
    full.mkdir()
    runs = Path(fc.hosts[1].workdir, "fb", "runs")
    before = set(runs.glob("*"))
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process")
    argv = [sys.executable, START, "--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(full / "logs")]
    argv += ["--set", "train.steps=150"]
    script = (
        'd=$1; shift; mount -t tmpfs -o size=8m tmpfs "$d" || exit 99; "$@"; rc=$?; '
        'find "$d" -name "*.tmp" -o -name harness-error.log > "$d.left"; cat "$d"/logs/*/results.json > "$d.json"; exit $rc'
    )
    p = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(full), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _STARTED.append(p)
    end = time.monotonic() + 300
    while not [r for r in set(runs.glob("*")) - before if list(r.rglob("node*/ranks/**/stdout.log"))]:
        assert p.poll() is None and time.monotonic() < end, p.communicate()
        time.sleep(0.5)
    fill = ["nsenter", "-t", str(p.pid), "-m", "dd", "if=/dev/zero", f"of={full}/filler", "bs=64k"]
    subprocess.run(fill, capture_output=True, timeout=60)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 1, out + err
    res = json.loads(Path(f"{full}.json").read_text())
    assert res["status"] == "failed" and res["finished"], res["status"]
    first = res["rounds"][0]["error"].splitlines()[0]
    assert f"{full}/logs/" in first and "No space left on device" in first, res["rounds"][0]["error"]
    assert Path(f"{full}.left").read_text() == ""  # no temporary file, no harness crash log
    # the hosts' copies of the logs that could not come back stay, each named with a way to fetch it
    kept = res["runtime_info"]["kept_on_hosts"]
    assert kept, res["rounds"][0]["error"]
    try:
        for name, folder in kept.items():
            k = [h.name for h in fc.hosts].index(name)
            host, node = fc.host(name), f"{folder}/round1/node{k}"
            assert folder == f"{host.workdir}/fb/runs/{res['run_id']}"
            assert list(Path(node).rglob("ranks/**/stdout.log")), f"{name}: the rank logs are gone"
            said = f"the host's copy is kept: {name}:{node} (fetch it once this machine has room: scp -r -P {host.port} root@{host.address}:{node}/. "
            assert said in res["rounds"][0]["error"], res["rounds"][0]["error"]
    finally:
        for folder in kept.values():
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    ("mount", "cause"), [("ro,size=1m", "Read-only file system"), ("size=64k", "No space left on device")], ids=["read-only", "full"]
)
def test_a_work_dir_that_cannot_be_written_is_named_with_its_cause(fc, megatron_python, tmp_path, mount, cause):
    """h2's work_dir on a small or read-only tmpfs: refused before any code is sent, naming
    the host, the path and the cause."""
    work = tmp_path / "work"
    work.mkdir()
    in_h2 = ["nsenter", "-t", str(fc.host("h2").sshd_pid), "-m"]  # the mount namespace h2's commands run in
    subprocess.run([*in_h2, "mount", "-t", "tmpfs", "-o", mount, "tmpfs", str(work)], check=True)
    try:
        cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process")
        doc = yaml.safe_load(cfile.read_text())
        doc["hosts"][1]["work_dir"] = str(work)
        cfile.write_text(yaml.safe_dump(doc))
        p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "logs")], timeout=300)
        assert p.returncode == 2, p.stdout + p.stderr
        (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert line.startswith(f"error: host h2: work_dir {work} cannot take the run's files (") and line.endswith(f"): {cause}"), line
        listed = subprocess.run([*in_h2, "ls", "-A", str(work)], capture_output=True, text=True, check=True)
        assert listed.stdout == ""  # nothing sent, the probe removed
    finally:
        subprocess.run([*in_h2, "umount", str(work)], check=False)


def test_the_run_folders_on_the_hosts_go_unless_kept(fc, megatron_python, tmp_path):
    """Each host's <work_dir>/runs/<run> is removed once the logs are back; --keep-remote keeps it."""
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process")
    for extra, kept in (((), False), (("--keep-remote",), True)):
        log_dir = tmp_path / f"logs-{kept}"
        args = [
            "--vendor",
            "cpu",
            "--case_name",
            CASE,
            "--cluster",
            str(cfile),
            "--log-dir",
            str(log_dir),
            "--set",
            "train.steps=3",
            *extra,
        ]
        p = run(args, timeout=300)
        assert p.returncode in (0, 1), p.stdout + p.stderr
        (run_dir,) = log_dir.iterdir()
        assert list(run_dir.glob("round1/node1/ranks/**/stdout.log"))  # the logs came back first
        for h in fc.hosts:
            assert Path(h.workdir, "fb", "runs", run_dir.name).is_dir() == kept, (h.name, kept)


def test_every_host_without_the_base_image_is_named_then_the_rootfs_tarball_is_imported(fc, megatron_python, tmp_path):
    """The project's own base image (a root filesystem tarball, tests/cluster/baseimage.py)
    given to --load-images is imported on each host that lacks it."""
    import docker

    from run_benchmarks.running.runtimes.ssh import load_base_images
    from tests.cluster import baseimage

    base = "flagbench/cpu-base:bookworm"
    engines = {h.name: docker.DockerClient(base_url=f"unix://{h.docker_socket}") for h in fc.hosts}
    for engine in engines.values():
        for image in engine.images.list(name="flagbench/cpu-*"):  # the base and the images built on it
            for tag in image.tags:
                engine.images.remove(tag)
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    doc = yaml.safe_load(cfile.read_text())
    del doc["image_build_args"]  # the Dockerfiles' default base
    cfile.write_text(yaml.safe_dump(doc))
    p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "logs")], timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    named = [ln.removeprefix("error: ").split(":")[0] for ln in p.stderr.splitlines() if f"base image {base} " in ln]
    assert named == ["host h1", "host h2"], p.stderr

    lines = load_base_images(load(ClusterConfig, cfile), "cpu", ["megatron"], archive=baseimage.build_tarball())
    assert [ln.split(" (")[0] for ln in lines] == [f"host {h}: imported {base} from a root filesystem" for h in ("h1", "h2")], lines
    for engine in engines.values():
        assert engine.images.get(base).attrs["RootFS"]["Layers"]


def test_a_container_killed_from_outside_leads_the_round_error_with_its_engine_state(fc, megatron_python, tmp_path):
    """docker kill of h2's container mid-round: the round's error leads with that node, 137 read
    as SIGKILL with what its engine recorded; the survivor's collective error comes after."""
    import docker

    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    p = start(cfile, tmp_path / "logs", *PACED)
    run_id = wait_training_on(fc.host("h2"), tmp_path / "logs", p)
    h2 = docker.DockerClient(base_url=f"unix://{fc.host('h2').docker_socket}")
    (container,) = h2.containers.list(filters={"label": f"flagbench.run_id={run_id}"})
    container.kill()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1, out + err
    _, res = only_run(tmp_path / "logs")
    first, *rest = res["rounds"][0]["error"].splitlines()
    assert first.startswith(f"node1 (h2): container {container.name} killed by SIGKILL (exit status 137; the engine: OOMKilled false, "), (
        first
    )
    assert any(ln.startswith(("rank 0", "node0 (h1)")) for ln in rest), rest  # the survivor after it
    assert leftovers(fc, run_id) == []


def _drop_packets(host: netns.HostInfo, on: bool) -> None:
    """Every packet into and out of the host's own network namespace dropped (or let through again)."""
    for chain in ("INPUT", "OUTPUT"):
        argv = ["ip", "netns", "exec", host.netns, "iptables", "-I" if on else "-D", chain, "-j", "DROP"]
        subprocess.run(argv, check=on, capture_output=True, timeout=10)


def test_a_host_that_drops_every_packet_mid_run_is_lost_within_lost_after(fc, megatron_python, tmp_path):
    """h2 silent from step ~5 (its sshd and dockerd still up): the run ends within its bounds,
    in every phase log collection included, naming h2 first, with no paramiko noise; h2's
    watcher ends its container; once h2 answers again, --cleanup brings back its folder."""
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="container")
    doc = yaml.safe_load(cfile.read_text())
    doc["ssh"].update(lost_after_s=6, connect_timeout_s=3)
    cfile.write_text(yaml.safe_dump(doc))
    p = start(cfile, tmp_path / "logs", *PACED)
    run_id = wait_training_on(fc.host("h2"), tmp_path / "logs", p)
    h2 = fc.host("h2")
    try:
        _drop_packets(h2, True)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=180)
        took = time.monotonic() - t0
    finally:
        _drop_packets(h2, False)
    assert p.returncode == 1, out + err
    assert took < 90, took  # lost_after_s 6 and connect_timeout_s 3 for each call to h2, not minutes
    assert "unrequested channel" not in err and "Traceback" not in err, err
    _, res = only_run(tmp_path / "logs")
    assert res["rounds"][0]["error"].startswith("node1 (h2): "), res["rounds"][0]["error"]
    end = time.monotonic() + 60
    while True:  # h2's sshd finds the run's connection gone (the lock holder's next byte), its lock freed
        p = run(["--cluster", str(cfile), "--cleanup"], timeout=120)
        if p.returncode == 0 or "in use by run" not in p.stderr or time.monotonic() > end:
            break
        time.sleep(2)
    # h2's watcher, silent for 10 s, ended its container; --cleanup brings back its folder
    said = f"host h2: run {run_id} left 1 node folder(s) (round1/node1): brought back into {tmp_path / 'logs' / run_id}, then removed there"
    assert p.returncode == 0 and said in p.stdout.splitlines(), p.stdout + p.stderr
    assert leftovers(fc, run_id) == []


def _cut_between(a: netns.HostInfo, b: netns.HostInfo, on: bool) -> None:
    """Every packet between the two hosts dropped in ``b``'s network namespace (or let
    through again); each still reaches this machine."""
    for chain, way in (("INPUT", "-s"), ("OUTPUT", "-d")):
        argv = ["ip", "netns", "exec", b.netns, "iptables", "-I" if on else "-D", chain, way, a.address, "-j", "DROP"]
        subprocess.run(argv, check=on, capture_output=True, timeout=10)


def test_a_cut_between_two_hosts_names_the_host_that_cannot_reach_the_master(fc, megatron_python, tmp_path):
    """h2 cannot reach h1 (each still reaches the orchestrator): with no rank training half the
    startup timeout after launch, the round fails naming h2 and the master it cannot reach
    (which answers itself), not after the whole startup timeout; exit 1, nothing left."""
    cfile = cluster_file(fc, tmp_path, megatron_python, runtime="process", startup_timeout_s=60)
    h1, h2 = fc.host("h1"), fc.host("h2")
    _cut_between(h1, h2, True)
    try:
        p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(tmp_path / "logs")], timeout=300)
    finally:
        _cut_between(h1, h2, False)
    assert p.returncode == 1, p.stdout + p.stderr
    _, res = only_run(tmp_path / "logs")
    first = res["rounds"][0]["error"].splitlines()[0]
    assert re.fullmatch(
        rf"node1 \(h2\) cannot reach the master h1 at {re.escape(h1.address)}:29711 \(timed out\), which h1 answers: "
        r"the network between the hosts is cut or filtered; stopped (\d+) s after launch, before any rank trained",
        first,
    ), first
    assert 30 <= int(first.rsplit("stopped ", 1)[1].split()[0]) < 60, first  # half the startup timeout, not all of it
    assert leftovers(fc, res["run_id"]) == []
