"""The one timing rule of every case's training loop.

A step's time runs from the moment its first batch is fetched to the end of its
optimizer step, synchronized across ranks: at both ends the device is
synchronized and the ranks meet at a barrier (the boundary of Megatron's
iteration time, which FlagPerf's tables use). Whatever a loop does between two
steps (logging, the loss all-reduce) is outside; the batch fetch is inside.

    clock = StepClock(sync)                # sync(): device synchronize, then a barrier
    for step in ...:
        with clock.step():
            batch = clock.fetch(lambda: next(it))   # or: for b in clock.timed(it)
            ...forward, backward, optimizer step...
        log.step(..., step_time_s=clock.step_time_s, data_s=clock.data_s)

A batch fetched outside ``clock.step()`` is an error: the step time must hold it.
``data_s`` (time spent fetching, inside the step) goes with every step record, so a
test can show that each framework's loop keeps to the rule.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class StepClock:
    def __init__(self, sync: Callable[[], None]):
        self._sync = sync
        self._t0: float | None = None
        self.step_time_s = 0.0
        self.data_s = 0.0

    @contextlib.contextmanager
    def step(self) -> Iterator[StepClock]:
        """Time one step, synchronized at both ends. On an exception nothing is synchronized
        (a collective on a failing rank could hang) and the exception goes on up."""
        self._sync()
        self.data_s = 0.0
        self._t0 = time.perf_counter()
        try:
            yield self
            self._sync()
            self.step_time_s = time.perf_counter() - self._t0
        finally:
            self._t0 = None

    def fetch(self, get: Callable[[], T]) -> T:
        """``get()`` (a batch fetch) inside the current step, its time added to ``data_s``."""
        if self._t0 is None:
            raise RuntimeError("a batch was fetched outside a timed step: the step time must include the fetch (training/steptimer.py)")
        t = time.perf_counter()
        try:
            return get()
        finally:
            self.data_s += time.perf_counter() - t

    def timed(self, items: Iterable[T]) -> Iterator[T]:
        """Iterate ``items`` with each fetch timed by :meth:`fetch` (an iterator a schedule can pull from)."""
        it = iter(items)
        sentinel = object()
        while True:
            item = self.fetch(lambda: next(it, sentinel))
            if item is sentinel:
                return
            yield item  # type: ignore[misc]
