"""Per-framework Python environments for the local runtime (and each host of the SSH one).

Frameworks conflict in one environment (paddlenlp pins huggingface_hub<1.0,
transformers 5 needs >=1.0), so each (vendor, framework) gets its own virtual
environment, built on demand from ``vendors/<vendor>/<framework>/requirements.txt``
and cached under a name that hashes that file and the Python's major.minor version
(wheels are built per minor version; 3.11.2 and 3.11.7 share one): the local analogue
of a per-framework container image.  ``--python`` uses an existing interpreter as is.

pip's output goes to a log next to the environment (or the one given), and every error
names it. Before pip installs anything, a probe of the package index (a few seconds)
tells a host without network access apart from a failing build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from run_benchmarks.errors import InputError

# standard library only: remote hosts run this module before any environment exists
VENDORS_DIR = Path(__file__).resolve().parents[2] / "vendors"


def cache_root() -> Path:
    return Path(os.environ.get("FLAGBENCH_ENV_DIR", Path.home() / ".cache" / "flagbench" / "envs"))


def requirements_file(vendor: str, framework: str, vendors_dir: Path = VENDORS_DIR) -> Path:
    path = vendors_dir / vendor / framework / "requirements.txt"
    if not path.is_file():
        raise InputError(f"vendor {vendor!r} has no environment for framework {framework!r} ({path} missing)")
    return path


PROBE_TIMEOUT_S = 5


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def env_dir(vendor: str, framework: str, vendors_dir: Path = VENDORS_DIR) -> Path:
    req = requirements_file(vendor, framework, vendors_dir).read_bytes()
    tag = hashlib.sha256(req + f"python{python_version()}".encode()).hexdigest()[:12]
    return cache_root() / f"{vendor}-{framework}-{tag}"


def _adopt_legacy(env: Path, req: bytes) -> None:
    """Environments built while the name hashed the full ``sys.version`` are used as they are
    (a link under the new name; runs that hold the old path keep it)."""
    old = env.with_name(env.name.rsplit("-", 1)[0] + "-" + hashlib.sha256(req + sys.version.encode()).hexdigest()[:12])
    if not env.exists() and not env.is_symlink() and (old / ".flagbench-ready").is_file():
        try:
            env.symlink_to(old.name)
        except FileExistsError:
            pass


def build_log(env: Path) -> Path:
    """Where pip's output goes when no log is given: beside the environment."""
    return env.with_name(env.name + ".build.log")


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _usable(env: Path) -> bool:
    """Built, and its interpreter is there (a copied environment needs the Python it was made from)."""
    return (env / ".flagbench-ready").is_file() and python_of(env).exists()


def ensure_env(vendor: str, framework: str, log: Path | None = None, vendors_dir: Path = VENDORS_DIR) -> Path:
    """Build (once) and return the environment's Python."""
    env = env_dir(vendor, framework, vendors_dir)
    req = requirements_file(vendor, framework, vendors_dir)
    _adopt_legacy(env, req.read_bytes())
    if _usable(env):
        return python_of(env)
    with _lock(env.with_suffix(".lock")):
        if _usable(env):
            return python_of(env)
        if env.is_symlink():
            env.unlink()
        elif env.exists():
            shutil.rmtree(env)
        log = log or build_log(env)
        started = time.monotonic()
        with open(log, "ab") as out:
            _build(env, req, out, f"the {framework} environment for vendor {vendor}", log)
        (env / ".flagbench-ready").write_text(f"built in {time.monotonic() - started:.1f} s from {req}\n")
    return python_of(env)


def _build(env: Path, req: Path, out: BinaryIO, what: str, log: Path) -> None:
    def step(argv: list[str]) -> int:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        return subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    if step([sys.executable, "-m", "venv", str(env)]) != 0:
        raise InputError(f"building {what} failed: {sys.executable} -m venv {env} did not work; see {log}")
    pip = [str(python_of(env)), "-m", "pip"]
    pins = [ln.split("#")[0].strip() for ln in req.read_text().splitlines()]
    pins = [p for p in pins if p and not p.startswith("-")]
    # the package index answers (or a local wheelhouse has the first package): else say so now,
    # not after pip's retries
    name = re.split(r"[<>=!~;\[ ]", pins[0])[0] if pins else "pip"
    probe = pip + ["index", "versions", name, "--disable-pip-version-check", "--retries", "0", "--timeout", str(PROBE_TIMEOUT_S)]
    if step(probe) != 0:
        shutil.rmtree(env, ignore_errors=True)
        raise InputError(
            f"{what} is not built at {env} and pip cannot get {name} from its package index here "
            f"(no network?; see {log}): copy an environment built from {req.name} with Python {python_version()} "
            "to that path, or set python: in the cluster file to a Python that has the framework, "
            "or use runtime: container with an image that holds it"
        )
    install = pip + ["install", "--disable-pip-version-check", "-q"]
    # torch first: its pinned CPU wheel must win over any transitive 'torch'
    torch_pins = [p for p in pins if p.startswith("torch==")]
    for argv in ([install + torch_pins] if torch_pins else []) + [install + ["-r", str(req)]]:
        rc = step(argv)
        if rc != 0:
            raise InputError(f"building {what} failed ({' '.join(argv[:4])} ... exit {rc}); pip's output is in {log}")


def framework_python(vendor: str, framework: str, python: str | None, log: Path | None = None) -> Path:
    """The interpreter a round runs with: ``python`` as is, else the built env."""
    if python:
        found = shutil.which(python)  # a path, or a name on PATH such as python3
        if not found:
            raise InputError(f"--python {python}: not an executable file")
        return Path(found)
    return ensure_env(vendor, framework, log)


def main(argv: list[str] | None = None) -> int:
    """``python -m run_benchmarks.planning.envs ensure VENDOR FRAMEWORK``: build if needed, print the Python."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m run_benchmarks.planning.envs")
    ap.add_argument("action", choices=["ensure", "path"])
    ap.add_argument("vendor")
    ap.add_argument("framework")
    ap.add_argument("--log")
    args = ap.parse_args(argv)
    try:
        if args.action == "path":
            print(python_of(env_dir(args.vendor, args.framework)))
        else:
            print(ensure_env(args.vendor, args.framework, Path(args.log) if args.log else None))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
