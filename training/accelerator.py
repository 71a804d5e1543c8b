"""The device a rank runs on, by the vendor's declared device type: no case names cuda.

``vendor.device`` in resolved.json is torch's device type of the vendor's build: ``cuda`` for
NVIDIA and CUDA-compatible stacks, ``npu`` (torch_npu), ``mlu`` (torch_mlu), ``xpu``,
``musa`` (torch_musa) ... or ``cpu``. Each registers a ``torch.<type>`` module with the same
calls (set_device, synchronize, max_memory_allocated, reset_peak_memory_stats,
get_device_properties), which is all a case needs; the vendor's adapter imports its torch
extension first. ``vendor.memory_query`` ("module:function", called with the rank's device,
returning (peak allocated bytes, total bytes or None, device name)) replaces the memory
calls where a stack answers them differently.
"""

from __future__ import annotations

import importlib
import os
import resource
from collections.abc import Callable
from typing import Any

import torch


class Accelerator:
    """The calls a case makes on its device, for the vendor's device type."""

    def __init__(self, vendor: dict[str, Any]) -> None:
        self.type = str(vendor.get("device") or "cpu")
        self.module = None if self.type == "cpu" else getattr(torch, self.type, None)
        if self.type != "cpu" and self.module is None:
            raise RuntimeError(
                f"vendor.device {self.type!r}: torch has no torch.{self.type} module here "
                "(the vendor's torch extension must be installed, and imported by its adapter)"
            )
        self.query: Callable[[torch.device], tuple[int, int | None, str]] | None = None
        if vendor.get("memory_query"):
            module, _, func = str(vendor["memory_query"]).partition(":")
            self.query = getattr(importlib.import_module(module), func)

    def device(self, local_rank: int) -> torch.device:
        """This rank's device, made current."""
        if self.module is None:
            return torch.device("cpu")
        self.module.set_device(local_rank)
        return torch.device(self.type, local_rank)

    def synchronize(self, device: torch.device) -> None:
        if self.module is not None:
            self.module.synchronize(device)

    def reset_peak(self, device: torch.device) -> None:
        if self.module is not None and hasattr(self.module, "reset_peak_memory_stats"):
            self.module.reset_peak_memory_stats(device)

    def memory(self, device: torch.device) -> tuple[int, int | None, str]:
        """(peak allocated bytes, the device's total bytes or None, the device's name)."""
        if self.query is not None:
            peak, total, name = self.query(device)
            return int(peak), None if total is None else int(total), str(name)
        if self.module is None:  # the process's resident peak against the host's memory
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, int(total), "cpu"
        props = self.module.get_device_properties(device)
        return int(self.module.max_memory_allocated(device)), int(props.total_memory), str(props.name)
