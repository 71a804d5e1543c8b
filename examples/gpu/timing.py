"""Milliseconds per call of a CUDA workload, for the probes in this folder."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], n: int = 30, warmup: int = 5, ready: Callable[[], object] | None = None) -> float:
    """``fn`` run ``warmup`` times, then ``n`` times between two CUDA events: the mean per call.
    ``ready`` runs after the warm-up, before the clock starts (a barrier where several processes
    time the same collective)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if ready is not None:
        ready()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n
