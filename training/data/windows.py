"""Which token windows a data-parallel rank trains on, step by step.

The cases that read a token corpus through :class:`training.data.indexed.TokenWindows`
(llama3/megatron, gpt3/paddle) share one sample order: optimizer step ``t``
(0-based) uses samples ``t*G .. t*G+G-1`` of the seeded window order (G = global
batch); data-parallel rank ``r`` takes the ``r``-th contiguous slice of ``G / dp``
samples and cuts it into ``grad_accum`` micro-batches of ``micro_batch`` rows.
Tensor-parallel ranks and pipeline stages of one replica read the same samples, so
the sequences of a step are the same for every layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from training.data.indexed import TokenWindows

Rows = TypeVar("Rows", bound=Sequence)


def synthetic_tokens(requested: int | None, steps: int, global_batch: int, seq_length: int, minimum: int, maximum: int) -> int:
    """Size of the synthetic corpus: ``requested`` when set, else enough for every
    step's windows (``steps * global_batch * (seq_length + 1)``) clamped to
    ``[minimum, maximum]``."""
    if requested:
        return requested
    needed = steps * global_batch * (seq_length + 1)
    return int(min(max(needed, minimum), maximum))


def check_token_ids(rows: np.ndarray, vocab_size: int, source: str, where: str) -> np.ndarray:
    """``rows`` unchanged when every id is in ``[0, vocab_size)``; else a ValueError naming the
    corpus (``source``), the id and the step (``where``). Checked on each batch before it reaches
    an embedding, where a bad id is an IndexError on a CPU and a device assert on a GPU."""
    if rows.size:
        top, low = int(rows.max()), int(rows.min())
        if top >= vocab_size or low < 0:
            bad = top if top >= vocab_size else low
            raise ValueError(f"{source}: token id {bad} in {where}, outside the model's vocabulary of {vocab_size}")
    return rows


class RankShare:
    """One data-parallel rank's contiguous share of every optimizer step."""

    def __init__(self, windows: TokenWindows, global_batch: int, dp: int, dp_rank: int):
        self.windows = windows
        self.global_batch = global_batch
        self.per_rank = global_batch // dp
        self.dp_rank = dp_rank

    def samples(self, step: int) -> np.ndarray:
        """``[global_batch / dp, seq + 1]`` int64 token windows of ``step`` (0-based) for this rank."""
        first = step * self.global_batch + self.dp_rank * self.per_rank
        return self.windows.batch(first, self.per_rank)


def micro_split(rows: Rows, grad_accum: int, micro_batch: int) -> list[Rows]:
    """The ``grad_accum`` consecutive blocks of ``micro_batch`` rows (numpy or torch alike)."""
    return [rows[m * micro_batch : (m + 1) * micro_batch] for m in range(grad_accum)]
