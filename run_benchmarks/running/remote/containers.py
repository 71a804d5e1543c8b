"""Container engines on benchmark hosts (docker SDK 7.x): images by content hash, labelled runs.

``connect_engine`` reaches a host's docker engine over ``ssh://user@host:port`` through an
``SSHPool`` connection (each HTTP connection is one ``docker system dial-stdio`` channel,
as the docker CLI does), or through a local unix socket. Images are never pulled: an
image's tag is a hash of its build context, ``ensure_image`` builds it only when that tag is
missing and refuses to build when a ``FROM`` image is not already on the engine. Every
container of a run carries the label ``flagbench.run_id=<id>`` so ``cleanup_by_label`` can
remove all of them on success, failure, timeout or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import paramiko
import requests
from docker.transport import SSHHTTPAdapter, UnixHTTPAdapter
from docker.transport.basehttpadapter import BaseHTTPAdapter
from docker.transport.sshconn import SSHConnectionPool
from docker.types import DeviceRequest, Ulimit
from docker.types import Mount as DockerMount

from .errors import ContainerError, ContainerTimeout, EngineUnreachable, ImageBuildFailed, RemoteError
from .ssh import HostSpec, SSHPool

LABEL_RUN_ID = "flagbench.run_id"
LABEL_CONTEXT = "flagbench.context_sha256"
# docker.DockerClient needs a base URL at construction; with an explicit API version it
# does not connect, and the adapter we mount for "http+docker://" carries all traffic.
_PLACEHOLDER_URL = "unix:///nonexistent/flagbench-placeholder.sock"


# -- engines ------------------------------------------------------------------------------
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-f]+>:? ?")


def _words(exc: BaseException) -> str:
    """An exception's text; one that wraps others (requests, urllib3) as their words joined
    with ': ', never a tuple's repr ("('Connection aborted.', RemoteDisconnected(...))")."""
    reason = getattr(exc, "reason", None)  # urllib3's MaxRetryError: what failed
    if isinstance(reason, BaseException):
        return _words(reason)
    if not any(isinstance(a, BaseException) for a in exc.args):
        return _OBJECT_REPR.sub("", str(exc))
    parts = [_words(a) if isinstance(a, BaseException) else str(a) for a in exc.args]
    return ": ".join(p.strip().rstrip(".:") for p in parts if p.strip()) or type(exc).__name__


def brief(exc: BaseException | str) -> str:
    """An exception, or the docker engine's own explanation (a string), as one short line
    (docker and requests errors nest whole responses)."""
    words = exc if isinstance(exc, str) else _words(exc)
    lines = [ln.strip() for ln in words.splitlines() if ln.strip()]
    text = lines[0] if lines else (type(exc).__name__ if not isinstance(exc, str) else "the engine said nothing")
    return text if len(text) <= 300 else text[:297] + "..."


def _why(exc: BaseException, timeout: float | None) -> str:
    """What an engine call met, in one line: a timeout as the bound it ran out of."""
    timed_out = isinstance(exc, (requests.exceptions.Timeout, TimeoutError, socket.timeout)) or "timed out" in _words(exc).lower()
    return f"no reply within {timeout:g} s" if timed_out and timeout else brief(exc)


@contextlib.contextmanager
def longer_calls(client: docker.DockerClient, seconds: float) -> Iterator[None]:
    """Engine calls that take long by nature (loading an image) bounded by ``seconds``
    instead of the client's timeout, which is put back after."""
    before = client.api.timeout
    client.api.timeout = seconds
    try:
        yield
    finally:
        client.api.timeout = before


@contextlib.contextmanager
def engine_errors(engine: str, doing: str, timeout: float | None = None) -> Iterator[None]:
    """Turn what the docker SDK, HTTP and SSH raise during an engine call into one
    ``ContainerError`` line naming the engine; ``NotFound`` passes (callers expect it)."""
    try:
        yield
    except (RemoteError, docker.errors.NotFound):
        raise
    except docker.errors.APIError as e:
        raise ContainerError(engine, f"{doing}: {brief(e.explanation or e)}") from e
    except (docker.errors.DockerException, requests.exceptions.RequestException, paramiko.SSHException, OSError, EOFError) as e:
        raise EngineUnreachable(engine, f"docker engine not answering ({doing}): {_why(e, timeout)}") from e


class _Sessions:
    """What docker's SSHConnection asks of a paramiko transport, ``open_session()``, served
    by the pool: a refused session is asked again, then named (``SSHPool.session``)."""

    def __init__(self, ssh: SSHPool, host: str, transport: Any, timeout: float) -> None:
        self.ssh, self.host, self.transport, self.timeout = ssh, host, transport, timeout

    def open_session(self) -> Any:
        return self.ssh.session(self.host, self.transport, self.timeout)


class _TransportHolder:
    """What docker's SSHConnectionPool expects of a paramiko client: ``get_transport()``."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def get_transport(self) -> Any:
        return self._transport


class _PoolDialAdapter(BaseHTTPAdapter):
    """HTTP over ``docker system dial-stdio`` channels of an ``SSHPool`` connection."""

    def __init__(self, ssh: SSHPool, host: str, timeout: float, owns_pool: bool, max_pool_size: int = 10) -> None:
        super().__init__()
        self.ssh, self.host, self.timeout = ssh, host, timeout
        self._owns_pool = owns_pool
        self._max_pool_size = max_pool_size
        self._cpool: SSHConnectionPool | None = None
        self._cpool_transport: Any = None
        self._lock = threading.Lock()

    def get_connection(self, url: Any, proxies: Any = None) -> SSHConnectionPool:
        transport = self.ssh.transport(self.host)  # reconnects when the connection died
        with self._lock:
            if self._cpool is None or self._cpool_transport is not transport:
                if self._cpool is not None:
                    self._cpool.close()
                self._cpool = SSHConnectionPool(
                    ssh_client=_TransportHolder(_Sessions(self.ssh, self.host, transport, self.timeout)),
                    timeout=self.timeout,
                    maxsize=self._max_pool_size,
                )
                self._cpool_transport = transport
            return self._cpool

    def close(self) -> None:
        super().close()
        with self._lock:
            if self._cpool is not None:
                self._cpool.close()
                self._cpool = None
        if self._owns_pool:
            self.ssh.close()


def connect_engine(
    target: str,
    *,
    pool: SSHPool | None = None,
    key_file: str | None = None,
    known_hosts: str = "~/.ssh/known_hosts",
    accept_new_host_keys: bool = False,
    timeout: float = 120.0,
) -> docker.DockerClient:
    """A docker client for ``ssh://user@host[:port]``, ``unix:///path`` or a socket path.

    For ssh, the host is taken from ``pool`` (matched on user, address and port) so the
    pool's connection, host-key policy and key are used; without a pool a private one is
    made from ``key_file``/``known_hosts`` and closed with the client.
    """
    if target.startswith("ssh://"):
        url = urllib.parse.urlsplit(target)
        if not url.hostname:
            raise ValueError(f"no host in {target!r}")
        user, port = url.username or "root", url.port or 22
        owns = pool is None
        if pool is None:
            spec = HostSpec(
                name=f"{user}@{url.hostname}:{port}", address=url.hostname, port=port, user=user, key_file=key_file, known_hosts=known_hosts
            )
            pool = SSHPool([spec], accept_new_host_keys=accept_new_host_keys)
        else:
            matches = [s for s in pool.hosts.values() if (s.address, s.port, s.user) == (url.hostname, port, user)]
            if not matches:
                raise ValueError(f"{target}: no host in the pool with that user/address/port")
            spec = matches[0]
        adapter = _PoolDialAdapter(pool, spec.name, timeout, owns_pool=owns)
        try:
            return _client_over(adapter, spec.name, timeout)
        except BaseException:
            adapter.close()
            raise
    path = target[len("unix://") :] if target.startswith("unix://") else target
    if not path.startswith("/"):
        raise ValueError(f"engine target must be ssh://..., unix:///... or a path: {target!r}")
    try:
        return docker.DockerClient(base_url=f"unix://{path}", version="auto", timeout=timeout)
    except docker.errors.DockerException as e:
        raise EngineUnreachable(path, f"docker engine not answering: {e}") from e


def _client_over(adapter: _PoolDialAdapter, name: str, timeout: float) -> docker.DockerClient:
    try:
        probe = docker.APIClient(base_url=_PLACEHOLDER_URL, version="1.24", timeout=timeout)
        probe.mount("http+docker://", adapter)
        version = probe.version(api_version=False)["ApiVersion"]
    except RemoteError:
        raise
    except (docker.errors.DockerException, requests.exceptions.RequestException, paramiko.SSHException, OSError, EOFError) as e:
        raise EngineUnreachable(name, f"docker engine not answering over ssh: {_why(e, timeout)}") from e
    client = docker.DockerClient(base_url=_PLACEHOLDER_URL, version=version, timeout=timeout)
    client.api.mount("http+docker://", adapter)
    return client


def engine_name(client: docker.DockerClient) -> str:
    """The host or socket a client talks to, for messages."""
    adapter = client.api.adapters.get("http+docker://")
    if isinstance(adapter, _PoolDialAdapter):
        return adapter.host
    if isinstance(adapter, UnixHTTPAdapter):
        return adapter.socket_path
    if isinstance(adapter, SSHHTTPAdapter):
        return adapter.ssh_host
    return str(client.api.base_url)


# -- images -------------------------------------------------------------------------------
def context_digest(context_dir: str | os.PathLike[str], buildargs: Mapping[str, str] | None = None) -> str:
    """sha256 over the context's files (sorted relative paths, exec bits, contents) and args."""
    root = Path(context_dir)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fname in sorted(filenames):
            path = Path(dirpath, fname)
            rel = path.relative_to(root).as_posix()
            h.update(b"F\0" + rel.encode() + b"\0")
            if path.is_symlink():
                h.update(b"L\0" + os.readlink(path).encode() + b"\0")
                continue
            h.update(b"X\0" if os.access(path, os.X_OK) else b"-\0")
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            h.update(b"\0")
    for key, value in sorted((buildargs or {}).items()):
        h.update(f"A\0{key}={value}\0".encode())
    return h.hexdigest()


def image_tag(context_dir: str | os.PathLike[str], name: str, buildargs: Mapping[str, str] | None = None) -> str:
    """``name:<first 16 hex of the context digest>``: a changed context gives a new tag."""
    return f"{name}:{context_digest(context_dir, buildargs)[:16]}"


_FROM = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", re.I | re.M)
_ARG = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?", re.I | re.M)


def base_images(dockerfile_text: str, buildargs: Mapping[str, str] | None = None) -> list[str]:
    """The external images a Dockerfile starts from (stages and ``scratch`` left out)."""
    first_from = _FROM.search(dockerfile_text)
    head = dockerfile_text[: first_from.start()] if first_from else ""
    args = {m.group(1): (m.group(2) or "").strip("\"'") for m in _ARG.finditer(head)}
    args.update(buildargs or {})

    def expand(ref: str) -> str:
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), ""), ref)

    stages: set[str] = set()
    out: list[str] = []
    for m in _FROM.finditer(dockerfile_text):
        ref = expand(m.group(1))
        if ref.lower() != "scratch" and ref.lower() not in stages and ref not in out:
            out.append(ref)
        if m.group(2):
            stages.add(m.group(2).lower())
    return out


def ensure_image(
    client: docker.DockerClient,
    context_dir: str | os.PathLike[str],
    name: str,
    buildargs: Mapping[str, str] | None = None,
    *,
    dockerfile: str = "Dockerfile",
    timeout: float = 3600.0,
) -> str:
    """Build ``image_tag(context_dir, name, buildargs)`` unless present; the image id.

    Never pulls: every ``FROM`` image must already be on the engine.
    """
    engine = engine_name(client)
    tag = image_tag(context_dir, name, buildargs)
    with engine_errors(engine, f"looking up {tag}", client.api.timeout):
        try:
            return client.images.get(tag).id
        except docker.errors.ImageNotFound:
            pass
    text = (Path(context_dir) / dockerfile).read_text()
    missing = [ref for ref in base_images(text, buildargs) if not has_image(client, ref)]
    if missing:
        raise ImageBuildFailed(
            engine,
            f"base image {', '.join(missing)} of {tag} is not on the engine; images are "
            "never pulled: load it there (start_task.py --cluster FILE --load-images, docs/clusters.md)",
        )
    try:
        image, _ = client.images.build(
            path=str(context_dir),
            dockerfile=dockerfile,
            tag=tag,
            buildargs=dict(buildargs or {}),
            pull=False,
            rm=True,
            forcerm=True,
            timeout=int(timeout),
            labels={LABEL_CONTEXT: context_digest(context_dir, buildargs)},
        )
    except docker.errors.BuildError as e:
        log = "".join(str(chunk.get("stream") or chunk.get("error") or "") for chunk in e.build_log)
        raise ImageBuildFailed(engine, f"building {tag} failed: {e.msg}", log=log) from e
    except docker.errors.APIError as e:
        raise ImageBuildFailed(engine, f"building {tag} failed: {brief(e)}") from e
    except (docker.errors.DockerException, requests.exceptions.RequestException, paramiko.SSHException, OSError, EOFError) as e:
        raise EngineUnreachable(engine, f"docker engine not answering (building {tag}): {brief(e)}") from e
    return image.id


def has_image(client: docker.DockerClient, ref: str) -> bool:
    """Whether the engine holds the image ``ref``."""
    with engine_errors(engine_name(client), f"looking up {ref}", client.api.timeout):
        try:
            client.images.get(ref)
            return True
        except docker.errors.ImageNotFound:
            return False


# -- containers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


def nvidia_gpus(count: int = -1, device_ids: Sequence[str] | None = None) -> DeviceRequest:
    """A device request for NVIDIA GPUs (all by default), as ``--gpus`` makes."""
    return DeviceRequest(
        driver="nvidia", count=None if device_ids else count, device_ids=list(device_ids) if device_ids else None, capabilities=[["gpu"]]
    )


@dataclass
class ContainerSpec:
    """One container of a run. ``ulimits`` are (name, soft, hard); mounts are bind mounts."""

    image: str
    command: list[str]
    run_id: str
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    device_requests: list[DeviceRequest] = field(default_factory=list)
    shm_size: str | None = None
    ulimits: list[tuple[str, int, int]] = field(default_factory=list)
    network_mode: str = "host"
    ipc_mode: str | None = None
    privileged: bool = False
    cap_add: list[str] = field(default_factory=list)
    workdir: str | None = None
    user: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    init: bool = True  # a tiny init as PID 1: reaps what the launcher's ranks leave and forwards signals

    def __post_init__(self) -> None:
        self.mounts = [m if isinstance(m, Mount) else Mount(*m) for m in self.mounts]
        if not self.command:
            raise ValueError("ContainerSpec.command is empty")
        if not self.run_id:
            raise ValueError("ContainerSpec.run_id is empty")


def vendor_container(
    opts: Any,
    *,
    image: str,
    command: list[str],
    run_id: str,
    name: str | None,
    env: Mapping[str, str],
    mounts: Sequence[Mount],
    workdir: str | None,
) -> ContainerSpec:
    """The one translation of a vendor's ``container`` options (config.ContainerOptions) into a
    container: the SSH runtime starts it through the engine, the Slurm node wrapper renders it
    with ``docker_run_args``. Host network, the vendor's env, device nodes and mounts; NVIDIA's
    device request and the host IPC namespace (shared memory between ranks) with ``gpus``."""
    extra = []
    for m in opts.mounts:
        src, dst, *mode = m.split(":")
        extra.append(Mount(src, dst, mode == ["ro"]))
    return ContainerSpec(
        image=image,
        command=list(command),
        run_id=run_id,
        name=name,
        env={**opts.extra_env, **env},
        mounts=[*mounts, *extra],
        devices=[f"{d}:{d}:rwm" if ":" not in d else d for d in opts.devices],
        device_requests=[nvidia_gpus()] if opts.gpus else [],
        shm_size=opts.shm_size,
        ulimits=[(n, v, v) for n, v in opts.ulimits.items()],
        network_mode="host",
        ipc_mode="host" if opts.gpus else None,
        privileged=opts.privileged,
        workdir=workdir,
    )


def docker_run_args(spec: ContainerSpec) -> list[str]:
    """``spec`` as the options of ``docker run`` (the image and command not included)."""
    out = ["--network", spec.network_mode] + (["--init"] if spec.init else [])
    if spec.ipc_mode:
        out += ["--ipc", spec.ipc_mode]
    if spec.shm_size:
        out += ["--shm-size", spec.shm_size]
    for n, soft, hard in sorted(spec.ulimits):
        out += ["--ulimit", f"{n}={soft}:{hard}"]
    if spec.device_requests:
        out += ["--gpus", "all"]
    for d in spec.devices:
        out += ["--device", d]
    if spec.privileged:
        out.append("--privileged")
    for k, v in sorted(spec.env.items()):
        out += ["--env", f"{k}={v}"]
    for m in spec.mounts:
        out += ["--volume", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
    if spec.workdir:
        out += ["--workdir", spec.workdir]
    return out


class ContainerHandle:
    """A started container: wait for it, read its logs, remove it."""

    def __init__(self, container: Any, engine: str, spec: ContainerSpec) -> None:
        self.container = container
        self.engine = engine
        self.spec = spec

    @property
    def id(self) -> str:
        return self.container.id

    @property
    def name(self) -> str:
        return self.container.name

    def wait(self, timeout: float) -> int:
        """The container's exit code; ``ContainerTimeout`` if it runs past ``timeout``."""
        start = time.monotonic()
        try:
            return int(self.container.wait(timeout=timeout)["StatusCode"])
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as e:
            if time.monotonic() - start >= timeout * 0.95:
                raise ContainerTimeout(self.engine, f"container {self.name} still running after {timeout}s", timeout=timeout) from None
            raise EngineUnreachable(self.engine, f"waiting for {self.name}: {e}") from e

    def logs(self, tail: int | None = None) -> str:
        """stdout and stderr so far, interleaved as the engine recorded them."""
        with engine_errors(self.engine, f"reading the logs of {self.name}", self.container.client.api.timeout):
            data = self.container.logs(stdout=True, stderr=True, tail=tail if tail else "all")
        return data.decode("utf-8", "replace")

    def stop_and_remove(self, timeout: int = 10) -> None:
        """Stop (TERM, KILL after ``timeout`` s) and remove; a missing container is fine."""
        with engine_errors(self.engine, f"removing {self.name}", self.container.client.api.timeout):
            try:
                self.container.stop(timeout=timeout)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError:
                pass
            try:
                self.container.remove(force=True)
            except docker.errors.NotFound:
                pass

    def __enter__(self) -> ContainerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_and_remove()


def run_container(client: docker.DockerClient, spec: ContainerSpec) -> ContainerHandle:
    """Create and start a detached container labelled with the run id (never pulls)."""
    engine = engine_name(client)
    kwargs: dict[str, Any] = dict(
        image=spec.image,
        command=list(spec.command),
        detach=True,
        environment=dict(spec.env),
        labels={**spec.labels, LABEL_RUN_ID: spec.run_id},
        mounts=[DockerMount(target=m.target, source=m.source, type="bind", read_only=m.read_only) for m in spec.mounts],
        network_mode=spec.network_mode,
        privileged=spec.privileged,
        init=spec.init,
    )
    optional = dict(
        name=spec.name,
        ipc_mode=spec.ipc_mode,
        shm_size=spec.shm_size,
        working_dir=spec.workdir,
        user=spec.user,
        cap_add=spec.cap_add or None,
        devices=spec.devices or None,
        device_requests=spec.device_requests or None,
        ulimits=[Ulimit(name=n, soft=s, hard=h) for n, s, h in spec.ulimits] or None,
    )
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    with engine_errors(engine, f"creating a container of {spec.image}", client.api.timeout):
        try:
            container = client.containers.create(**kwargs)  # create() never pulls; run() would
        except docker.errors.ImageNotFound as e:
            raise ImageBuildFailed(engine, f"image {spec.image} is not on the engine (images are never pulled)") from e
    handle = ContainerHandle(container, engine, spec)
    try:
        with engine_errors(engine, f"starting {handle.name}", client.api.timeout):
            container.start()
    except BaseException:
        with contextlib.suppress(RemoteError):  # the engine may be what failed
            handle.stop_and_remove(timeout=0)
        raise
    return handle


def containers_of_run(client: docker.DockerClient, run_id: str | None) -> list[Any]:
    """Every container (running or not) labelled with ``run_id``; with None, of any run."""
    label = LABEL_RUN_ID if run_id is None else f"{LABEL_RUN_ID}={run_id}"
    with engine_errors(engine_name(client), "listing containers", client.api.timeout):
        return client.containers.list(all=True, filters={"label": label})


def cleanup_by_label(client: docker.DockerClient, run_id: str) -> list[str]:
    """Force-remove every container of ``run_id``; the names removed."""
    return _remove(client, containers_of_run(client, run_id))


def remove_other_runs(client: docker.DockerClient, run_id: str | None) -> dict[str, list[str]]:
    """Force-remove the containers of every run but ``run_id``: {run id: names removed}."""
    found = [c for c in containers_of_run(client, None) if c.labels.get(LABEL_RUN_ID) != run_id]
    removed: dict[str, list[str]] = {}
    for c in found:
        if _remove(client, [c]):
            removed.setdefault(c.labels.get(LABEL_RUN_ID, "?"), []).append(c.name)
    return removed


def _remove(client: docker.DockerClient, containers: list[Any]) -> list[str]:
    removed = []
    with engine_errors(engine_name(client), "removing containers", client.api.timeout):
        for container in containers:
            try:
                container.remove(force=True)
                removed.append(container.name)
            except docker.errors.NotFound:
                pass
    return removed


__all__ = [
    "LABEL_RUN_ID",
    "ContainerHandle",
    "ContainerSpec",
    "Mount",
    "base_images",
    "brief",
    "cleanup_by_label",
    "connect_engine",
    "containers_of_run",
    "context_digest",
    "engine_errors",
    "engine_name",
    "ensure_image",
    "has_image",
    "image_tag",
    "nvidia_gpus",
    "remove_other_runs",
    "run_container",
]
