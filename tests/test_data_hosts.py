"""Data on the cluster's hosts only, fingerprinted there before training (docs/datasets.md).

The hosts are the network-namespace test cluster (tests/cluster/): each host's ``/run`` is its
own (sshd's private tmpfs), so a Megatron corpus written there over SFTP is on that host alone,
as a node-local disk is, and this machine cannot see it. The Slurm test cluster's nodes get a
tmpfs of their own in their slurmd's mount namespace. No run here trains: each stops at the
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

from run_benchmarks.errors import InputError
from run_benchmarks.planning.registry import ROOT
from tests.slurm.cluster import SlurmTestCluster
from tests.slurm.fixtures import slurm_cluster_fixture  # noqa: F401  (the session fixture slurm_cluster)
from tests.test_ssh_runtime import cluster_file
from training.data.indexed import write_indexed

START = str(ROOT / "run_benchmarks" / "start_task.py")
CASE = "llama3_tiny:megatron:cpu:2:1"
LOCAL_CASE = "llama3_tiny:megatron:cpu:1:2"  # the same model and data settings on this machine
SYNTHETIC_CURVE = str(ROOT / "cases/llama3/megatron/reference/llama3_tiny/standard.json")
pytestmark = pytest.mark.framework("megatron")

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
    return corpus_fingerprint(folder)


def corpus_fingerprint(folder: Path) -> str:
    """The fingerprint of the corpus in ``folder``, checked on this machine (a dry run)."""
    proc = start("--data-dir", str(folder), "--dry-run", "--json", case=LOCAL_CASE)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["data"]["train"]["fingerprint"]


@pytest.mark.cluster
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


@pytest.mark.cluster
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


def on_node(cluster: SlurmTestCluster, node: str, *argv: str) -> None:
    """``argv`` in the mount namespace of ``node``'s slurmd (where its job steps run)."""
    pid = cluster.procs[f"slurmd-{node}"].pid
    subprocess.run(["nsenter", f"--target={pid}", "--mount", *argv], check=True, capture_output=True, timeout=60)


def test_slurm_nodes_check_their_own_data_before_training(tmp_path, slurm_cluster, megatron_python):
    """Each node's slurm_node wrapper runs the node side before its launcher; the nodes compare
    their fingerprints through the shared run dir and both stop when they differ."""
    from tests.test_slurm_backend import cluster_file as slurm_file

    local = tmp_path / "corpus"
    here = corpus(local)
    mount = tmp_path / "node-local"  # empty here; a tmpfs of its own on each node
    mount.mkdir()
    old = int(np.fromfile(local / "wiki_text_document.bin", dtype=np.uint16)[1234])
    rewrite = ["python3", "-c", REWRITE, f"{mount}/corpus/wiki_text_document.bin", "1234", str((old + 1) % 1024)]
    try:
        for node in ("n1", "n2"):
            on_node(slurm_cluster, node, "sh", "-c", 'mount -t tmpfs tmpfs "$1" && cp -a "$2" "$1/corpus"', "sh", str(mount), str(local))
        cfile = slurm_file(tmp_path, slurm_cluster.conf)
        # the same data on both nodes: their fingerprint is this machine's, and the run trains on it,
        # unjudged for want of a reference of that data
        proc = start(
            "--cluster", str(cfile), "--data-dir", f"{mount}/corpus", "--python", megatron_python, "--log-dir", str(tmp_path / "l1")
        )
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"checked on n1, n2; fingerprint {here}" in proc.stdout, proc.stdout
        res = results(tmp_path / "l1")
        assert res["data"]["train"]["fingerprint"] == here and res["data"]["train"]["checked_on"] == ["n1", "n2"]
        (rnd,) = res["rounds"]
        assert rnd["status"] == "unjudged" and "no reference for this data (fingerprint " + here in rnd["error"], rnd["error"]

        on_node(slurm_cluster, "n2", *rewrite)  # one token other on n2
        proc = start(
            "--cluster", str(cfile), "--data-dir", f"{mount}/corpus", "--python", megatron_python, "--log-dir", str(tmp_path / "l")
        )
        msg = error_line(proc)
        assert msg.startswith(f"the hosts hold other data in {mount}/corpus: n1 fingerprint {here}, n2 fingerprint "), msg
        theirs = msg.split("n2 fingerprint ")[1].split()[0]
        with open(local / "wiki_text_document.bin", "r+b") as fh:  # the same change made here: n2's fingerprint
            fh.seek(2 * 1234)
            fh.write(struct.pack("<H", (old + 1) % 1024))
        assert theirs != here and corpus_fingerprint(local) == theirs
        (run_dir,) = (tmp_path / "l").iterdir()
        # the first node to stop ends the step (srun --kill-on-bad-exit): its report says why; no rank ran
        nodes = [json.loads(f.read_text()) for f in (run_dir / "round1").glob("node*/node.json")]
        assert nodes and all(n["returncode"] == 95 and n["error"] == msg for n in nodes), nodes
        assert not list((run_dir / "round1").rglob("ranks/*"))
    finally:
        for node in ("n1", "n2"):
            on_node(slurm_cluster, node, "umount", "-l", str(mount))


@pytest.mark.framework("deepspeed")
def test_the_node_side_in_a_framework_environment_gives_this_machines_fingerprint(tmp_path, deepspeed_python, monkeypatch):
    """The node side's command run with llava's framework environment (numpy and Pillow, no
    xxhash): its identity of a LLaVA phase is the one this machine's check gives."""
    from run_benchmarks.planning import datacheck, hostdata
    from tests.test_data_identity import SHAPE, llava

    d = {**llava(tmp_path / "llava"), "format": "llava"}
    spec = {"phases": {"pretrain": d}, "shape": SHAPE, "model": "llava_tiny", "checkpoints": {}}
    argv = hostdata.node_argv(deepspeed_python, spec)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLAGBENCH_CACHE_DIR": str(tmp_path / "node-cache")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    theirs = hostdata.report("node", proc.returncode, proc.stdout, proc.stderr)["phases"]["pretrain"]
    monkeypatch.setenv("FLAGBENCH_CACHE_DIR", str(tmp_path / "cache"))
    ours = datacheck.check_phase(d, SHAPE, "llava_tiny", "pretrain")
    assert theirs == ours and ours["images"] == 6
    (tmp_path / "llava" / "data.json").write_text("[")  # bad data there: one line naming the file, exit 2
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    with pytest.raises(InputError, match=rf"^host node: phase pretrain: {tmp_path}/llava/data.json: not JSON"):
        hostdata.report("node", proc.returncode, proc.stdout, proc.stderr)
