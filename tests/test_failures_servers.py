"""SSH servers and docker engines that answer wrongly, on the shared test cluster (tests/cluster/).

A hung sshd (it accepts connections and says nothing), an sshd allowing one session per
connection, a key with a passphrase, a frozen dockerd: each is met at the first stage that
reaches the host, and said in one line naming the host and the cause, exit 2, within the
configured bound, with nothing started there. The servers are second sshds of a cluster
host on ports of their own (``netns.extra_sshd``); the host's own sshd and the other tests'
state are untouched, and the frozen dockerd is let run again whatever the outcome.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster import netns
from tests.test_failures_hosts import one_line
from tests.test_ssh_runtime import CASE, cluster_file, leftovers, only_run, run

pytestmark = [pytest.mark.cluster, pytest.mark.framework("megatron")]


@pytest.fixture
def second_sshd(cluster: netns.Cluster, tmp_path: Path) -> Iterator:
    """Start a second sshd of h2 on a port of its own, with sshd_config options; its
    known_hosts entry in a file of the test's. Ended by its PID at the end of the test."""
    started: list[subprocess.Popen] = []

    def start(port: int, **options: str) -> tuple[Path, subprocess.Popen]:
        started.append(netns.extra_sshd(cluster, "h2", port, **options))
        h2 = cluster.host("h2")
        kind, key = Path(h2.host_key + ".pub").read_text().split()[:2]
        known = tmp_path / f"known_hosts.{port}"
        known.write_text(Path(cluster.known_hosts).read_text() + f"[{h2.address}]:{port} {kind} {key}\n")
        return known, started[-1]

    yield start
    for proc in started:
        netns.end_extra_sshd(proc)


def _on_port(cluster, tmp_path: Path, python: str, port: int, known: Path, runtime: str = "process", **ssh: object) -> Path:
    cfile = cluster_file(cluster, tmp_path, python, runtime=runtime)
    doc = yaml.safe_load(cfile.read_text())
    doc["hosts"][1]["port"] = port
    doc["ssh"].update(known_hosts=str(known), **ssh)
    cfile.write_text(yaml.safe_dump(doc))
    return cfile


def _start(cfile: Path, log_dir: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    p = run(["--vendor", "cpu", "--case_name", CASE, "--cluster", str(cfile), "--log-dir", str(log_dir)], timeout=300)
    return p, time.monotonic() - t0


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_hung_sshd_is_named_with_its_bound_and_the_cleanup_does_not_wait_on_it(cluster, megatron_python, tmp_path, second_sshd):
    """h2's sshd stopped (SIGSTOP): TCP connects (the kernel accepts), no banner comes. The run
    and --cleanup each say so in one line within connect_timeout_s (3 s), exit 2; the
    cleanup after the failed run does not try h2 again; nothing of the run is left on h1."""
    port = 2231
    known, sshd = second_sshd(port)
    os.kill(sshd.pid, signal.SIGSTOP)  # end_extra_sshd lets it run again to end it
    cfile = _on_port(cluster, tmp_path, megatron_python, port, known, connect_timeout_s=3)
    p, took = _start(cfile, tmp_path / "logs")
    assert p.returncode == 2, p.stdout + p.stderr
    h2 = cluster.host("h2")
    assert one_line(p.stderr) == (
        f"error: host h2: {h2.address}:{port} accepts connections but sent no SSH banner within 3 s "
        "(connect_timeout_s): its sshd is hung or stopped, or the port is not SSH"
    )
    # the bound once (not again in the cleanup), plus the start of a Python process here:
    # 4.6 s on the 2-core test machine, 2026-12-01
    assert 3 <= took < 15, f"{took:.1f} s"
    print(f"hung sshd named after {took:.1f} s")
    _, res = only_run(tmp_path / "logs")
    assert leftovers(cluster, res["run_id"]) == []
    assert not Path(cluster.host("h1").workdir, "fb", "runs", res["run_id"]).exists()

    t0 = time.monotonic()
    p = run(["--cluster", str(cfile), "--cleanup"], timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stdout + p.stderr
    assert one_line(p.stderr).startswith(f"error: host h2: {h2.address}:{port} accepts connections but sent no SSH banner within 3 s")
    assert took < 15, f"{took:.1f} s"


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_frozen_docker_engine_is_named_within_command_timeout(cluster, megatron_python, tmp_path):
    """h2's dockerd stopped (SIGSTOP): its socket accepts, nothing answers. A container run
    says so within command_timeout_s (5 s), not the docker SDK's own 120 s; exit 2."""
    cfile = cluster_file(cluster, tmp_path, megatron_python, runtime="container")
    doc = yaml.safe_load(cfile.read_text())
    doc["ssh"]["command_timeout_s"] = 5
    cfile.write_text(yaml.safe_dump(doc))
    dockerd = cluster.host("h2").dockerd_pid
    assert dockerd and f"{cluster.dir}/hosts/h2/docker " in netns._cmdline(dockerd) + " "
    os.kill(dockerd, signal.SIGSTOP)
    try:
        p, took = _start(cfile, tmp_path / "logs")
    finally:
        os.kill(dockerd, signal.SIGCONT)
    assert p.returncode == 2, p.stdout + p.stderr
    assert one_line(p.stderr) == "error: host h2: docker engine not answering over ssh: no reply within 5 s"
    # the bound once, plus the start of a Python process here and the SSH connects:
    # 6.2 s on the 2-core test machine, 2026-12-01
    assert 5 <= took < 30, f"{took:.1f} s"
    print(f"frozen engine named after {took:.1f} s")
    _, res = only_run(tmp_path / "logs")
    assert json.loads(json.dumps(res))["run_id"] and leftovers(cluster, res["run_id"]) == []


def test_an_sshd_allowing_one_session_is_refused_naming_the_setting(cluster, megatron_python, tmp_path, second_sshd):
    """h2's sshd with MaxSessions 1 (the docker SDK and the host lock each need a session of
    the run's one connection): refused when connected, before anything runs, naming the
    host and the setting; a server with OpenSSH's default, 10, is served, and the probe's
    sessions are free again once it is connected."""
    from run_benchmarks.running.remote.ssh import SESSIONS_NEEDED, SSHPool

    known, _ = second_sshd(2232, MaxSessions="1")
    cfile = _on_port(cluster, tmp_path, megatron_python, 2232, known, runtime="container")
    p, _ = _start(cfile, tmp_path / "logs")
    assert p.returncode == 2, p.stdout + p.stderr
    h2 = cluster.host("h2")
    assert one_line(p.stderr) == (
        f"error: host h2: {h2.address}:2232 allows 1 session at once on one SSH connection (the server refused the next: "
        f"Connect failed; sshd_config MaxSessions 1?); runs need {SESSIONS_NEEDED} (OpenSSH's default): "
        f"set MaxSessions {SESSIONS_NEEDED} or more there"
    )
    _, res = only_run(tmp_path / "logs")
    assert leftovers(cluster, res["run_id"]) == []

    known, _ = second_sshd(2233, MaxSessions=str(SESSIONS_NEEDED))
    (spec,) = [s for s in cluster.host_specs(known_hosts=str(known)) if s.name == "h2"]
    with SSHPool([type(spec)(**{**spec.__dict__, "port": 2233})]) as pool:
        pool.connect()
        transport = pool.transport("h2")
        chans = [pool.session("h2", transport, 5) for _ in range(SESSIONS_NEEDED)]
        for chan in chans:
            chan.close()
        assert pool.run("h2", ["echo", "served"], timeout=10).stdout == "served\n"


def test_a_key_with_a_passphrase_is_named_with_its_path(cluster, megatron_python, tmp_path):
    """An ed25519 key (OpenSSH format) and an RSA key (PEM), each with a passphrase: exit 2,
    naming the host and the key file, before any host is touched."""
    for kind, fmt in (("ed25519", []), ("rsa", ["-b", "2048", "-m", "PEM"])):
        key = tmp_path / f"key_{kind}"
        subprocess.run(["ssh-keygen", "-q", "-t", kind, *fmt, "-N", "a passphrase", "-f", str(key)], check=True)
        cfile = cluster_file(cluster, tmp_path, megatron_python, runtime="process")
        doc = yaml.safe_load(cfile.read_text())
        doc["ssh"]["key_file"] = str(key)
        cfile.write_text(yaml.safe_dump(doc))
        p, _ = _start(cfile, tmp_path / f"logs-{kind}")
        assert p.returncode == 2, p.stdout + p.stderr
        line = one_line(p.stderr)
        assert line.startswith("error: host h") and line.endswith(
            f": key file {key} is protected by a passphrase, and runs ask for none: "
            "give the hosts a key without one (key_file of the cluster file)"
        ), line
