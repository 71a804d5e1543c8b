"""Training data of a decoder case: samples of ``seq_length + 1`` tokens from a Megatron
indexed dataset, batched for one data-parallel rank.

Two sources (``training.data.indexed``):

- ``data["data_dir"]`` set: a tokenized corpus in ``<data_dir>/<prefix>.bin`` +
  ``<prefix>.idx`` (ids below the model's vocabulary).  ``data["prefix"]`` names the
  pair, or Megatron's blended list ``"0.3 a 0.7 b"``; without it the directory must
  hold exactly one corpus (``training.data.corpus``).  ``data["max_tokens"]`` (when
  set) keeps only the first that many tokens of each corpus.
- ``data_dir`` null: a deterministic synthetic Markov corpus of
  ``data["synthetic_tokens"]`` tokens over the model's vocabulary, written once into
  ``data["cache_dir"]`` (by local rank 0; the others wait for the complete pair).
  Its loss is not comparable to a real-data loss.

Samples are contiguous windows visited in a seeded order
(:class:`training.data.indexed.TokenWindows`).  Optimizer step ``s`` uses samples
``s * global_batch`` to ``(s + 1) * global_batch - 1``, whatever the data-parallel
layout: micro step ``m`` of data-parallel rank ``r`` takes the ``micro_batch`` samples
starting at ``s * global_batch + (m * dp + r) * micro_batch``.  Used by
cases/baichuan2/deepspeed and the cases ``scaffold-case`` writes (numpy at module
level, torch only where tensors are made).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from training.data import corpus
from training.data.indexed import IndexedReader
from training.data.synthetic import corpus_name, ensure_corpus, is_complete, read_spec
from training.data.windows import check_token_ids
from training.settings import grad_accum

DEFAULT_SYNTHETIC_TOKENS = 1 << 23


def find_prefixes(data_dir: str, prefix: str | list | None = None) -> list[tuple[float, str]]:
    """The corpus's ``<data_dir>/<prefix>`` (weight, path) pairs: one, or a blend."""
    return corpus.megatron_prefixes(data_dir, prefix)


def find_prefix(data_dir: str, prefix: str | None = None) -> str:
    """The ``<data_dir>/<prefix>`` path of the corpus's ``.bin/.idx`` pair (one corpus)."""
    found = find_prefixes(data_dir, prefix)
    if len(found) != 1:
        raise ValueError(f"data.prefix {prefix!r} names a blend of {len(found)} corpora where one is expected")
    return found[0][1]


def synthetic_prefix(data: dict[str, Any], vocab_size: int, seed: int, local_rank: int, timeout_s: float = 600.0) -> str:
    """Write (local rank 0) or wait for (other ranks) the synthetic corpus; return its prefix."""
    cache_dir = data.get("cache_dir")
    if not cache_dir:
        raise ValueError("data.cache_dir is needed to write the synthetic corpus (data.data_dir is null)")
    num_tokens = int(float(data.get("synthetic_tokens") or DEFAULT_SYNTHETIC_TOKENS))
    spec = read_spec(data.get("synthetic"))
    if local_rank == 0:
        return ensure_corpus(cache_dir, vocab_size, num_tokens, seed, spec=spec)
    prefix = os.path.join(cache_dir, corpus_name(vocab_size, num_tokens, seed, spec=spec))
    deadline = time.monotonic() + timeout_s
    while not is_complete(prefix):
        if time.monotonic() > deadline:
            raise TimeoutError(f"synthetic corpus {prefix} not written within {timeout_s:.0f} s")
        time.sleep(0.2)
    return prefix


class TokenBatches:
    """Batches for one data-parallel rank.

    ``data`` is the phase's ``data`` section; the other arguments come from the
    checked settings (training/settings.py and the case's shape).
    """

    def __init__(
        self,
        data: dict[str, Any],
        *,
        seq_length: int,
        vocab_size: int,
        global_batch: int,
        micro_batch: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
        local_rank: int = 0,
    ):
        data = data or {}
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.global_batch = int(global_batch)
        self.micro_batch = int(micro_batch)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.grad_accum = grad_accum(self.global_batch, self.micro_batch, self.dp_size)
        if data.get("data_dir"):
            self.source = "indexed"
            blend = find_prefixes(data["data_dir"], data.get("prefix"))
        else:
            self.source = "synthetic"
            blend = [(1.0, synthetic_prefix(data, self.vocab_size, int(data.get("synthetic_seed", seed)), local_rank))]
        self.prefixes = [p for _, p in blend]
        self.prefix = " ".join(self.prefixes) if len(blend) > 1 else self.prefixes[0]
        arrays = [IndexedReader(p).tokens for p in self.prefixes]
        max_tokens = data.get("max_tokens")
        if max_tokens and self.source == "indexed":  # the head of each corpus
            arrays = [t[: int(float(max_tokens))] for t in arrays]
        self.num_tokens = int(sum(t.size for t in arrays))
        try:
            self.windows = corpus.open_windows(arrays, [w for w, _ in blend], self.seq_length, int(seed))
        except ValueError as exc:
            raise ValueError(f"{self.prefix}: {exc}") from None

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "prefix": self.prefix, "num_tokens": self.num_tokens, "num_windows": self.windows.num_windows}

    def micro_batch_tokens(self, step: int, micro_step: int) -> np.ndarray:
        """int64 ``[micro_batch, seq_length + 1]`` for optimizer step ``step`` (0-based), micro step ``micro_step``."""
        first = step * self.global_batch + (micro_step * self.dp_size + self.dp_rank) * self.micro_batch
        return check_token_ids(
            self.windows.batch(first, self.micro_batch), self.vocab_size, self.prefix, f"step {step + 1}, micro step {micro_step}"
        )

    def micro_batch_tensors(self, step: int, micro_step: int, device: Any = None):
        """``(input_ids, labels)`` torch tensors, each ``[micro_batch, seq_length]``."""
        import torch

        batch = torch.from_numpy(self.micro_batch_tokens(step, micro_step))
        if device is not None:
            batch = batch.to(device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]
