"""Launch environment shared by every case entry point.

``setup()`` reads the resolved config written by the host side, applies the
vendor's adapter for the case's framework (before the framework is imported),
and seeds the random generators; ``leave()`` ends a rank whose run ended ok.  ``dist_info()`` reads the rank layout that
every launcher (torchrun, deepspeed, paddle.distributed.launch) exports.
The lifecycle a case's trainer follows, and its driver, are in training/case.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import random
import sys
from typing import Any, NoReturn


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def dist_info() -> DistInfo:
    env = os.environ
    rank = int(env.get("RANK", env.get("PADDLE_TRAINER_ID", "0")))
    world = int(env.get("WORLD_SIZE", env.get("PADDLE_TRAINERS_NUM", "1")))
    local_rank = int(env.get("LOCAL_RANK", env.get("PADDLE_LOCAL_RANK", "0")))
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("PADDLE_LOCAL_SIZE", str(world))))
    return DistInfo(rank, world, local_rank, local_world)


#: how long a process group's collectives outlast the harness's own stop of a hung round
PG_MARGIN_S = 120.0


def process_group_timeout() -> datetime.timedelta | None:
    """The timeout a case gives its process groups under the harness: the longer of the
    harness's stall and startup timeouts (``FB_STALL_TIMEOUT_S``, ``FB_STARTUP_TIMEOUT_S``) and
    :data:`PG_MARGIN_S` more, so a hang is stopped by the harness, its stacks written first
    (training/case.py), not ended by the framework's own default (DeepSpeed's 10 minutes) with
    nothing to show where it waited. None outside the harness: the framework's default."""
    given = [float(v) for v in (os.environ.get("FB_STALL_TIMEOUT_S"), os.environ.get("FB_STARTUP_TIMEOUT_S")) if v]
    return datetime.timedelta(seconds=max(given) + PG_MARGIN_S) if given else None


def visible_devices(vendor: dict[str, Any]) -> dict[str, str | None] | None:
    """The vendor's visible-devices variable (``vendor.visible_devices_env``) and its value in
    this process (None: unset), which a case records in its ``run_meta``; None when the vendor
    names no such variable."""
    return _vendor_variable(vendor, "visible_devices_env")


def allocator_options(vendor: dict[str, Any]) -> dict[str, str | None] | None:
    """The vendor's allocator variable (``vendor.allocator_env``, e.g. PYTORCH_CUDA_ALLOC_CONF,
    which ``parallel.expandable_segments`` sets) and its value in this process (None: unset), for
    the case's ``run_meta``; None when the vendor names no such variable."""
    return _vendor_variable(vendor, "allocator_env")


def recorded_env(vendor: dict[str, Any]) -> dict[str, str] | None:
    """Every variable of this process's environment whose name starts with one of the vendor's
    ``recorded_env`` prefixes (NCCL_, ...), by name, for the case's ``run_meta`` (``environment``):
    what tunes the collectives and the runtime beside the settings. None when the vendor names none."""
    prefixes = tuple(vendor.get("recorded_env") or ())
    if not prefixes:
        return None
    return {name: os.environ[name] for name in sorted(os.environ) if name.startswith(prefixes)}


def _vendor_variable(vendor: dict[str, Any], field: str) -> dict[str, str | None] | None:
    """``{name: value in this process}`` of the variable the vendor's ``field`` names; None when it names none."""
    name = vendor.get(field)
    return {str(name): os.environ.get(str(name))} if name else None


#: the resolved.json :func:`setup` read (the conformance check hands it to its probe)
CONFIG_PATH: str | None = None
#: the resolved.json whose adapter and hooks this process applied (setup)
ADAPTED: str | None = None


def load_config(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def resolve_hook(spec: str) -> Any:
    """``package.module:function`` -> the function."""
    module, _, func = spec.partition(":")
    if not module or not func:
        raise ValueError(f"adapter {spec!r} is not of the form 'module:function'")
    return getattr(importlib.import_module(module), func)


def _changed(before: Any, after: Any, path: str = "") -> str | None:
    """The first dotted path where two JSON-like values differ, or None."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after), key=str):
            found = _changed(before.get(key), after.get(key), f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    return None if before == after else (path or "(the whole config)")


def apply_adapter(cfg: dict[str, Any]) -> None:
    """Run the vendor's adapter for this framework and the vendor config's hook, if declared.

    Each has the signature ``fn(cfg: dict) -> None`` and may only adapt the runtime
    (device redirection, kernels, environment). It gets a copy of the resolved config;
    a function that changes any setting (model shape, optimizer, data, batch) is refused,
    naming the setting: a vendor changes settings only through its config file, where the
    case's whitelist applies and the change is listed in the results.
    """
    framework = cfg["case"]["framework"]
    vendor = cfg.get("vendor", {})
    specs = [s for s in ((vendor.get("adapters") or {}).get(framework), *(vendor.get("hooks") or [])) if s]
    for spec in specs:
        copy = json.loads(json.dumps(cfg))
        resolve_hook(spec)(copy)
        where = _changed(cfg, copy)
        if where:
            raise RuntimeError(f"vendor function {spec} changed '{where}': adapters and hooks may adapt the runtime only")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is in every environment
        pass
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def setup(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``--config``, apply the vendor adapter, seed; return the config."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="resolved.json written by the harness")
    args, _ = parser.parse_known_args(argv)
    global CONFIG_PATH, ADAPTED
    cfg = load_config(args.config)
    CONFIG_PATH = os.path.abspath(args.config)
    os.environ.setdefault("FB_RUN_ID", str(cfg.get("run_id", "")))
    apply_adapter(cfg)
    ADAPTED = CONFIG_PATH
    seed_everything(int(cfg["train"].get("seed", 1234)))
    return cfg


def leave() -> NoReturn:
    """End a rank whose run ended ok and whose process group is left, every record out, without
    the interpreter's teardown of its modules. With megatron-core imported that teardown took
    1.4 s of CPU a process, with DeepSpeed 0.5 s (2-core CPU machine, 2026-12-03): each tiny run
    paid it once a rank. paddle's teardown also aborted now and then after a run that had ended
    ok (SIGABRT, the launcher's exit 250; twice in CI, 2026-11-26). A failed run raises instead
    and exits the usual way, its traceback printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
