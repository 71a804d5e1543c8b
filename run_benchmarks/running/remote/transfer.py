"""SFTP tree transfers of an ``SSHPool``: copy trees both ways, skipping unchanged files."""

from __future__ import annotations

import fnmatch
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import paramiko

from .errors import CommandTimeout, LocalWriteFailed, RemoteCommandFailed
from .hosts import HostSpec


@dataclass
class TransferStats:
    """What ``put_tree``/``get_tree`` did."""

    copied: int = 0
    skipped: int = 0
    bytes: int = 0
    dirs: int = 0


class TransferMixin:
    """``put_tree``/``get_tree`` for ``SSHPool`` (which provides ``_spec`` and ``_open_channel``)."""

    def _sftp(self, spec: HostSpec, timeout: float) -> paramiko.SFTPClient:
        chan = self._open_channel(spec, timeout)
        chan.settimeout(timeout)
        try:
            chan.invoke_subsystem("sftp")
            return paramiko.SFTPClient(chan)
        except (paramiko.SSHException, OSError, EOFError) as e:
            chan.close()
            raise RemoteCommandFailed(spec.name, f"cannot start SFTP: {e}") from e

    def put_tree(
        self,
        host: str | HostSpec,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
        timeout: float = 600.0,
    ) -> TransferStats:
        """Copy a local tree to ``remote_dir``; files whose size and mtime match are skipped.

        ``exclude`` holds fnmatch patterns tried on each relative path and on each name.
        """
        spec = self._spec(host)
        root = Path(local_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"put_tree: {root} is not a directory")
        deadline = time.monotonic() + timeout
        stats = TransferStats()
        sftp = self._sftp(spec, timeout)
        try:
            for dirpath, dirnames, filenames in os.walk(root):
                rel = Path(dirpath).relative_to(root)
                dirnames[:] = sorted(d for d in dirnames if not excluded(rel / d, exclude))
                rdir = str(PurePosixPath(remote_dir, *rel.parts))
                _sftp_mkdir(sftp, rdir)
                stats.dirs += 1
                remote = {a.filename: a for a in sftp.listdir_attr(rdir)}
                for fname in sorted(filenames):
                    if time.monotonic() > deadline:
                        raise CommandTimeout(spec.name, f"put_tree to {remote_dir} timed out after {timeout}s", timeout=timeout)
                    if excluded(rel / fname, exclude):
                        continue
                    _put_one(sftp, Path(dirpath, fname), f"{rdir}/{fname}", remote.get(fname), stats)
        except TimeoutError:
            raise CommandTimeout(spec.name, f"put_tree to {remote_dir} stalled", timeout=timeout) from None
        except (OSError, paramiko.SSHException) as e:
            raise RemoteCommandFailed(spec.name, f"put_tree to {remote_dir}: {e}") from e
        finally:
            sftp.close()
        return stats

    def get_tree(
        self,
        host: str | HostSpec,
        remote_dir: str,
        local_dir: str | os.PathLike[str],
        *,
        timeout: float = 600.0,
    ) -> TransferStats:
        """Copy a remote tree into ``local_dir``; unchanged files (size+mtime) are skipped."""
        spec = self._spec(host)
        deadline = time.monotonic() + timeout
        stats = TransferStats()
        sftp = self._sftp(spec, timeout)
        try:
            pending = [(remote_dir, Path(local_dir))]
            while pending:
                rdir, ldir = pending.pop()
                try:
                    ldir.mkdir(parents=True, exist_ok=True)
                except OSError as e:  # this machine's side, as a file's write
                    raise LocalWriteFailed("", f"{ldir}: {e.strerror or e}") from None
                stats.dirs += 1
                for attr in sorted(sftp.listdir_attr(rdir), key=lambda a: a.filename):
                    if time.monotonic() > deadline:
                        raise CommandTimeout(spec.name, f"get_tree from {remote_dir} timed out after {timeout}s", timeout=timeout)
                    rpath, lpath = f"{rdir}/{attr.filename}", ldir / attr.filename
                    mode = attr.st_mode or 0
                    if stat.S_ISDIR(mode):
                        pending.append((rpath, lpath))
                    elif stat.S_ISLNK(mode):
                        target = sftp.readlink(rpath)
                        if lpath.is_symlink() and os.readlink(lpath) == target:
                            stats.skipped += 1
                            continue
                        if lpath.is_symlink() or lpath.exists():
                            lpath.unlink()
                        lpath.symlink_to(target)
                        stats.copied += 1
                    elif stat.S_ISREG(mode):
                        _get_one(sftp, rpath, lpath, attr, stats)
        except LocalWriteFailed as e:
            raise LocalWriteFailed(spec.name, f"{e.detail}, bringing back {remote_dir} from {spec.name}") from None
        except TimeoutError:
            raise CommandTimeout(spec.name, f"get_tree from {remote_dir} stalled", timeout=timeout) from None
        except (OSError, paramiko.SSHException) as e:
            raise RemoteCommandFailed(spec.name, f"get_tree from {remote_dir}: {e}") from e
        finally:
            sftp.close()
        return stats

    def read_bytes(self, host: str | HostSpec, remote_path: str, *, limit: int = 1 << 20, timeout: float = 10.0) -> bytes | None:
        """A small remote file's content (at most ``limit`` bytes); None when it is not there."""
        sftp = self._sftp(self._spec(host), timeout)
        try:
            with sftp.open(remote_path, "rb") as fh:
                return fh.read(limit)
        except FileNotFoundError:
            return None
        except (TimeoutError, OSError, paramiko.SSHException, EOFError) as e:
            raise RemoteCommandFailed(self._spec(host).name, f"cannot read {remote_path}: {e}") from e
        finally:
            sftp.close()


def excluded(rel: Path, patterns: Sequence[str]) -> bool:
    posix = rel.as_posix()
    return any(fnmatch.fnmatch(posix, p) or fnmatch.fnmatch(rel.name, p) for p in patterns)


def _sftp_mkdir(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        if stat.S_ISDIR(sftp.stat(path).st_mode or 0):
            return
    except FileNotFoundError:
        pass
    parent = str(PurePosixPath(path).parent)
    if parent != path:
        _sftp_mkdir(sftp, parent)
    sftp.mkdir(path)


def _put_one(sftp: paramiko.SFTPClient, local: Path, remote: str, rattr: paramiko.SFTPAttributes | None, stats: TransferStats) -> None:
    st = local.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(local)
        if rattr is not None:
            if stat.S_ISLNK(rattr.st_mode or 0) and sftp.readlink(remote) == target:
                stats.skipped += 1
                return
            sftp.remove(remote)
        sftp.symlink(target, remote)
        stats.copied += 1
        return
    if not stat.S_ISREG(st.st_mode):
        return
    if rattr is not None and rattr.st_size == st.st_size and int(rattr.st_mtime or -1) == int(st.st_mtime):
        stats.skipped += 1
        return
    sftp.put(str(local), remote, confirm=True)
    sftp.chmod(remote, stat.S_IMODE(st.st_mode))
    sftp.utime(remote, (int(st.st_atime), int(st.st_mtime)))
    stats.copied += 1
    stats.bytes += st.st_size


def _get_one(sftp: paramiko.SFTPClient, remote: str, local: Path, rattr: paramiko.SFTPAttributes, stats: TransferStats) -> None:
    try:
        st = local.stat()
        if st.st_size == rattr.st_size and int(st.st_mtime) == int(rattr.st_mtime or -1):
            stats.skipped += 1
            return
    except FileNotFoundError:
        pass
    size = rattr.st_size or 0
    with sftp.open(remote, "rb") as src:
        src.prefetch(size)
        try:
            with open(local, "wb") as dst:
                while chunk := src.read(32768):
                    dst.write(chunk)
        except OSError as e:  # this machine's side: say so, and what it needed
            local.unlink(missing_ok=True)
            raise LocalWriteFailed("", f"{local}: {e.strerror or e} ({size:,} bytes needed)") from None
    if rattr.st_mode is not None:
        os.chmod(local, stat.S_IMODE(rattr.st_mode))
    mtime = int(rattr.st_mtime or time.time())
    os.utime(local, (int(rattr.st_atime or mtime), mtime))
    stats.copied += 1
    stats.bytes += rattr.st_size or 0
