"""Readers for the harness's ``resolved.json``, shared by the cases' settings modules.

Each case reads, validates and derives its own settings (``cases/<family>/<framework>/
*settings.py``) before any process group or model exists; the value readers, the
error type and the layout arithmetic they have in common live here.  Every error
names the key it is about.  Standard library only, so host-side tests import it.

Layout arithmetic, in the harness's terms: ``dp = world_size / (tp * pp)`` and
``grad_accum = global_batch / (micro_batch * dp)``, both exactly.  The callers pass
the message of each failure, so every case keeps the wording its docs and tests pin.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: the "no default" marker of :func:`get`
MISSING: Any = dataclasses.MISSING


class SettingsError(ValueError):
    """A resolved config value the case cannot run with."""


def get(section: dict, key: str, where: str, default: Any = MISSING) -> Any:
    """``section[key]`` when present and not null, else ``default``; no default: an error."""
    if key in section and section[key] is not None:
        return section[key]
    if default is MISSING:
        raise SettingsError(f"resolved config: {where}.{key} is missing")
    return default


def integer(value: Any, where: str, minimum: int = 0) -> int:
    """A whole number (an integral float passes; a bool does not) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise SettingsError(f"resolved config: {where} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise SettingsError(f"resolved config: {where} must be >= {minimum}, got {value!r}")
    return int(value)


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f"resolved config: {where} must be a number, got {value!r}")
    return float(value)


def boolean(value: Any, where: str, accept_01: bool = False) -> bool:
    """``true``/``false``; with ``accept_01`` also the integers 0 and 1 (FlagPerf's configs write them)."""
    if accept_01 and isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise SettingsError(f"resolved config: {where} must be true or false, got {value!r}")
    return value


def choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SettingsError(f"resolved config: {where} must be one of {', '.join(choices)}, got {value!r}")
    return value


def divides(what: str, a: int, b: int, fix: str) -> None:
    """``a`` must divide ``b``."""
    if b % a != 0:
        raise SettingsError(f"{what}: {b} is not divisible by {a}; {fix}")


def data_parallel(world_size: int, tp: int, pp: int, error: str) -> int:
    """``dp = world_size / (tp * pp)``, exactly.

    ``error`` is the message when it is not whole, a format string over
    ``world``, ``tp`` and ``pp``.
    """
    if world_size % (tp * pp) != 0:
        raise SettingsError(error.format(world=world_size, tp=tp, pp=pp))
    return world_size // (tp * pp)


def grad_accum(global_batch: int, micro_batch: int, dp: int, error: str) -> int:
    """``global_batch / (micro_batch * dp)``, exactly.

    ``error`` is the message when it is not whole, a format string over ``gb``,
    ``mb`` and ``dp``.
    """
    if global_batch % (micro_batch * dp) != 0:
        raise SettingsError(error.format(gb=global_batch, mb=micro_batch, dp=dp))
    return global_batch // (micro_batch * dp)
