"""A real test cluster on one machine: N hosts, each a network namespace with sshd + dockerd.

Layout (index ``i`` is the first free one, so two clusters can coexist)::

    bridge fbbr<i> 10.210.<i>.254/24
      veth fb<i>v<j>  <->  eth0 10.210.<i>.<j> in namespace fb<i>h<j>
        sshd   (own host key; private /run and UTS via unshare; empty ~/.bashrc)
        dockerd (own data-root, exec-root, pidfile, socket; overlay2 or vfs)

Inside a host's ssh session ``/var/run/docker.sock`` is a link to that host's dockerd
socket, so ``docker system dial-stdio`` (the docker SDK's ssh transport) reaches it; the
test process reaches it directly at ``hosts[*].docker_socket``. Everything started is
recorded (with PIDs) in ``<dir>/cluster.json`` as soon as it exists; ``down`` ends it by
PID and deletes the namespaces, veths and bridge; it is idempotent.

CLI: ``python -m tests.cluster.netns up N DIR [--no-image] [--storage-driver D]`` and
``python -m tests.cluster.netns down DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .baseimage import IMAGE_REF, build_tarball

REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "mount", "umount", "ssh-keygen", "dockerd", "containerd", "runc", "docker", "setsid")
SSHD = "/usr/sbin/sshd"
MAX_CLUSTERS = 32


_SAVE_LOCK = threading.Lock()


class ClusterError(RuntimeError):
    pass


@dataclass
class HostInfo:
    name: str
    address: str
    port: int
    user: str
    netns: str
    veth: str
    hostname: str
    workdir: str
    docker_socket: str
    docker_url: str
    host_key: str
    sshd_pid: int | None = None
    dockerd_pid: int | None = None
    containerd_pid: int | None = None


@dataclass
class Cluster:
    dir: str
    index: int
    bridge: str
    bridge_address: str
    subnet: str
    key_file: str
    public_key_file: str
    known_hosts: str
    ssh_config: str
    storage_driver: str
    image: str | None = None
    state: str = "starting"
    owner_pid: int | None = None
    hosts: list[HostInfo] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def json_path(self) -> Path:
        return Path(self.dir) / "cluster.json"

    def save(self) -> None:
        # hosts start in parallel threads and each records its PIDs: one writer at a time
        with _SAVE_LOCK:
            tmp = self.json_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
            os.replace(tmp, self.json_path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        path = Path(path)
        data = json.loads((path / "cluster.json" if path.is_dir() else path).read_text())
        data["hosts"] = [HostInfo(**h) for h in data["hosts"]]
        return cls(**data)

    def host(self, name: str) -> HostInfo:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def host_specs(self, **overrides: object) -> list:
        """``HostSpec`` objects for ``run_benchmarks.running.remote.ssh.SSHPool``."""
        from run_benchmarks.running.remote.ssh import HostSpec

        base = dict(key_file=self.key_file, known_hosts=self.known_hosts)
        base.update(overrides)
        return [HostSpec(name=h.name, address=h.address, port=h.port, user=h.user, **base) for h in self.hosts]


def missing_requirements() -> list[str]:
    """What keeps a cluster from being built here (empty when it can be)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    missing += [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if not os.path.exists(SSHD):
        missing.append(SSHD)
    return missing


def _sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def _claim_index() -> int:
    """Create the first free bridge fbbr<i> whose subnet is unused; creating it is the claim."""
    for i in range(MAX_CLUSTERS):
        if _sh("ip", "route", "show", f"10.210.{i}.0/24", check=False).stdout.strip():
            continue
        if _sh("ip", "link", "add", f"fbbr{i}", "type", "bridge", check=False).returncode == 0:
            return i
    raise ClusterError("no free cluster index (fbbr0..fbbr31 all exist)")


def _wait(what: str, ready, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not ready():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise ClusterError(f"{what} exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} not ready after {timeout}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _tcp_open(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def _docker_ready(sock: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1.0)
            s.connect(sock)
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in s.recv(256)
    except OSError:
        return False


SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxSessions 64
MaxStartups 64:30:128
LogLevel ERROR
Subsystem sftp internal-sftp
"""


def _start_sshd(c: Cluster, h: HostInfo, hdir: Path, env: dict[str, str] | None = None) -> None:
    cfg = hdir / "sshd_config"
    if env is not None or not cfg.exists():  # a restart keeps the config (and its SetEnv)
        cfg.write_text(
            SSHD_CONFIG.format(port=h.port, address=h.address, host_key=h.host_key, authorized_keys=Path(c.dir) / "authorized_keys")
            # one SetEnv line: sshd takes the first line of a keyword
            + (f"SetEnv {' '.join(f'{k}={v}' for k, v in env.items())}\n" if env else "")
        )
    empty = hdir / "empty_bashrc"
    empty.write_text("")
    q = lambda s: "'" + str(s).replace("'", "'\\''") + "'"
    bashrc = os.path.expanduser("~/.bashrc")
    script = "; ".join(
        [
            f"hostname {h.hostname}",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            "mkdir -p /run/sshd /run/lock",  # /run/lock: where runs take the host's lock
            f"ln -s {q(h.docker_socket)} /run/docker.sock",
            *([f"mount --bind {q(empty)} {q(bashrc)}"] if os.path.exists(bashrc) else []),
            f"exec {SSHD} -D -e -f {q(cfg)}",
        ]
    )
    log = hdir / "sshd.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    h.sshd_pid = proc.pid
    c.save()
    _wait(f"sshd of {h.name}", lambda: _tcp_open(h.address, h.port), 15, proc, log)


def extra_sshd(c: Cluster, name: str, port: int, **options: str) -> subprocess.Popen:
    """A second sshd of host ``name`` on ``port``, its config the cluster's with ``options``
    (sshd_config keywords, e.g. ``MaxSessions="1"``) in place of the same keywords; ready
    when this returns. The caller ends it by its PID (``end_extra_sshd``)."""
    h, hdir = c.host(name), Path(c.dir) / "hosts" / name
    base = SSHD_CONFIG.format(port=port, address=h.address, host_key=h.host_key, authorized_keys=Path(c.dir) / "authorized_keys")
    lines = [ln for ln in base.splitlines() if ln.split(" ", 1)[0] not in options]
    cfg = hdir / f"sshd_config.{port}"
    cfg.write_text("\n".join(lines + [f"{k} {v}" for k, v in options.items()]) + "\n")
    # as the host's own sshd: its engine at /run/docker.sock, an empty ~/.bashrc (when there is one)
    script = (
        'mount -t tmpfs -o mode=755 tmpfs /run && mkdir -p /run/sshd /run/lock && ln -s "$2" /run/docker.sock && '
        '{ [ -z "$3" ] || mount --bind "$3" "$4"; } && exec "$0" -D -e -f "$1"'
    )
    bashrc = os.path.expanduser("~/.bashrc")
    (hdir / "empty_bashrc").write_text("")
    quiet = [str(hdir / "empty_bashrc"), bashrc] if os.path.exists(bashrc) else ["", ""]
    log = hdir / f"sshd.{port}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{h.netns}",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                SSHD,
                str(cfg),
                h.docker_socket,
                *quiet,
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        _wait(f"sshd of {name} on port {port}", lambda: _tcp_open(h.address, port), 15, proc, log)
    except BaseException:
        end_extra_sshd(proc)
        raise
    return proc


def end_extra_sshd(proc: subprocess.Popen) -> None:
    """End a sshd that ``extra_sshd`` started, and its sessions, stopped or not."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)  # a stopped one first runs again, to take its TERM
    for session in _children(proc.pid):
        _end(session, "", timeout=5)
    _end(proc.pid, "", timeout=5)
    proc.wait(timeout=10)


def _start_dockerd(c: Cluster, h: HostInfo, hdir: Path) -> None:
    (hdir / "daemon.json").write_text("{}\n")
    log = hdir / "dockerd.log"
    argv = [
        "nsenter",
        f"--net=/run/netns/{h.netns}",
        "dockerd",
        "--config-file",
        str(hdir / "daemon.json"),
        "--data-root",
        str(hdir / "docker"),
        "--exec-root",
        str(hdir / "docker-exec"),
        "--pidfile",
        str(hdir / "dockerd.pid"),
        "--host",
        f"unix://{h.docker_socket}",
        "--storage-driver",
        c.storage_driver,
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--ip-masq=false",
        "--userland-proxy=false",
        "--shutdown-timeout",
        "3",
        "--log-level",
        "warn",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    h.dockerd_pid = proc.pid
    c.save()
    _wait(f"dockerd of {h.name}", lambda: _docker_ready(h.docker_socket), 60, proc, log)
    h.containerd_pid = next((p for p in _children(proc.pid) if "containerd" in _cmdline(p)), None)
    c.save()


def _import_image(h: HostInfo, tarball: Path, ref: str) -> None:
    import docker

    repo, tag = ref.rsplit(":", 1)
    client = docker.DockerClient(base_url=f"unix://{h.docker_socket}", timeout=300)
    try:
        client.api.import_image_from_file(str(tarball), repository=repo, tag=tag)
        client.images.get(ref)
    finally:
        client.close()


def up(
    n: int,
    directory: str | os.PathLike[str],
    *,
    image: bool = True,
    storage_driver: str = "overlay2",
    user: str = "root",
    owner_pid: int | None = None,
    ssh_env: dict[str, dict[str, str]] | None = None,
    log=print,
) -> Cluster:
    """Build an n-host cluster recorded in ``<directory>/cluster.json``; undone on failure.

    ``owner_pid``: the process whose lifetime bounds the cluster's (``sweep_stale`` tears
    the cluster down once that process is gone); None for a cluster kept until ``down``.
    ``ssh_env``: per host name, variables every SSH session there gets (sshd ``SetEnv``),
    e.g. a pip without its configuration, as on a host without a package mirror.
    """
    if n < 1 or n > 250:
        raise ValueError("n must be in 1..250")
    missing = missing_requirements()
    if missing:
        raise ClusterError(f"cannot build a cluster here, missing: {', '.join(missing)}")
    t0 = time.monotonic()
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if (root / "cluster.json").exists() and Cluster.load(root).state != "down":
        raise ClusterError(f"{root} already holds a cluster; run down first")
    tarball = build_tarball(log=log) if image else None
    # A previous cluster's keys: ssh-keygen would ask before overwriting them.
    for old in [root / "client_key", root / "client_key.pub", *root.glob("hosts/*/ssh_host_*")]:
        old.unlink(missing_ok=True)
    i = _claim_index()
    c = Cluster(
        dir=str(root),
        index=i,
        bridge=f"fbbr{i}",
        bridge_address=f"10.210.{i}.254",
        subnet=f"10.210.{i}.0/24",
        key_file=str(root / "client_key"),
        public_key_file=str(root / "client_key.pub"),
        known_hosts=str(root / "known_hosts"),
        ssh_config=str(root / "ssh_config"),
        storage_driver=storage_driver,
        owner_pid=owner_pid,
    )
    c.save()
    try:
        _sh("ip", "addr", "add", f"{c.bridge_address}/24", "dev", c.bridge)
        _sh("ip", "link", "set", c.bridge, "up")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "flagbench-cluster", "-f", c.key_file)
        (root / "authorized_keys").write_text(Path(c.public_key_file).read_text())
        for j in range(1, n + 1):
            hdir = root / "hosts" / f"h{j}"
            (hdir / "work").mkdir(parents=True, exist_ok=True)
            key = hdir / "ssh_host_ed25519_key"
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"h{j}", "-f", str(key))
            address = f"10.210.{i}.{j}"
            h = HostInfo(
                name=f"h{j}",
                address=address,
                port=22,
                user=user,
                netns=f"fb{i}h{j}",
                veth=f"fb{i}v{j}",
                hostname=f"fb{i}-h{j}",
                workdir=str(hdir / "work"),
                docker_socket=str(hdir / "docker.sock"),
                docker_url=f"ssh://{user}@{address}:22",
                host_key=str(key),
            )
            c.hosts.append(h)
            c.save()
            _sh("ip", "netns", "add", h.netns)
            _sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _sh("ip", "link", "set", h.veth, "master", c.bridge, "up")
            _sh("ip", "-n", h.netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _sh("ip", "-n", h.netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
        _write_client_files(c)

        def start(h: HostInfo) -> None:
            hdir = root / "hosts" / h.name
            _start_dockerd(c, h, hdir)
            _start_sshd(c, h, hdir, (ssh_env or {}).get(h.name, {}))
            if tarball is not None:
                _import_image(h, tarball, IMAGE_REF)

        with ThreadPoolExecutor(max_workers=min(8, n)) as ex:
            for f in [ex.submit(start, h) for h in c.hosts]:
                f.result()
        c.image = IMAGE_REF if tarball is not None else None
        c.state = "up"
        c.timings["up_s"] = round(time.monotonic() - t0, 2)
        c.save()
        return c
    except BaseException:
        down(root, log=log)
        raise


def _write_client_files(c: Cluster) -> None:
    lines, config = [], []
    for h in c.hosts:
        pub = Path(h.host_key + ".pub").read_text().split()
        lines.append(f"{h.address} {pub[0]} {pub[1]}\n")
        config.append(
            f"Host {h.name} {h.address}\n  HostName {h.address}\n  Port {h.port}\n"
            f"  User {h.user}\n  IdentityFile {c.key_file}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {c.known_hosts}\n  StrictHostKeyChecking yes\n"
        )
    Path(c.known_hosts).write_text("".join(lines))
    Path(c.ssh_config).write_text("\n".join(config))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    """True while pid runs (a zombie child of ours is reaped and counts as ended)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _end(pid: int | None, expect: str, timeout: float = 10.0) -> None:
    """TERM then KILL one process we started, if that PID is still the process we started."""
    if not pid or not _alive(pid) or expect not in _cmdline(pid):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(pid):
            return


def stop_daemon(c: Cluster, name: str, daemon: str) -> None:
    """Stop one host's ``sshd`` (with its sessions: the host is unreachable) or crash its
    ``dockerd`` (SIGKILL, then containerd: containers outlive the engine, which finds them
    again, stopped, when it starts), as a failing host would."""
    h, hdir = c.host(name), Path(c.dir) / "hosts" / name
    if daemon == "sshd":
        pid = h.sshd_pid
        if not (pid and _alive(pid) and f"-f {hdir / 'sshd_config'}" in _cmdline(pid)):
            return
        # Stopped first, the daemon accepts no session while its sessions end (one sshd per
        # connection); a session accepted between the two would outlive it, and the host
        # would stay reachable through it.
        os.kill(pid, signal.SIGSTOP)
        while sessions := [c for c in _children(pid) if _alive(c)]:  # ended ones stay, unreaped
            for session in sessions:
                _end(session, "", timeout=5)
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)
    elif daemon == "dockerd":
        # not TERM: a stopping engine still answers while it stops its containers, and the
        # harness would see them exit and remove them, a race a crash does not have
        if h.dockerd_pid and _alive(h.dockerd_pid) and f"--data-root {hdir / 'docker'} " in _cmdline(h.dockerd_pid):
            os.kill(h.dockerd_pid, signal.SIGKILL)
            while _alive(h.dockerd_pid):
                time.sleep(0.05)
        _end(h.containerd_pid, str(hdir / "docker-exec"))
        # Their pid files stay behind. A killed process lingers as a zombie until its
        # parent reaps it (containerd's is init, once the engine is gone), and the next
        # dockerd takes a pid file naming one for a containerd still running: it waits
        # on that containerd's socket, which no one opens, and gives up after 15 s.
        for pidfile in (hdir / "dockerd.pid", hdir / "docker-exec" / "containerd" / "containerd.pid"):
            pidfile.unlink(missing_ok=True)
    else:
        raise ValueError(daemon)


def start_daemon(c: Cluster, name: str, daemon: str) -> None:
    """Start a stopped ``sshd`` or ``dockerd`` of one host again (the host comes back)."""
    h, hdir = c.host(name), Path(c.dir) / "hosts" / name
    {"sshd": _start_sshd, "dockerd": _start_dockerd}[daemon](c, h, hdir)


def restore(c: Cluster) -> list[str]:
    """Start again every ``sshd`` and ``dockerd`` of the cluster that is not running (a
    test that stops one and fails before starting it leaves the next test a broken host);
    returns what it started, as "h2 dockerd"."""
    started = []
    for h in c.hosts:
        hdir = Path(c.dir) / "hosts" / h.name
        if not (h.sshd_pid and _alive(h.sshd_pid)):
            stop_daemon(c, h.name, "sshd")
            _start_sshd(c, h, hdir)
            started.append(f"{h.name} sshd")
        if not _docker_ready(h.docker_socket):
            stop_daemon(c, h.name, "dockerd")
            _start_dockerd(c, h, hdir)
            started.append(f"{h.name} dockerd")
    return started


def _remove_containers(h: HostInfo) -> None:
    if not _docker_ready(h.docker_socket):
        return
    import docker

    client = docker.DockerClient(base_url=f"unix://{h.docker_socket}", timeout=30)
    try:
        for ctr in client.containers.list(all=True):
            ctr.remove(force=True)
    except Exception:
        pass
    finally:
        client.close()


def _stop_host(root: Path, h: HostInfo) -> None:
    hdir = root / "hosts" / h.name
    _remove_containers(h)
    _end(h.sshd_pid, f"-f {hdir / 'sshd_config'}")
    _end(h.dockerd_pid, f"--data-root {hdir / 'docker'} ", timeout=15)
    _end(h.containerd_pid, str(hdir / "docker-exec"))
    # Whatever is left in a namespace we made is ours: ssh sessions, commands the tests
    # started, containerd shims and container processes of a daemon that did not stop.
    for pid in _sh("ip", "netns", "pids", h.netns, check=False).stdout.split():
        _end(int(pid), "", timeout=5)


def down(directory: str | os.PathLike[str], *, log=print) -> None:
    """Stop everything recorded in ``<directory>/cluster.json``; safe to call repeatedly."""
    root = Path(directory).resolve()
    if not (root / "cluster.json").exists():
        return
    t0 = time.monotonic()
    c = Cluster.load(root)
    if c.state == "down":
        return  # PIDs and names may belong to someone else by now
    workers = max(1, min(8, len(c.hosts)))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(lambda h: _stop_host(root, h), c.hosts))
    t1 = time.monotonic()
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        _sh("umount", "-l", m, check=False)
    for h in c.hosts:
        if _sh("ip", "netns", "pids", h.netns, check=False).stdout.strip():
            log(f"warning: processes remain in {h.netns}: not deleting it")
            continue
        _sh("ip", "netns", "del", h.netns, check=False)
        _sh("ip", "link", "del", h.veth, check=False)
    _sh("ip", "link", "del", c.bridge, check=False)
    t2 = time.monotonic()
    dirs = [root / "hosts" / h.name / sub for h in c.hosts for sub in ("docker", "docker-exec")]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(lambda d: shutil.rmtree(d, ignore_errors=True), dirs))
    c.state = "down"
    now = time.monotonic()
    c.timings.update(down_s=round(now - t0, 2), down_stop_s=round(t1 - t0, 2), down_net_s=round(t2 - t1, 2), down_rm_s=round(now - t2, 2))
    c.save()


def sweep_stale(pattern: str = "/tmp/fbc-*", *, log=print) -> list[str]:
    """Tear down clusters whose owner process is gone (a test run that was killed)."""
    swept = []
    for path in sorted(Path("/").glob(pattern.lstrip("/"))):
        try:
            c = Cluster.load(path)
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if c.state != "down" and c.owner_pid and not Path(f"/proc/{c.owner_pid}").exists():
            log(f"tearing down stale cluster {path} (owner {c.owner_pid} is gone)")
            down(path, log=log)
            shutil.rmtree(path, ignore_errors=True)
            swept.append(str(path))
    return swept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.cluster.netns", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="build a cluster of N hosts in DIR")
    p_up.add_argument("n", type=int)
    p_up.add_argument("dir")
    p_up.add_argument("--no-image", action="store_true", help="do not import the base image")
    p_up.add_argument("--storage-driver", default="overlay2", choices=("overlay2", "vfs"))
    p_down = sub.add_parser("down", help="tear down the cluster in DIR")
    p_down.add_argument("dir")
    args = ap.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr)
    if args.cmd == "up":
        c = up(args.n, args.dir, image=not args.no_image, storage_driver=args.storage_driver, log=log)
        print(c.json_path)
    else:
        down(args.dir, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
