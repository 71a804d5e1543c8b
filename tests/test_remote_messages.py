"""Engine errors read as words: no Python repr of a nested exception in any message.
A real docker client against a local socket that hangs up, and one where nothing listens."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import docker
import pytest

from run_benchmarks.running.remote.containers import engine_errors
from run_benchmarks.running.remote.errors import EngineUnreachable


@pytest.fixture
def hangs_up() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts each connection, reads the request and closes it."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def _message(port: int) -> str:
    client = docker.DockerClient(base_url=f"tcp://127.0.0.1:{port}", version="1.41", timeout=5)
    with pytest.raises(EngineUnreachable) as info:
        with engine_errors("h2", "listing containers"):
            client.containers.list()
    return str(info.value)


def test_an_engine_that_hangs_up_is_said_in_words(hangs_up):
    msg = _message(hangs_up)
    assert msg == "h2: docker engine not answering (listing containers): Connection aborted: Remote end closed connection without response"


def test_an_engine_where_nothing_listens_is_said_in_words():
    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    msg = _message(port)
    assert msg.endswith("Failed to establish a new connection: [Errno 111] Connection refused"), msg
    assert " object at 0x" not in msg and "(Caused by" not in msg and "Error(" not in msg


def test_an_engine_error_with_its_own_explanation_is_one_line_naming_the_engine():
    """The docker SDK's APIError carries the engine's explanation as a string (a full work_dir:
    "no space left on device"): one ContainerError line, never a crash of the harness."""
    from run_benchmarks.running.remote.errors import ContainerError

    err = docker.errors.APIError("500 Server Error", explanation="mkdir /work/run: no space left on device\nmore detail")
    with pytest.raises(ContainerError) as exc, engine_errors("ssh://root@h1", "creating the container"):
        raise err
    assert "ssh://root@h1" in str(exc.value) and "creating the container: mkdir /work/run: no space left on device" in str(exc.value)
    assert "more detail" not in str(exc.value)
