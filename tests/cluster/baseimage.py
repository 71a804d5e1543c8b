"""The base image of the test cluster: a Debian bookworm minbase rootfs, imported, never pulled.

The tarball is built once with debootstrap from the Debian mirror this machine's apt
sources name for the suite (``FLAGBENCH_DEBIAN_MIRROR`` overrides it) and cached under ``~/.cache/flagbench/images``; its name carries a hash of the recipe, so changing
the package list builds a new one. CPU containers run the host's Python and the framework
virtualenv bind-mounted read-only, so the image only carries the shared libraries that
CPython's extension modules and torch link against, and a C++ compiler for the ops
frameworks build at run time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"
IMAGE_REF = "flagbench/cpu-base:bookworm"  # the cpu vendor Dockerfiles' default BASE_IMAGE
PACKAGES = (
    "ca-certificates",
    "g++",  # DeepSpeed JIT-builds its CPU ops (shm_comm) in the container, with ninja from the environment
    "libbz2-1.0",
    "libexpat1",
    "libffi8",
    "libgomp1",
    "liblzma5",
    "libncursesw6",
    "libnsl2",
    "libreadline8",
    "libsqlite3-0",
    "libssl3",
    "libstdc++6",
    "libuuid1",
    "procps",
    "zlib1g",
)
# Trimmed from the rootfs after debootstrap (documentation, translations, apt caches).
_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache/apt", "var/lib/apt/lists", "var/log")
# Parts of the compiler a JIT build of C++ ops never runs (LTO, sanitizers, profilers).
_TRIM_FILES = (
    "usr/lib/gcc/x86_64-linux-gnu/12/lto1",
    "usr/bin/x86_64-linux-gnu-lto-dump-12",
    "usr/lib/gcc/x86_64-linux-gnu/12/lib*san*.a",
    "usr/lib/x86_64-linux-gnu/lib*san.so*",
    "usr/lib/x86_64-linux-gnu/libgprofng.so*",
    "usr/bin/x86_64-linux-gnu-gp-*",
    "usr/bin/x86_64-linux-gnu-dwp",
    "usr/bin/x86_64-linux-gnu-ld.gold",
)


def cache_dir() -> Path:
    """Where built images are kept (``FLAGBENCH_CACHE`` overrides ``~/.cache/flagbench``)."""
    root = os.environ.get("FLAGBENCH_CACHE") or os.path.expanduser("~/.cache/flagbench")
    return Path(root) / "images"


def recipe_hash() -> str:
    """A short hash of everything that decides the tarball's contents."""
    recipe = "\n".join([SUITE, "minbase", *PACKAGES, *_TRIM, *_TRIM_FILES])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def tarball_path() -> Path:
    return cache_dir() / f"debian-{SUITE}-minbase-{recipe_hash()}.tar.gz"


def debian_mirror(suite: str = SUITE, *, etc_apt: str | Path | None = None) -> str:
    """The mirror of the first ``deb`` source for ``suite`` in this machine's apt sources.

    apt itself reads the sources (``sources.list`` and ``sources.list.d/``, one-line and
    deb822 forms alike, disabled entries left out); ``etc_apt`` replaces ``/etc/apt``.
    """
    if shutil.which("apt-get") is None:
        raise RuntimeError("apt-get is missing, so no apt source names a Debian mirror: set FLAGBENCH_DEBIAN_MIRROR")
    argv = ["apt-get"]
    if etc_apt is not None:
        argv += ["-o", f"Dir::Etc={etc_apt}"]
    argv += ["indextargets", "--no-release-info", "--format", "$(TARGET_OF) $(RELEASE) $(REPO_URI)"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        errors = dict.fromkeys(line for line in proc.stderr.splitlines() if line.startswith("E:"))
        raise RuntimeError("reading the apt sources failed: " + " ".join(errors))
    for line in proc.stdout.splitlines():
        kind, release, uri = line.split(" ", 2)
        if kind == "deb" and release == suite:
            return uri.rstrip("/")
    where = etc_apt or "/etc/apt"
    raise RuntimeError(f"no deb source for Debian {suite} in {where}/sources.list or {where}/sources.list.d/: set FLAGBENCH_DEBIAN_MIRROR")


def build_tarball(*, mirror: str | None = None, log=print) -> Path:
    """Return the cached rootfs tarball, building it first if it is missing (~2 min)."""
    final = tarball_path()
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same one
        if final.exists():
            return final
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap is missing: run tests/install_system_deps.sh")
        work = final.parent / f".build-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        root = work / "root"
        mirror = mirror or os.environ.get("FLAGBENCH_DEBIAN_MIRROR") or debian_mirror()
        t0 = time.monotonic()
        log(f"building base image rootfs with debootstrap from {mirror} (about 2 min)")
        try:
            proc = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(root), mirror],
                capture_output=True,
                text=True,
                timeout=1200,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            for rel in _TRIM:
                target = root / rel
                if target.is_dir():
                    shutil.rmtree(target)
                    target.mkdir()
            for pattern in _TRIM_FILES:
                for path in root.glob(pattern):
                    path.unlink()
            tmp = work / "rootfs.tar.gz"
            with open(tmp, "wb") as out:
                tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(root), "-cf", "-", "."], stdout=subprocess.PIPE)
                gz = subprocess.run(["gzip", "-1"], stdin=tar.stdout, stdout=out, timeout=600)
                tar.stdout.close()
                if tar.wait(timeout=600) != 0 or gz.returncode != 0:
                    raise RuntimeError(f"packing {root} failed")
            os.replace(tmp, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(f"base image rootfs built in {time.monotonic() - t0:.0f}s: {final}")
        return final


if __name__ == "__main__":
    print(build_tarball())
