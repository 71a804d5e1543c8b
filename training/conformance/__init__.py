"""The conformance check: the math of a case's step on the vendor's own stack, against the
architecture's published math in float64.

Run once per run, before training, by training/case.py on the node of rank 0 (and alone by
``flagbench conformance``), in two processes of the rank's own Python:

1. the probe (training/conformance/probe.py): the vendor's adapter and hooks, then the case's
   probe (case.yaml ``conformance``), which builds one decoder layer, the embedding and the loss
   head as the run builds them and writes their weights, inputs, sampled outputs and gradient
   projections to a probe file. In a run on the CPU it is forked from rank 0, whose imports
   and adapter are made already (training/conformance/forking.py);
2. the reference (training/conformance/reference.py), in Python's isolated mode, numpy only:
   the same computation from the declared architecture, and the verdict.

The verdict is cached under the node's cache folder by what decides the math (:func:`stack_key`):
the code of the node side, the framework and library versions, the device, the vendor's
adapters and hooks, the model and the settings that reach the kernels. A later run on the same
stack reuses it and says so. Standard library only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: folders whose Python decides what a rank computes
CODE_DIRS = ("training", "cases", "vendors", "examples")
LIBRARIES = ("torch", "megatron-core", "deepspeed", "transformers", "paddlepaddle", "paddlenlp", "liger-kernel", "numpy")
#: the keys of resolved.json that reach the kernels
MATH_KEYS = ("model", "parallel", "vendor")
TRAIN_KEYS = ("precision", "seed")


class NonConformant(RuntimeError):
    """The check failed: the run ends before training, its round invalid."""


class ProbeError(RuntimeError):
    """The probe or the reference did not finish (the case's own kernel checks raise there too)."""

    def __init__(self, message: str, tail: str):
        super().__init__(message)
        self.tail = tail


def code_digest() -> str:
    h = hashlib.blake2b(digest_size=16)
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def probe_module(cfg: dict[str, Any]) -> Any:
    """The module of the case's probe (case.yaml ``conformance``, ``module:function``)."""
    import importlib

    return importlib.import_module(cfg["case"]["conformance"].partition(":")[0])


def device_name(cfg: dict[str, Any]) -> str:
    """The first device's name: the case's probe module's ``device_name(cfg)`` where it has one (a
    framework without torch names its devices itself), else training.accelerator's."""
    own = getattr(probe_module(cfg), "device_name", None)
    if own is not None:
        return str(own(cfg))
    from training.accelerator import Accelerator

    acc = Accelerator(cfg.get("vendor") or {})
    return acc.device_name(acc.device(0))


def probe_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as the case's probe builds from it (its module's ``probe_config``, where it has
    one: a probe that sets a schedule-only switch itself makes that switch no part of the key)."""
    view = getattr(probe_module(cfg), "probe_config", None)
    return view(cfg) if view else cfg


def stack_key(cfg: dict[str, Any], device: str) -> tuple[str, dict[str, Any]]:
    """The cache key of a verdict and what it was made of."""
    from training.settings import HOST_KEYS  # read by the host alone (the allocator's variable): not the math

    cfg = probe_view(cfg)
    host = {section: set(keys) for section, keys in HOST_KEYS.items()}
    what = {
        "code": code_digest(),
        "versions": versions(),
        "device": device,
        "case": {k: cfg["case"].get(k) for k in ("model", "framework", "conformance")},
        **{k: _without(cfg.get(k), host.get(k, set())) for k in MATH_KEYS},
        "train": {k: cfg["train"].get(k) for k in TRAIN_KEYS},
    }
    key = hashlib.blake2b(json.dumps(what, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    return key, what


def _without(section: Any, keys: set[str]) -> Any:
    return {k: v for k, v in section.items() if k not in keys} if isinstance(section, dict) else section


def cache_dir(cfg: dict[str, Any]) -> Path:
    """Where verdicts are kept: the node's cache folder that resolved.json names (``data.cache_dir``)."""
    base = (cfg.get("data") or {}).get("cache_dir")
    if not base:
        raise RuntimeError("the conformance check keeps its verdicts in data.cache_dir, which resolved.json does not name")
    return Path(base) / "conformance"


def _progress(text: str | bytes | None) -> list[str]:
    text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
    return [line for line in text.splitlines() if line.startswith(("probe:", "reference:"))]


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    """Wait for one process of the check; its progress lines go on to this process's stderr."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        seen = _progress(err)
        raise ProbeError(
            f"conformance {what}: no result within {timeout_s:.0f} s" + (f" (last: {seen[-1]})" if seen else ""), "\n".join(seen)
        ) from None
    for line in _progress(err):
        print(line, file=sys.stderr, flush=True)
    if proc.returncode != 0:
        tail = (err or out).strip().splitlines()[-12:]
        last = next((line for line in reversed(tail) if line.strip()), "")
        raise ProbeError(f"conformance {what} exited {proc.returncode}: {last.removeprefix('[rank0]: ')}", "\n".join(tail))


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate()


def _read_verdict(path: Path) -> dict[str, Any] | None:
    """A cached verdict, or None (none there, or a torn file: checked again)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _run(cmd: list[str], env: dict[str, str], what: str, timeout_s: float) -> None:
    """Run one process of the check to its end."""
    _wait(_start(cmd, env), what, timeout_s)


def _start_probe(
    cfg: dict[str, Any], config_path: str, probe_dir: str, env: dict[str, str], in_rank: bool, fork_alone: bool
) -> tuple[Any, str]:
    """The probe's process and how it started: forked from this rank (its imports and adapter
    made already: training/conformance/forking.py), or from a check process that checks several
    configs (its imports made once; the child applies its own config's adapter), else spawned."""
    from training.conformance import forking

    module = probe_module(cfg)
    why = forking.refusal(module, cfg) if in_rank or fork_alone else "run alone"
    if why is not None:
        cmd = [sys.executable, "-m", "training.conformance.probe", "--config", config_path, "--out", probe_dir]
        return _start(cmd, env), f"spawned: {why}"

    def work() -> int:
        from training.conformance import probe

        os.environ.clear()
        os.environ.update(env)
        module.after_fork(cfg)
        return probe.main(["--config", config_path, "--out", probe_dir], adapted=in_rank)

    return forking.Forked(work, os.path.dirname(probe_dir)), "forked from the rank" if in_rank else "forked from the check"


def preload(cfg: dict[str, Any]) -> None:
    """In a rank that will fork the probe, the probe's imports, which the rank's build makes
    next (the probe module's ``before_fork``): timed with the rank's imports, not the check."""
    from training.conformance import forking

    if not (cfg.get("case") or {}).get("conformance"):
        return
    module = probe_module(cfg)
    if forking.refusal(module, cfg) is None and getattr(module, "before_fork", None) is not None:
        module.before_fork(cfg)


def check(
    cfg: dict[str, Any],
    config_path: str,
    timeout_s: float = 600.0,
    use_cache: bool = True,
    in_rank: bool = False,
    fork_alone: bool = False,
) -> dict[str, Any]:
    """The verdict of the case's conformance probe for this run's stack: ``{"verdict": "passed" |
    "failed" | "not checked", "message", "cached", "probe_s", "reference_s", "key", "probe_start",
    ...}``. ``in_rank``: called by a rank whose process applied this config's adapter
    (training.runtime.setup), so the probe may be forked from it. ``fork_alone``: called by a
    check process that checks several configs in turn, which makes the probe's imports once
    (:func:`preload`) and forks each probe, which applies its config's adapter itself."""
    spec = (cfg.get("case") or {}).get("conformance")
    if not spec:
        return {"verdict": "not checked", "message": "the case declares no conformance probe (case.yaml: conformance)", "cached": False}
    if fork_alone and not in_rank:
        preload(cfg)  # the imports, once per process: not the probe's time
    t0 = time.monotonic()
    folder = cache_dir(cfg)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    with tempfile.TemporaryDirectory(prefix="flagbench-conformance-") as tmp:
        probe_dir, verdict_file = os.path.join(tmp, "probe"), os.path.join(tmp, "verdict.json")
        # the probe starts first: its imports run while the stack's key is made, and it is
        # stopped where that key has a verdict already
        t1 = time.monotonic()
        if in_rank:
            from training import runtime

            if runtime.ADAPTED != os.path.abspath(config_path):
                raise RuntimeError(f"the conformance check in a rank needs {config_path}'s adapter applied (training.runtime.setup)")
        probe, started = _start_probe(cfg, config_path, probe_dir, env, in_rank, fork_alone)
        try:
            key, what = stack_key(cfg, device_name(cfg))
            cached = folder / f"{key}.json"
            known = _read_verdict(cached) if use_cache else None
        except BaseException:
            _stop(probe)
            raise
        if known is not None:
            _stop(probe)
            return {**known, "cached": True, "lookup_s": round(time.monotonic() - t0, 3)}
        _wait(probe, "probe", timeout_s)
        t2 = time.monotonic()
        reference = str(Path(__file__).with_name("reference.py"))
        # one BLAS thread for each of the reference's threads (a core each): BLAS's own threads are
        # one pool that callers on several threads would share
        ref_env = {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        _run([sys.executable, "-I", reference, probe_dir, verdict_file], ref_env, "reference", timeout_s)
        verdict = json.loads(Path(verdict_file).read_text())
        t3 = time.monotonic()
    verdict.update(
        probe_s=round(t2 - t1, 3),
        check_s=round(t3 - t0, 3),
        probe_start=started,
        key=key,
        device=what["device"],
        versions=what["versions"],
        cached=False,
    )
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        part = cached.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps({k: v for k, v in verdict.items() if k != "cached"}))
        os.replace(part, cached)
    except OSError:
        verdict["cache_error"] = "not cached: the cache folder cannot be written"
    return verdict
