"""The framework environment's bin/ in front of PATH for the launcher, also when the node
agent starts it with ``docker run`` (the Slurm runtime's containers): the image's own PATH
is read from the image, so its tools stay reachable behind the environment's (ninja for
DeepSpeed's JIT-built ops)."""

from __future__ import annotations

import io
import os

import pytest

from run_benchmarks.running import node_agent


def test_without_an_engine_the_debian_default_is_assumed(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert node_agent.image_path("flagbench/none:1") == node_agent.IMAGE_DEFAULT_PATH


@pytest.mark.cluster
def test_the_image_path_comes_from_the_image(cluster, monkeypatch):
    import docker

    host = cluster.hosts[0]
    client = docker.DockerClient(base_url=f"unix://{host.docker_socket}")
    dockerfile = f"FROM {cluster.image or 'flagbench/cpu-base:bookworm'}\nENV PATH=/opt/tools/bin:/usr/bin:/bin\n"
    image, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag="flagbench/test-path:1", rm=True)
    try:
        monkeypatch.setenv("DOCKER_HOST", f"unix://{host.docker_socket}")
        assert node_agent.image_path("flagbench/test-path:1") == "/opt/tools/bin:/usr/bin:/bin"
        argv = node_agent.container_argv(
            {"image": "flagbench/test-path:1", "options": []},
            "n0",
            {"PATH": os.pathsep.join(["/env/bin", node_agent.image_path("flagbench/test-path:1")])},
            "/",
            ["/env/bin/python", "-V"],
        )
        assert argv[argv.index("--env") + 1] == "PATH=/env/bin:/opt/tools/bin:/usr/bin:/bin"
    finally:
        client.images.remove(image.id, force=True)
        client.close()
