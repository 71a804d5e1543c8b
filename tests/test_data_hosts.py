"""Data on the cluster's hosts only, fingerprinted there before training (docs/datasets.md).

The hosts are the network-namespace test cluster (tests/cluster/): each host's ``/run`` is its
own (sshd's private tmpfs), so a Megatron corpus written there over SFTP is on that host alone,
as a node-local disk is, and this machine cannot see it. No run here trains: each stops at the
check of the data on the hosts, before the first round.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from run_benchmarks.planning.registry import ROOT
from tests.test_ssh_runtime import cluster_file
from training.data.indexed import write_indexed

START = str(ROOT / "run_benchmarks" / "start_task.py")
CASE = "llama3_tiny:megatron:cpu:2:1"
LOCAL_CASE = "llama3_tiny:megatron:cpu:1:2"  # the same model and data settings on this machine
SYNTHETIC_CURVE = str(ROOT / "cases/llama3/megatron/reference/llama3_tiny/standard.json")
pytestmark = [pytest.mark.cluster, pytest.mark.framework("megatron")]

# Run on a host: put uint16 token argv[3] at token position argv[2] of the .bin argv[1], its
# size and mtime kept (only the inode's change time, ctime, tells the rewrite).
REWRITE = """
import os, struct, sys
path, pos, value = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
st = os.stat(path)
with open(path, "r+b") as fh:
    fh.seek(2 * pos)
    fh.write(struct.pack("<H", value))
os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
"""


def start(*args: str, case: str = CASE, hidden: Path | None = None) -> subprocess.CompletedProcess[str]:
    """start_task.py; ``hidden``: a folder this run cannot see (an empty tmpfs over it in a mount
    namespace of its own), while the hosts and their docker engines see what it holds."""
    argv = [sys.executable, START, "--vendor", "cpu", "--case_name", case, *args]
    if hidden is not None:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hidden), *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line of a run refused as bad input (exit 2)."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0].removeprefix("error: ")


def results(log_dir: Path) -> dict:
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return json.loads((run_dir / "results.json").read_text())


def corpus(folder: Path) -> str:
    """A Megatron corpus written into ``folder``; its fingerprint checked on this machine."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    write_indexed(str(folder / "wiki_text_document"), [rng.integers(0, 1024, 700) for _ in range(6)], np.uint16)
    proc = start("--data-dir", str(folder), "--dry-run", "--json", case=LOCAL_CASE)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["data"]["train"]["fingerprint"]


def test_data_on_the_hosts_only_is_fingerprinted_there_and_the_hosts_must_agree(cluster, cluster_pool, megatron_python, tmp_path):
    local = tmp_path / "corpus"
    here = corpus(local)  # the same corpus checked on this machine: the fingerprint the hosts must find

    remote = f"/run/fb-data-{os.getpid()}"  # on each host alone
    names = [h.name for h in cluster.hosts]
    cfile = cluster_file(cluster, tmp_path, megatron_python, runtime="process")
    try:
        for h in names:
            cluster_pool.put_tree(h, local, remote)
        assert not Path(remote).exists()
        # the dry run does not reach the hosts: it says where the fingerprint will be taken
        proc = start("--cluster", str(cfile), "--data-dir", remote, "--dry-run")
        assert proc.returncode == 0, proc.stderr
        assert f"data {remote}: data_dir is not on this machine: fingerprinted on the hosts before training" in proc.stdout
        assert "reference (train): the committed curve of the fingerprint the hosts take before training" in proc.stdout

        # on the hosts: the same fingerprint as here, said and recorded; it judges the run: the
        # synthetic set's curve is refused before training, naming both fingerprints
        logs = tmp_path / "logs1"
        proc = start("--cluster", str(cfile), "--data-dir", remote, "--reference", SYNTHETIC_CURVE, "--log-dir", str(logs))
        msg = error_line(proc)
        assert msg.startswith(f"--reference {SYNTHETIC_CURVE}: made on other data (fingerprint synthetic) than the run's phase train ")
        assert f"(fingerprint {here})" in msg, msg
        said = f"data megatron {remote}/wiki_text_document (4,200 tokens, uint16), checked on h1, h2; fingerprint {here}"
        assert said in proc.stdout, proc.stdout
        ident = results(logs)["data"]["train"]
        assert ident["fingerprint"] == here and ident["checked_on"] == names and ident["corpora"][0]["tokens"] == 4200
        assert results(logs)["rounds"] == []

        # one token changed on h2, the file's size and mtime put back: h2's cached digest is not
        # taken (its ctime changed), its fingerprint is another, and the hosts disagree
        bin_file = f"{remote}/wiki_text_document.bin"
        old = int(np.fromfile(local / "wiki_text_document.bin", dtype=np.uint16)[1234])
        cluster_pool.run("h2", ["python3", "-c", REWRITE, bin_file, "1234", str((old + 1) % 1024)], timeout=60, check=True)
        proc = start("--cluster", str(cfile), "--data-dir", remote, "--log-dir", str(tmp_path / "logs2"))
        msg = error_line(proc)
        assert msg.startswith(f"the hosts hold other data in {remote}: h1 fingerprint {here}, h2 fingerprint "), msg
        theirs = msg.split("h2 fingerprint ")[1].split()[0]
        assert theirs != here and msg.endswith("(every host of the round must hold the same data)")
        # the same change made here gives h2's fingerprint: one content, one fingerprint
        with open(local / "wiki_text_document.bin", "r+b") as fh:
            fh.seek(2 * 1234)
            fh.write(struct.pack("<H", (old + 1) % 1024))
        proc = start("--data-dir", str(local), "--dry-run", "--json", case=LOCAL_CASE)
        assert json.loads(proc.stdout)["data"]["train"]["fingerprint"] == theirs

        # a host whose corpus lost its index: refused, naming the host and the file
        cluster_pool.run("h1", ["rm", "-f", f"{remote}/wiki_text_document.idx"], timeout=60, check=True)
        msg = error_line(start("--cluster", str(cfile), "--data-dir", remote, "--log-dir", str(tmp_path / "logs3")))
        assert msg.startswith("host h1: ") and f"{remote}/wiki_text_document.bin" in msg, msg
    finally:
        for h in names:
            cluster_pool.run(h, ["rm", "-rf", "--", remote], timeout=60)


def test_in_a_container_run_the_image_takes_the_fingerprint(cluster, megatron_python, tmp_path):
    """The node side runs in the vendor's image with the data_dir mounted read-only, as the
    ranks' container has it; this run cannot see the folder, the hosts' engines can."""
    data = tmp_path / "hosts" / "corpus"
    here = corpus(data)
    cfile = cluster_file(cluster, tmp_path, megatron_python, runtime="container")
    logs = tmp_path / "logs"
    proc = start(
        "--cluster", str(cfile), "--data-dir", str(data), "--reference", SYNTHETIC_CURVE, "--log-dir", str(logs), hidden=data.parent
    )
    msg = error_line(proc)
    assert msg.startswith(f"--reference {SYNTHETIC_CURVE}: made on other data (fingerprint synthetic)") and f"(fingerprint {here})" in msg
    assert f"checked on h1, h2; fingerprint {here}" in proc.stdout, proc.stdout
    ident = results(logs)["data"]["train"]
    assert ident["fingerprint"] == here and ident["checked_on"] == ["h1", "h2"]
