"""Per-framework Python environments for the local runtime.

Frameworks conflict in one environment (paddlenlp pins huggingface_hub<1.0,
transformers 5 needs >=1.0), so each (vendor, framework) gets its own virtual
environment, built on demand from ``vendors/<vendor>/<framework>/requirements.txt``
and cached under a name that hashes that file: the local analogue of a
per-framework container image.  ``--python`` uses an existing interpreter as is.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from run_benchmarks.errors import InputError

# standard library only: remote hosts run this module before any environment exists
VENDORS_DIR = Path(__file__).resolve().parent.parent / "vendors"


def cache_root() -> Path:
    return Path(os.environ.get("FLAGBENCH_ENV_DIR", Path.home() / ".cache" / "flagbench" / "envs"))


def requirements_file(vendor: str, framework: str, vendors_dir: Path = VENDORS_DIR) -> Path:
    path = vendors_dir / vendor / framework / "requirements.txt"
    if not path.is_file():
        raise InputError(f"vendor {vendor!r} has no environment for framework {framework!r} ({path} missing)")
    return path


def env_dir(vendor: str, framework: str, vendors_dir: Path = VENDORS_DIR) -> Path:
    req = requirements_file(vendor, framework, vendors_dir).read_bytes()
    tag = hashlib.sha256(req + sys.version.encode()).hexdigest()[:12]
    return cache_root() / f"{vendor}-{framework}-{tag}"


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


def ensure_env(vendor: str, framework: str, log: Path | None = None, vendors_dir: Path = VENDORS_DIR) -> Path:
    """Build (once) and return the environment's Python."""
    env = env_dir(vendor, framework, vendors_dir)
    ready = env / ".flagbench-ready"
    if ready.is_file():
        return python_of(env)
    with _lock(env.with_suffix(".lock")):
        if ready.is_file():
            return python_of(env)
        if env.exists():
            shutil.rmtree(env)
        req = requirements_file(vendor, framework, vendors_dir)
        out = open(log, "ab") if log else subprocess.DEVNULL
        started = time.monotonic()
        try:
            steps = [[sys.executable, "-m", "venv", str(env)]]
            # torch first: its pinned CPU wheel must win over any transitive 'torch'
            torch_pins = [ln.strip() for ln in req.read_text().splitlines() if ln.strip().startswith("torch==")]
            pip = [str(python_of(env)), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            if torch_pins:
                steps.append(pip + torch_pins)
            steps.append(pip + ["-r", str(req)])
            for argv in steps:
                rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)
                if rc != 0:
                    raise InputError(
                        f"building the {framework} environment for vendor {vendor} failed "
                        f"({' '.join(argv[:4])} ... exit {rc}); see {log or 'the pip output'}"
                    )
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        ready.write_text(f"built in {time.monotonic() - started:.1f} s from {req}\n")
    return python_of(env)


def framework_python(vendor: str, framework: str, python: str | None, log: Path | None = None) -> Path:
    """The interpreter a round runs with: ``python`` as is, else the built env."""
    if python:
        found = shutil.which(python)  # a path, or a name on PATH such as python3
        if not found:
            raise InputError(f"--python {python}: not an executable file")
        return Path(found)
    return ensure_env(vendor, framework, log)


def main(argv: list[str] | None = None) -> int:
    """``python -m run_benchmarks.envs ensure VENDOR FRAMEWORK``: build if needed, print the Python."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m run_benchmarks.envs")
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
