"""Correct alternatives of a stack, as vendor hooks: each must pass the conformance check.

Each holds torch's ``scaled_dot_product_attention`` to one of its backends (torch otherwise
picks one itself), as a vendor's stack might, so that the check's tolerances are chosen on
correct kernels that differ in their rounding (docs/metrics.md, the conformance study).
"""

from __future__ import annotations

import functools
from typing import Any


def _held_to(backend_name: str) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    sdpa = F.scaled_dot_product_attention

    @functools.wraps(sdpa)
    def held(*args: Any, **kwargs: Any) -> Any:
        with sdpa_kernel(backend):
            return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = held


def sdpa_math(cfg: dict[str, Any]) -> None:
    _held_to("MATH")


def sdpa_flash(cfg: dict[str, Any]) -> None:
    _held_to("FLASH_ATTENTION")


def sdpa_cudnn(cfg: dict[str, Any]) -> None:
    _held_to("CUDNN_ATTENTION")


def sdpa_efficient(cfg: dict[str, Any]) -> None:
    _held_to("EFFICIENT_ATTENTION")


def unchanged(cfg: dict[str, Any]) -> None:
    """The stack as configured: a hook that changes nothing, so that one check process can judge
    the intact stack beside defects (``flagbench conformance --hook ... --hook ...``)."""
