"""Slurm failures on the real test Slurm cluster (tests/slurm/): a node whose slurmd is down,
a controller that answers nothing, start_task.py stopped by SIGHUP, partitions that can never run the job, a controller that
refuses it for now. Each checks the line the user gets, the exit status, and that no job or
process is left.

(A master whose name does not resolve on the other node, and jobs sharing a node without a
fixed port, are in every multi-node run of test_slurm_backend.py: n2 cannot resolve n1.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.slurm.cluster import SlurmTestCluster
from tests.slurm.fixtures import slurm_cluster_fixture  # noqa: F401  (the session fixture slurm_cluster)
from tests.test_slurm_backend import (
    PACED,
    START,
    assert_nothing_left,
    cluster_file,
    job_id,
    processes_of,
    results,
    run_dir,
    show_job,
    start_argv,
    wait_for,
)


def test_a_node_without_slurmd_fails_the_round_at_once_naming_it(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    argv = start_argv(tmp_path, cfile, sys.executable)
    slurm_cluster.kill_node("n2")  # the controller still counts it as idle (SlurmdTimeout is 60 s)
    try:
        t0 = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
    finally:
        slurm_cluster.restart_node("n2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = results(tmp_path)
    (rnd,) = res["rounds"]
    first = rnd["error"].splitlines()[0]
    assert first.startswith("Slurm job ") and first.endswith(
        "could not start its step: srun could not launch on node n2 (Communication connection failure): is slurmd running there?"
    ), first
    assert [n["host"] for n in rnd["nodes"]] == ["n1", "n2"]
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] == "launch failed"
    assert took < 90, f"{took:.0f} s to notice"  # the round deadline is 600 s
    assert_nothing_left(slurm_cluster, res["run_id"])


@pytest.mark.framework("megatron")
def test_sighup_cancels_the_job_as_ctrl_c_does(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = subprocess.Popen(
        start_argv(tmp_path, cfile, megatron_python, *PACED),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=START.rsplit("/run_benchmarks", 1)[0],
    )

    def launched() -> str | None:  # the job runs and both node wrappers started their launcher
        jid, rd = job_id(tmp_path), run_dir(tmp_path)
        ok = jid and rd and all((rd / "round1" / f"node{k}" / "node.json").is_file() for k in (0, 1))
        return jid if ok and show_job(slurm_cluster, jid)["JobState"] == "RUNNING" else None

    jid = wait_for("the job's launchers", launched, proc)
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, out
    assert "interrupted" in out
    assert show_job(slurm_cluster, jid)["JobState"] == "CANCELLED"
    res = results(tmp_path)
    assert res["finished"] and res["rounds"] == []
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] == "interrupted"
    assert_nothing_left(slurm_cluster, res["run_id"])
    for k in (0, 1):  # each node wrapper stopped its launcher and said so
        report = json.loads((run_dir(tmp_path) / "round1" / f"node{k}" / "node.json").read_text())
        assert report["stopped_by_signal"] in ("SIGTERM", "SIGINT"), report


def test_the_job_of_a_sigkilled_harness_is_cancelled_by_cleanup(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str
) -> None:
    """SIGKILL leaves start_task.py no chance to cancel its job; the job's comment names the
    dead submitter, and ``--cleanup`` (as the next run's prepare) cancels it, naming it."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = subprocess.Popen(
        start_argv(tmp_path, cfile, megatron_python, *PACED),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    jid = wait_for(
        "the job to run",
        lambda: job_id(tmp_path) if job_id(tmp_path) and show_job(slurm_cluster, job_id(tmp_path))["JobState"] == "RUNNING" else None,
        proc,
    )
    proc.kill()
    proc.communicate(timeout=30)
    time.sleep(2)
    assert jid in slurm_cluster.jobs()  # nobody follows it any more, yet it holds the nodes
    run_id = results(tmp_path)["run_id"]
    clean = subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.strip() == f"cancelled Slurm jobs whose start_task.py is gone: job {jid} of run {run_id}"
    res = results(tmp_path)  # the dead run's file finished for it
    assert res["status"] == "failed" and res["finished"], res["status"]
    assert res["error"] == f"start_task.py ended without finishing the run; its Slurm job {jid} was cancelled by --cleanup"
    end = time.monotonic() + 60
    while slurm_cluster.jobs() and time.monotonic() < end:
        time.sleep(0.5)
    assert_nothing_left(slurm_cluster, run_id)
    again = subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == "no Slurm job of a run whose start_task.py is gone"


def test_a_node_that_never_joins_is_found_at_the_startup_timeout(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str
) -> None:
    """The rendezvous port on n1 (127.0.0.2) is firewalled: the job runs, no rank ever reports,
    and the round is stopped at the startup timeout (counted from when the job runs), the job
    cancelled, long before the round deadline. (The test nodes share this host's loopback, where
    every connection leaves from 127.0.0.1, so the port is closed to all, not to n2 alone.)"""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    port = str(yaml.safe_load(cfile.read_text())["master_port"])
    rule = ["INPUT", "-d", "127.0.0.2", "-p", "tcp", "--dport", port, "-j", "DROP"]
    subprocess.run(["iptables", "-I", *rule], check=True)
    try:
        t0 = time.monotonic()
        proc = subprocess.run(
            start_argv(tmp_path, cfile, megatron_python, "--startup-timeout", "10"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.monotonic() - t0
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = results(tmp_path)
    (rnd,) = res["rounds"]
    first = rnd["error"].splitlines()[0]
    assert first.startswith("node0 (n1), node1 (n2): no rank started training within 10 s of launch (startup_timeout_s)"), first
    assert "cancelled" in rnd["error"] and took < 120, (took, rnd["error"])
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] == "aborted"
    assert_nothing_left(slurm_cluster, res["run_id"])


def stepped(tmp_path: Path, steps: int) -> bool:
    """A rank log of node0 in round 1 of the run logging under ``tmp_path`` holds ``steps`` steps."""
    rd = run_dir(tmp_path)
    logs = [f.read_text(errors="replace") for f in rd.glob("round1/node0/ranks/**/*") if f.is_file()] if rd else []
    return any(text.count('"train_step"') >= steps for text in logs)


@pytest.mark.parametrize("state", ["drain", "down"])
def test_a_job_that_needs_an_out_of_service_node_fails_at_once_naming_it(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, state: str
) -> None:
    """The cluster file pins n1 and n2; n2 is drained (or down) by an administrator: the job
    could only wait for the round deadline, so it is cancelled as soon as Slurm says why."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    scontrol = ["scontrol", "update", "nodename=n2"]
    if state == "down":  # as a crash leaves it: no slurmd to put it back in service
        slurm_cluster.kill_node("n2")
    subprocess.run([*scontrol, f"state={state}", "reason=disk swap"], env=slurm_cluster.env(), check=True, timeout=30)
    try:
        t0 = time.monotonic()
        proc = subprocess.run(start_argv(tmp_path, cfile, sys.executable), capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
    finally:
        if state == "down":
            slurm_cluster.restart_node("n2")
        else:
            subprocess.run([*scontrol, "state=resume"], env=slurm_cluster.env(), check=True, timeout=30)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = results(tmp_path)
    (rnd,) = res["rounds"]
    first = rnd["error"].splitlines()[0]
    assert re.fullmatch(r"Slurm job \d+ can never start: node n2 is \S*(DOWN|DRAIN)\S* \(reason: disk swap[^)]*\); cancelled", first), first
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] == "node unavailable"
    assert took < 60, f"{took:.0f} s to notice"  # the round deadline is 600 s
    assert_nothing_left(slurm_cluster, res["run_id"])


def test_a_wrong_slurm_conf_is_named_at_once(tmp_path: Path) -> None:
    cfile = cluster_file(tmp_path, tmp_path / "no" / "slurm.conf")
    t0 = time.monotonic()
    proc = subprocess.run(start_argv(tmp_path, cfile, sys.executable), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"field 'slurm.slurm_conf': {tmp_path / 'no' / 'slurm.conf'}: no such file" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 20
    clean = subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, text=True, timeout=60)
    assert clean.returncode == 2 and "no such file" in clean.stderr, clean.stdout + clean.stderr


def test_a_controller_that_answers_nothing_is_named_at_once(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    """slurmctld frozen: its port takes the connection, no answer comes. The run is refused
    with exit 2 in the line scontrol ping gives (not its banner of asterisks), and submits nothing."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    with slurm_cluster.controller_frozen():
        proc = subprocess.run(start_argv(tmp_path, cfile, sys.executable), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert re.fullmatch(r"error: backend slurm: the Slurm controller does not answer \(Slurmctld\(primary\) at \S+ is DOWN\)", line), line
    assert slurm_cluster.jobs() == []


@pytest.mark.framework("megatron")
def test_a_node_that_crashes_mid_run_is_named_first_and_not_waited_for(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str
) -> None:
    """Every process on n2 is killed a few steps in, slurmd included, as a crash would: n1's
    rank ends at once (its peer is gone), and the round ends ``PEER_LOST_S`` later naming n2
    first, long before Slurm's SlurmdTimeout (60 s here, 300 s by default) would mark it down."""
    from run_benchmarks.running.runtimes.slurm import PEER_LOST_S

    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = subprocess.Popen(
        start_argv(tmp_path, cfile, megatron_python, *PACED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    wait_for("the first steps", lambda: stepped(tmp_path, 3), proc)
    victims = slurm_cluster.node_processes("n2")
    try:
        slurm_cluster.kill_node("n2")
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=240)
        took = time.monotonic() - t0
    finally:
        slurm_cluster.restart_node("n2")
    assert proc.returncode == 1, out
    res = results(tmp_path)
    (rnd,) = res["rounds"]
    lines = rnd["error"].splitlines()
    assert lines[0].startswith(
        f"node1 (n2): node n2 lost: its launcher had not ended {PEER_LOST_S:g} s after n1's (Slurm's node state: "
    ), lines
    assert lines[0].endswith("cancelled"), lines
    assert any(ln.startswith("rank ") for ln in lines[1:]), lines  # the survivor's error after it
    assert took < PEER_LOST_S + 30, f"{took:.0f} s"  # SlurmdTimeout is 60 s
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] == "node lost"


@pytest.mark.framework("megatron")
def test_a_round_on_shared_nodes_says_so_beside_its_figures(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    """``exclusive: false`` and another job holding a core of n1 all along: the round's line
    and its nodes in results.json name that job."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf, exclusive=False)
    other = subprocess.run(
        ["sbatch", "--parsable", "--nodelist=n1", "--ntasks=1", f"--output={tmp_path / 'other.out'}", "--wrap", "sleep 600"],
        env=slurm_cluster.env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    try:
        proc = subprocess.run(start_argv(tmp_path, cfile, megatron_python), capture_output=True, text=True, timeout=400)
    finally:
        subprocess.run(["scancel", other], env=slurm_cluster.env(), timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    note = f"round 1: ok (nodes shared with Slurm job {other}: the figures are not of whole nodes)"
    assert note in proc.stderr, proc.stderr
    (rnd,) = results(tmp_path)["rounds"]
    assert rnd["nodes"][0]["shared_with"] == [f"Slurm job {other}"], rnd["nodes"]


@pytest.mark.framework("megatron")
def test_a_slurmd_killed_mid_run_is_named(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    """n2's slurmd is killed a few steps in; its ranks run on and the round ends, but the job
    would stay COMPLETING until Slurm marks n2 down: the line names n2 instead of waiting."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = subprocess.Popen(start_argv(tmp_path, cfile, megatron_python), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    wait_for("the first step", lambda: stepped(tmp_path, 1), proc)
    try:
        slurm_cluster.kill_node("n2")
        out, err = proc.communicate(timeout=240)
        # the run ended normally; its job, still completing, is no leftover of a dead run
        clean = subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, text=True, timeout=120)
        still = slurm_cluster.jobs()
    finally:
        slurm_cluster.restart_node("n2")
    assert still, "the job was no longer completing: the sweep was not tried on it"
    assert clean.returncode == 0 and clean.stdout.strip() == "no Slurm job of a run whose start_task.py is gone", clean.stdout
    assert "node n2 has not confirmed the job's end within 10 s (state " in err and "is its slurmd running?" in err, out + err
    (job,) = results(tmp_path)["runtime_info"]["slurm"]["jobs"]
    assert "node n2 has not confirmed" in job["silent_nodes"], job  # (n1 too, on a loaded host)
    assert job["teardown_s"] < 30, job  # not Slurm's 60 s


@pytest.mark.framework("megatron")
def test_a_node_failure_slurm_reports_names_the_node(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    """n2 crashes a few steps in and a health check sets it down at once: Slurm ends the job
    NODE_FAIL long before the harness's own watch would call n2 lost. The round's error names
    n2 first, with the state and reason Slurm gives, and n1 after it as stopped."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc = subprocess.Popen(
        start_argv(tmp_path, cfile, megatron_python, *PACED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    wait_for("the first step", lambda: stepped(tmp_path, 1), proc)
    try:
        slurm_cluster.kill_node("n2")
        # the health check comes first: were it slower than the harness's own silent-node check
        # (10 s of COMPLETING) on a loaded machine, the job would not end NODE_FAIL
        down = ["scontrol", "update", "nodename=n2", "state=down", "reason=fan failure"]
        subprocess.run(down, env=slurm_cluster.env(), check=True, timeout=30)
        for _ in range(50):  # what ran on n2 (its namespace is a retired one now), started until slurmd was gone
            if not (victims := set(slurm_cluster.node_processes()) - set(slurm_cluster.node_processes("n1"))):
                break
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        slurm_cluster.restart_node("n2")
    assert proc.returncode == 1, out
    res = results(tmp_path)
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    assert job["state"] == "NODE_FAIL" and job["cancelled_by_harness"] is None, (job, out)
    assert list(job["failed_nodes"]) == ["n2"], job
    (rnd,) = res["rounds"]
    lines = rnd["error"].splitlines()
    lead = rf"node1 \(n2\): Slurm job {job['job_id']} ended NODE_FAIL: node n2 is \S*DOWN\S* \(reason: fan failure.*\)"
    assert re.fullmatch(lead, lines[0]), lines
    assert f"node0 (n1): stopped: Slurm job {job['job_id']} ended NODE_FAIL for node n2" in lines[1:], lines
    assert_nothing_left(slurm_cluster, res["run_id"])


@pytest.mark.framework("megatron")
def test_a_node_an_admin_sets_down_mid_run_is_named_with_the_reason(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str
) -> None:
    """An administrator sets n2 down a step in (``scontrol update ... state=down reason=...``):
    Slurm ends the job NODE_FAIL. With Slurm's ReturnToService 1 (0 is Slurm's default) n2
    stays down: the round's error names it and the admin's reason. With the test cluster's 2,
    n2, its slurmd alive, is back in service at once, its reason gone: srun's word names the
    node all the same. One run shows the first, the second is read from the same batch output
    after n2 is resumed. The controller's own configuration is restored whatever the outcome."""
    from run_benchmarks.planning.config import ClusterConfig, load
    from run_benchmarks.running.runtimes.slurm import SlurmRuntime

    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    slurm_cluster.restart_controller(ReturnToService="1")
    try:
        proc = subprocess.Popen(
            start_argv(tmp_path, cfile, megatron_python, *PACED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        wait_for("the first step", lambda: stepped(tmp_path, 1), proc)
        down = ["scontrol", "update", "nodename=n2", "state=down", "reason=bad DIMM, ticket 4711"]
        subprocess.run(down, env=slurm_cluster.env(), check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], env=slurm_cluster.env(), capture_output=True, timeout=30)
        slurm_cluster.restart_controller()
    assert proc.returncode == 1, out
    res = results(tmp_path)
    (job,) = res["runtime_info"]["slurm"]["jobs"]
    jid = job["job_id"]
    assert job["state"] == "NODE_FAIL" and job["cancelled_by_harness"] is None, (job, out)
    (rnd,) = res["rounds"]
    lines = rnd["error"].splitlines()
    lead = rf"node1 \(n2\): Slurm job {jid} ended NODE_FAIL: node n2 is DOWN\S* \(reason: bad DIMM, ticket 4711 \[root@.*\]\)"
    assert re.fullmatch(lead, lines[0]), lines
    assert f"node0 (n1): stopped: Slurm job {jid} ended NODE_FAIL for node n2" in lines[1:], lines
    assert f"round 1: failed - {lines[0]}" in out, out
    # n2 back in service (as ReturnToService=2 has it at once): srun's line still names it
    rt = SlurmRuntime(load(ClusterConfig, str(cfile)))
    again = rt._failed_in_service(run_dir(tmp_path) / "round1" / "slurm" / f"job-{jid}.out")
    assert again == {"n2": "IDLE again (srun: Node failure on n2; Slurm put it back in service, its reason gone)"}, again
    assert_nothing_left(slurm_cluster, res["run_id"])


def _end_every_job(cluster: SlurmTestCluster) -> None:
    """Cancel what the cluster still lists and wait (60 s at most) until it lists nothing."""
    ids = cluster.jobs()
    if ids:
        subprocess.run(["scancel", *ids], env=cluster.env(), capture_output=True, timeout=30)
    end = time.monotonic() + 60
    while cluster.jobs() and time.monotonic() < end:
        time.sleep(0.5)


def _munge_lost_run(
    tmp_path: Path, cluster: SlurmTestCluster, python: str, cfile: Path, interrupt: bool
) -> tuple[subprocess.Popen[str], str, float, str, str, list[str]]:
    """A long run on ``cfile`` whose munged is killed at its first step, then, with ``interrupt``,
    stopped by Ctrl-C: its process, its output, the seconds from the kill to its end, its job and
    run ids, and its processes left but srun's (the ranks, launchers and node wrappers; srun and
    slurmstepd wait for munge to report the end). munged is restarted and every job ended
    whatever the outcome."""
    proc = subprocess.Popen(start_argv(tmp_path, cfile, python, *PACED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("the first step", lambda: stepped(tmp_path, 1), proc)
        jid, run_id = job_id(tmp_path), results(tmp_path)["run_id"]
        cluster.kill_munge()
        t0 = time.monotonic()
        if interrupt:
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
        took = time.monotonic() - t0
        ranks = [p for p in processes_of(run_id) if not p.split(": ", 1)[1].startswith("srun ")]
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.restart_munge()
        _end_every_job(cluster)
    return proc, out, took, jid, run_id, ranks


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.framework("megatron")
def test_the_ranks_of_a_sigkilled_harness_end_when_its_lease_lapses(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str
) -> None:
    """start_task.py SIGKILLed a step in (its machine lost): nobody renews the round's lease
    (running/lease.py), so within ``lease_s`` every node stops its ranks and the job ends by
    itself, nothing of it left on either node; ``--cleanup`` then finishes the results.json."""
    lease_s = 10.0
    cfile = cluster_file(tmp_path, slurm_cluster.conf, lease_s=lease_s)
    proc = subprocess.Popen(
        start_argv(tmp_path, cfile, megatron_python, *PACED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for("the first step", lambda: stepped(tmp_path, 1), proc)
    jid, run_id = job_id(tmp_path), results(tmp_path)["run_id"]
    proc.kill()
    t0 = time.monotonic()
    proc.communicate(timeout=30)

    def left() -> set[int]:
        return set(slurm_cluster.node_processes()) - slurm_cluster.daemon_pids()

    assert left(), "nothing of the job ran when start_task.py was killed"
    while (left() or slurm_cluster.jobs()) and time.monotonic() < t0 + lease_s + 60:
        time.sleep(0.2)
    took = time.monotonic() - t0
    assert slurm_cluster.jobs() == [] and left() == set(), f"still there {took:.0f} s after the SIGKILL"
    assert took < lease_s + 30, f"{took:.1f} s"  # docs/slurm.md: lease_s + 10 s; 12.8 s measured, lease_s 10 (2026-12-01)
    print(f"job's processes gone {took:.1f} s after the SIGKILL (lease_s {lease_s:g})")
    reports = [json.loads((run_dir(tmp_path) / "round1" / f"node{k}" / "node.json").read_text()) for k in (0, 1)]
    assert any("was not renewed for 10 s" in r.get("lease_lapsed", "") for r in reports), reports
    clean = subprocess.run([sys.executable, START, "--cluster", str(cfile), "--cleanup"], capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    ended = f"run {run_id} (its Slurm job {jid} ended FAILED without it)"
    assert clean.stdout.strip() == f"finished the results.json of runs whose start_task.py is gone: {ended}", clean.stdout
    res = results(tmp_path)
    assert res["status"] == "failed" and res["finished"], res["status"]
    assert res["error"] == (
        f"start_task.py ended without finishing the run; its Slurm job {jid} ended FAILED without it: "
        "its nodes stopped the ranks when the run's lease lapsed"
    ), res["error"]
    assert_nothing_left(slurm_cluster, run_id)


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.framework("megatron")
def test_munge_lost_mid_run_is_named_and_no_cancel_is_claimed(
    tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str
) -> None:
    """munged is killed a step in: no Slurm command of the harness authenticates any more. The
    harness says which command fails and why, gives Slurm ``unreachable_s``, then ends the
    round's lease (the nodes stop their ranks without Slurm), records no cancel it could not
    make, says how to cancel the job and exits 1. munged is restarted whatever the outcome."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf, unreachable_s=10)
    proc, out, took, jid, run_id, ranks = _munge_lost_run(tmp_path, slurm_cluster, megatron_python, cfile, interrupt=False)
    print(out[-3000:])
    assert proc.returncode == 1 and "Traceback" not in out, out
    # munged SIGKILLed leaves its socket: Slurm's clients retry for a minute, silent; munge itself says why
    why = r"`munge -n --socket \S+`: Failed to connect to \S+: Connection refused\)"
    said = next((ln for ln in out.splitlines() if ln.startswith(f"Slurm job {jid}: Slurm does not answer")), out)
    assert re.fullmatch(rf"Slurm job {jid}: Slurm does not answer \(`scontrol show job -o {jid}`: .*; {why}; trying for 10 s", said), said
    first = next(ln for ln in out.splitlines() if ln.startswith("round 1: failed - "))
    assert re.match(rf"round 1: failed - Slurm did not answer the harness for 10 s \(`scontrol show job -o {jid}`: .*; {why};", first), (
        first
    )
    assert first.endswith(
        f"; the nodes stopped their ranks through the run's lease (2 of 2 confirmed); "
        f"Slurm job {jid} may still be running: cancel it with `scancel {jid}` once Slurm answers"
    ), first
    (job,) = results(tmp_path)["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] is None and job["cancel_failed"].startswith(f"`scancel {jid}`: "), job
    assert results(tmp_path)["status"] == "failed"
    assert ranks == [], ranks  # ended through the lease, Slurm unreachable
    assert took < 10 + 40, f"{took:.1f} s"  # unreachable_s, the nodes' stop, the reports; 21 s measured (2026-12-01)
    print(f"munge lost: the run ended {took:.1f} s after munged was killed")
    assert_nothing_left(slurm_cluster, run_id)


@pytest.mark.alone  # times something: tests/parallel.py
@pytest.mark.framework("megatron")
def test_ctrl_c_with_munge_lost_ends_in_seconds(tmp_path: Path, slurm_cluster: SlurmTestCluster, megatron_python: str) -> None:
    """munged killed, then Ctrl-C: the lease ends at once, scancel gets 10 s (Slurm's clients
    would retry for a minute), the nodes' own stop is awaited, not Slurm; exit 130 with nothing
    left running and no cancel claimed. munged is restarted whatever the outcome."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    proc, out, took, jid, run_id, ranks = _munge_lost_run(tmp_path, slurm_cluster, megatron_python, cfile, interrupt=True)
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert f"Slurm job {jid} could not be cancelled (`scancel {jid}`: scancel: no answer from the Slurm controller within 10 s)" in out, out
    (job,) = results(tmp_path)["runtime_info"]["slurm"]["jobs"]
    assert job["cancelled_by_harness"] is None and job["cancel_failed"], job
    assert ranks == [], ranks  # ended through the lease
    assert took < 10 + 20, f"{took:.1f} s"  # scancel's 10 s, then the nodes' stop; 10.3 s measured (2026-12-01), 112 s before
    assert_nothing_left(slurm_cluster, run_id)


def _partition(cluster: SlurmTestCluster, *settings: str) -> None:
    done = subprocess.run(
        ["scontrol", "update", "PartitionName=debug", *settings], env=cluster.env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_job_its_partition_can_never_run_fails_at_once_naming_the_limit(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    """The partition's MaxTime below the job's time limit, its MaxNodes below the job's nodes,
    the partition DOWN, a job of more nodes than it has: each job waits with a reason that
    never clears by itself, and each round fails at its first poll naming the partition, the
    limit and what the job asks (not at the round deadline, 600 s). An INACTIVE partition is
    refused by sbatch itself, quoted. The partition is restored whatever the outcome."""
    cases = [
        (("MaxTime=00:01:00",), "its time limit 00:10:00 is above partition debug's MaxTime 00:01:00 (PartitionTimeLimit)", 2),
        (("MaxNodes=1",), "it asks for 2 nodes, partition debug allows at most 1 (MaxNodes 1) (PartitionNodeLimit)", 2),
        (("State=DOWN",), "partition debug is DOWN (PartitionDown)", 2),
        ((), "it asks for 4 nodes, partition debug has 2 (TotalNodes 2) (PartitionNodeLimit)", 4),
    ]
    try:
        for i, (settings, said, nodes) in enumerate(cases):
            tmp = tmp_path / str(i)
            tmp.mkdir()
            cfile = cluster_file(tmp, slurm_cluster.conf)
            if nodes != 2:  # no hosts named: the job asks Slurm for any 4 nodes
                doc = yaml.safe_load(cfile.read_text())
                del doc["hosts"]
                cfile.write_text(yaml.safe_dump(doc))
            _partition(slurm_cluster, *settings) if settings else None
            argv = start_argv(tmp, cfile, sys.executable)
            argv[argv.index("--case_name") + 1] = f"llama3_tiny:megatron:cpu:{nodes}:1"
            t0 = time.monotonic()
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            took = time.monotonic() - t0
            _partition(slurm_cluster, "MaxTime=INFINITE", "MaxNodes=UNLIMITED", "State=UP")
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
            res = results(tmp)
            (rnd,) = res["rounds"]
            (job,) = res["runtime_info"]["slurm"]["jobs"]
            first = rnd["error"].splitlines()[0]
            assert first == f"Slurm job {job['job_id']} can never start: {said}; cancelled", first
            assert job["cancelled_by_harness"] == ("partition limit")
            assert [n["host"] for n in rnd["nodes"]] == ["not allocated"] * nodes, rnd["nodes"]  # no name made up
            assert took < 30, f"{took:.0f} s to say so"  # the first poll, 1.8 s on the 2-core test machine (2026-12-01)
            assert_nothing_left(slurm_cluster, res["run_id"])
        _partition(slurm_cluster, "State=INACTIVE")
        cfile = cluster_file(tmp_path, slurm_cluster.conf)
        proc = subprocess.run(start_argv(tmp_path, cfile, sys.executable), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert line.startswith(
            "error: sbatch refused the job: sbatch: error: Batch job submission failed: Required partition not available (inactive or drain)"
        ), line
    finally:
        _partition(slurm_cluster, "MaxTime=INFINITE", "MaxNodes=UNLIMITED", "State=UP")


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_submission_the_controller_refuses_for_now_is_quoted_at_once(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    """MaxJobCount 1 with a held job's record in the controller: sbatch says the controller is
    "temporarily unable to accept job" (and would retry for two minutes). The run says that,
    in seconds, exit 2, and no job of it is left. The controller's own configuration is
    restored whatever the outcome."""
    env = slurm_cluster.env()
    held = None
    try:
        hold = ["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap", "true"]
        held = subprocess.run(hold, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        slurm_cluster.restart_controller(MaxJobCount="1")  # the held job's record, kept, is the one
        cfile = cluster_file(tmp_path, slurm_cluster.conf)
        t0 = time.monotonic()
        proc = subprocess.run(start_argv(tmp_path, cfile, sys.executable), capture_output=True, text=True, timeout=200)
        took = time.monotonic() - t0
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert line.startswith(
            "error: the Slurm controller refused the job for now (sbatch: error: Slurm temporarily unable to accept job, "
            "sleeping and retrying): its job limit (MaxJobCount) reached, or it is overloaded; sbatch stopped (submitted: sbatch "
        ), line
        assert "Traceback" not in proc.stderr and "no answer from the Slurm controller" not in proc.stderr, proc.stderr
        assert took < 30, f"{took:.0f} s"  # sbatch alone retries for 120 s; 0.9 s on the 2-core test machine (2026-12-01)
        assert [j for j in slurm_cluster.jobs() if j != held] == []
        print(f"refused submission said after {took:.1f} s")
    finally:
        if held:
            subprocess.run(["scancel", held], env=env, capture_output=True, timeout=30)
        slurm_cluster.restart_controller()


def test_a_host_not_in_slurm_conf_is_named(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    """A host of the cluster file that is no node of the Slurm cluster: sbatch's "Invalid node
    name specified" names it, exit 2, and no job is left."""
    cfile = cluster_file(tmp_path, slurm_cluster.conf)
    doc = yaml.safe_load(cfile.read_text())
    doc["hosts"][1]["name"] = "n9"
    cfile.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(start_argv(tmp_path, cfile, sys.executable), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line == (
        "error: sbatch refused the job: sbatch: error: Batch job submission failed: Invalid node name specified: "
        "n9 of the cluster file's hosts is not a node of this Slurm cluster (not in its slurm.conf)"
    ), line
    assert slurm_cluster.jobs() == []
