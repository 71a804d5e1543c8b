"""The device a rank runs on, by the vendor's declared device type: no case names cuda.

``vendor.device`` in resolved.json is torch's device type of the vendor's build: ``cuda`` for
NVIDIA and CUDA-compatible stacks, ``npu`` (torch_npu), ``mlu`` (torch_mlu), ``xpu``,
``musa`` (torch_musa) ... or ``cpu``. Each registers a ``torch.<type>`` module with the same
calls (set_device, synchronize, max_memory_allocated, reset_peak_memory_stats,
get_device_properties, empty_cache, Event), which is all a case needs; the vendor's adapter
imports its torch extension first. ``vendor.memory_query`` ("module:function", called with the
rank's device, returning (peak allocated bytes, total bytes or None, device name)) replaces the
memory calls and the device's name where a stack answers them differently.

What stays CUDA's alone (cuDNN attention, Triton kernels, TransformerEngine) is not here: a
case checks ``vendor.device`` for those switches itself and names both in its error.
"""

from __future__ import annotations

import importlib
import os
import resource
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch


class Accelerator:
    """The calls a case makes on its device, for the vendor's device type.

    ``vendor``: resolved.json's ``vendor`` section (``device``, ``memory_query``); a missing
    device type is ``cpu``, as training/settings.py reads it.
    """

    def __init__(self, vendor: Mapping[str, Any]) -> None:
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

    @classmethod
    def of(cls, device: torch.device | str) -> Accelerator:
        """The calls for ``device``'s own type, where code holds a device but not the vendor's
        section (no memory query: synchronize, empty the cache, time)."""
        return cls({"device": torch.device(device).type})

    @property
    def is_accelerator(self) -> bool:
        """False on the CPU."""
        return self.module is not None

    @property
    def pin_memory(self) -> bool:
        """Whether host batches are page-locked before they are copied to the device: on an
        accelerator (the copy then runs asynchronously), never when the device is the CPU."""
        return self.module is not None

    def device(self, local_rank: int) -> torch.device:
        """This rank's device, made current."""
        if self.module is None:
            return torch.device("cpu")
        self.module.set_device(local_rank)
        return torch.device(self.type, local_rank)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for the device's queued work (the current device's without ``device``)."""
        if self.module is not None:
            self.module.synchronize(device)

    def reset_peak(self, device: torch.device) -> None:
        """Start the allocator's peaks and its counts (``alloc_retries``) afresh: a phase's own."""
        if self.module is not None and hasattr(self.module, "reset_peak_memory_stats"):
            self.module.reset_peak_memory_stats(device)
        if self.module is not None and hasattr(self.module, "reset_accumulated_memory_stats"):
            self.module.reset_accumulated_memory_stats(device)

    def empty_cache(self) -> None:
        """Give the allocator's cached blocks back to the device."""
        if self.module is not None and hasattr(self.module, "empty_cache"):
            self.module.empty_cache()

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

    def device_name(self, device: torch.device) -> str:
        """The device as its stack names it (what the harness checks against the chip's
        ``device_names``): the memory query's name, else the device's properties' name."""
        if self.query is not None:
            return str(self.query(device)[2])
        if self.module is None:
            return "cpu"
        return str(self.module.get_device_properties(device).name)

    def sm_clock_mhz(self, device: torch.device) -> float | None:
        """The device's SM clock now, in MHz, where its module tells (``torch.cuda.clock_rate``
        reads it through NVML); None on the CPU, or where the stack or NVML does not answer."""
        rate = getattr(self.module, "clock_rate", None) if self.module is not None else None
        if rate is None:
            return None
        try:
            return float(rate(device))
        except Exception:  # no pynvml in this environment, or a device NVML does not know
            return None

    def max_reserved(self, device: torch.device) -> int | None:
        """The caching allocator's peak reserve (what an out-of-memory margin is measured
        against), or None where the device has no such allocator (the CPU)."""
        if self.module is None or not hasattr(self.module, "max_memory_reserved"):
            return None
        return int(self.module.max_memory_reserved(device))

    def alloc_retries(self, device: torch.device) -> int | None:
        """How often since ``reset_peak`` the caching allocator found no free block, gave its
        whole cache back to the device and asked again (torch's ``num_alloc_retries``): each
        such retry synchronizes the device, so a count above zero says the run is at its memory
        limit and paying for it in time. None where the module keeps no such count (the CPU)."""
        stats = getattr(self.module, "memory_stats", None) if self.module is not None else None
        if stats is None:
            return None
        value = stats(device).get("num_alloc_retries")
        return None if value is None else int(value)

    def seconds_per_call(self, fn: Callable[[], Any], n: int, device: torch.device) -> float:
        """Seconds per call of ``fn`` over ``n`` back-to-back calls.

        With the device's timing events (``torch.<type>.Event``) where its module has them: the
        span between two events recorded on its stream around the calls. Elsewhere (the CPU, a
        stack without events) by the wall clock between two synchronizes of the device.
        """
        event = getattr(self.module, "Event", None) if self.module is not None else None
        if event is not None:
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        self.synchronize(device)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        self.synchronize(device)
        return (time.perf_counter() - t) / n
