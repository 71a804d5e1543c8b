"""Docker engines of the test cluster, reached over ssh:// (and the local socket); no mocks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker.errors
import pytest

from run_benchmarks.running.remote.containers import (
    LABEL_RUN_ID,
    ContainerSpec,
    Mount,
    base_images,
    cleanup_by_label,
    connect_engine,
    containers_of_run,
    engine_name,
    ensure_image,
    image_tag,
    run_container,
)
from run_benchmarks.running.remote.errors import ContainerTimeout, ImageBuildFailed
from tests.cluster.fixtures import HOST_PYTHON_PREFIX


@pytest.fixture(scope="module")
def engines(cluster, cluster_pool):
    clients = {h.name: connect_engine(h.docker_url, pool=cluster_pool) for h in cluster.hosts}
    yield clients
    for client in clients.values():
        client.close()


def _run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def _python_mounts(venv: Path, code: Path) -> list[Mount]:
    prefix = str(HOST_PYTHON_PREFIX)
    return [Mount(prefix, prefix, True), Mount(str(venv), str(venv), True), Mount(str(code), "/fb/code", True)]


def test_image_tag_follows_the_build_context(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM flagbench/cpu-base:bookworm\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a")
    first = image_tag(tmp_path, "fb/x")
    assert first.startswith("fb/x:") and len(first.split(":")[1]) == 16
    assert image_tag(tmp_path, "fb/x") == first
    (tmp_path / "Dockerfile").write_text("FROM flagbench/cpu-base:bookworm\nRUN true\n")
    changed = image_tag(tmp_path, "fb/x")
    assert changed != first
    (tmp_path / "sub" / "a.txt").rename(tmp_path / "sub" / "b.txt")
    assert image_tag(tmp_path, "fb/x") != changed
    assert image_tag(tmp_path, "fb/x", {"V": "1"}) != image_tag(tmp_path, "fb/x", {"V": "2"})


def test_base_images_of_a_dockerfile():
    text = textwrap.dedent("""\
        ARG BASE=nvcr.io/nvidia/pytorch:24.05-py3
        FROM ${BASE} AS build
        RUN make
        FROM build AS test
        FROM scratch
        FROM --platform=linux/amd64 debian:bookworm
        """)
    assert base_images(text) == ["nvcr.io/nvidia/pytorch:24.05-py3", "debian:bookworm"]
    assert base_images(text, {"BASE": "flagbench/cpu-base:bookworm"})[0] == "flagbench/cpu-base:bookworm"


@pytest.mark.cluster
def test_engine_over_ssh_and_local_socket_agree(cluster, engines):
    h1 = cluster.host("h1")
    local = connect_engine(h1.docker_socket)
    try:
        assert engine_name(engines["h1"]) == "h1"
        assert engine_name(local) == h1.docker_socket
        roots = [c.info()["DockerRootDir"] for c in (engines["h1"], local, engines["h2"])]
        assert roots[0] == roots[1] == str(Path(h1.docker_socket).parent / "docker")
        assert roots[2] != roots[0]
        assert engines["h1"].images.get(cluster.image).id == local.images.get(cluster.image).id
    finally:
        local.close()


@pytest.mark.cluster
def test_engine_over_ssh_without_a_pool(cluster):
    h2 = cluster.host("h2")
    client = connect_engine(h2.docker_url, key_file=cluster.key_file, known_hosts=cluster.known_hosts)
    try:
        assert client.info()["DockerRootDir"].endswith("/hosts/h2/docker")
    finally:
        client.close()


@pytest.mark.cluster
def test_stock_docker_sdk_ssh_transport_reaches_a_host(cluster, tmp_path):
    """The cluster serves the SDK's own ssh:// transport (it reads ~/.ssh/config)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(Path(cluster.ssh_config).read_text())
    (home / ".ssh" / "known_hosts").write_text(Path(cluster.known_hosts).read_text())
    code = "import docker; c = docker.DockerClient(base_url='ssh://h1'); print(c.info()['DockerRootDir']); c.close()"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(Path(cluster.host("h1").docker_socket).parent / "docker")


@pytest.mark.cluster
def test_ensure_image_builds_once_and_never_pulls(cluster, engines, tmp_path):
    client = engines["h1"]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {cluster.image}\nCOPY marker.txt /marker.txt\nRUN cat /marker.txt > /copied\n")
    (ctx / "marker.txt").write_text(uuid.uuid4().hex)
    tag = image_tag(ctx, "flagbench/test")
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(tag)
    image_id = ensure_image(client, ctx, "flagbench/test")
    assert client.images.get(tag).id == image_id
    count = len(client.images.list(all=True))
    start = time.monotonic()
    assert ensure_image(client, ctx, "flagbench/test") == image_id
    assert time.monotonic() - start < 1.0 and len(client.images.list(all=True)) == count
    (ctx / "marker.txt").write_text("changed")
    assert ensure_image(client, ctx, "flagbench/test") != image_id
    (ctx / "Dockerfile").write_text("FROM flagbench/not-imported:1\n")
    with pytest.raises(ImageBuildFailed, match="^h1: base image flagbench/not-imported:1 .*never pulled"):
        ensure_image(client, ctx, "flagbench/test")
    (ctx / "Dockerfile").write_text(f"FROM {cluster.image}\nRUN exit 3\n")
    with pytest.raises(ImageBuildFailed, match="^h1: building flagbench/test:"):
        ensure_image(client, ctx, "flagbench/test")


@pytest.mark.cluster
def test_container_runs_host_python_with_torch(cluster, engines, torch_venv, tmp_path):
    code, out = tmp_path / "code", tmp_path / "out"
    code.mkdir()
    out.mkdir()
    (code / "check.py").write_text(
        textwrap.dedent("""\
        import os, sys, torch
        print(torch.ones(2).sum(), os.environ["FB_TEST"], os.getcwd())
        open("/fb/out/result.txt", "w").write(str(float(torch.ones(2).sum())))
        try:
            open(os.path.join(sys.prefix, "x"), "w")
        except OSError as e:
            print("venv read-only:", e.errno == 30)
        """)
    )
    run_id = _run_id()
    spec = ContainerSpec(
        image=cluster.image,
        command=[f"{torch_venv}/bin/python", "/fb/code/check.py"],
        run_id=run_id,
        env={"FB_TEST": "env ok"},
        workdir="/fb/code",
        mounts=[*_python_mounts(torch_venv, code), Mount(str(out), "/fb/out")],
        shm_size="256m",
        ulimits=[("nofile", 4096, 4096)],
        labels={"purpose": "test"},
    )
    client = engines["h1"]
    try:
        with run_container(client, spec) as handle:
            rc = handle.wait(timeout=180)
            logs = handle.logs()
            assert rc == 0, logs
            attrs = client.api.inspect_container(handle.id)
            assert attrs["HostConfig"]["Privileged"] is False
            assert attrs["HostConfig"]["NetworkMode"] == "host"
            assert attrs["Config"]["Labels"] == {"purpose": "test", LABEL_RUN_ID: run_id}
        assert "tensor(2.) env ok /fb/code" in logs and "venv read-only: True" in logs
        assert (out / "result.txt").read_text() == "2.0"
        assert containers_of_run(client, run_id) == []
    finally:
        cleanup_by_label(client, run_id)


@pytest.mark.cluster
def test_wait_timeout_and_cleanup_by_label(cluster, engines):
    client = engines["h2"]
    run_id, other = _run_id(), _run_id()
    handles = [run_container(client, ContainerSpec(image=cluster.image, run_id=run_id, command=["sleep", "300"])) for _ in range(2)]
    keep = run_container(client, ContainerSpec(image=cluster.image, run_id=other, command=["sleep", "300"]))
    try:
        with pytest.raises(ContainerTimeout, match="^h2: container .* still running"):
            handles[0].wait(timeout=1)
        assert sorted(cleanup_by_label(client, run_id)) == sorted(h.name for h in handles)
        assert containers_of_run(client, run_id) == []
        assert [c.id for c in containers_of_run(client, other)] == [keep.id]
        with pytest.raises(ImageBuildFailed, match="never pulled"):
            run_container(client, ContainerSpec(image="flagbench/absent:1", run_id=run_id, command=["true"]))
    finally:
        cleanup_by_label(client, run_id)
        cleanup_by_label(client, other)
    assert containers_of_run(client, other) == []


@pytest.mark.cluster
def test_two_host_gloo_all_reduce(cluster, engines, torch_venv, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "allreduce.py").write_text(
        textwrap.dedent("""\
        import os, socket, torch, torch.distributed as dist
        dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print("rank", dist.get_rank(), "of", dist.get_world_size(), "sum", t.item(), flush=True)
        dist.destroy_process_group()
        """)
    )
    master = cluster.hosts[0].address
    port = str(random.randint(20000, 40000))
    run_id = _run_id()
    handles = {}
    try:
        for rank, host in enumerate(cluster.hosts[:2]):
            handles[host.name] = run_container(
                engines[host.name],
                ContainerSpec(
                    image=cluster.image,
                    run_id=run_id,
                    command=[f"{torch_venv}/bin/python", "/fb/code/allreduce.py"],
                    env={"MASTER_ADDR": master, "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank), "GLOO_SOCKET_IFNAME": "eth0"},
                    mounts=_python_mounts(torch_venv, code),
                    network_mode="host",
                ),
            )
        with ThreadPoolExecutor(2) as ex:
            rcs = dict(zip(handles, ex.map(lambda h: h.wait(timeout=150), handles.values()), strict=True))
        logs = {name: h.logs() for name, h in handles.items()}
        assert rcs == {"h1": 0, "h2": 0}, logs
        assert "rank 0 of 2 sum 3.0" in logs["h1"] and "rank 1 of 2 sum 3.0" in logs["h2"]
    finally:
        for host in cluster.hosts[:2]:
            cleanup_by_label(engines[host.name], run_id)
    for host in cluster.hosts[:2]:
        assert containers_of_run(engines[host.name], run_id) == []
