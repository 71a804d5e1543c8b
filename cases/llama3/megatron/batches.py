"""Training data of the llama3/megatron case: corpus, sample order, per-rank batches.

With ``data.data_dir`` set, the corpus is ``<data_dir>/<prefix>.bin/.idx`` (a
Megatron indexed dataset, e.g. the tokenized wudao corpus): ``data.prefix`` names
it, or is null when the directory holds one corpus, or is Megatron's blended list
``"0.3 wudao_a 0.7 wudao_b"`` (``training.data.corpus``).  Without it, a
deterministic synthetic corpus is written once into ``data.cache_dir`` (by
local rank 0 of each node, atomically; the other ranks wait on a barrier).

Samples are contiguous windows of ``seq_length + 1`` tokens in a seeded
shuffled order (``training.data.indexed.TokenWindows``).  Optimizer step ``t``
(0-based) uses samples ``t*G .. t*G+G-1`` of that order (G = global batch);
data-parallel rank ``r`` takes the ``r``-th contiguous slice of ``G/dp``
samples and cuts it into ``grad_accum`` microbatches
(``training.data.windows``).  The samples of a step are therefore the same for
every parallel layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from cases.llama3.megatron.settings import Settings
from training.data import corpus, synthetic, windows
from training.data.indexed import IndexedReader

#: smallest and largest synthetic corpus written when data.synthetic_tokens is not set
SYNTHETIC_MIN_TOKENS = 1 << 20
SYNTHETIC_MAX_TOKENS = 1 << 26


def synthetic_tokens(s: Settings) -> int:
    return windows.synthetic_tokens(
        s.common.data.synthetic_tokens,
        s.common.train.steps,
        s.common.train.global_batch,
        s.shape.seq_length,
        SYNTHETIC_MIN_TOKENS,
        SYNTHETIC_MAX_TOKENS,
    )


def corpus_prefix(s: Settings, local_rank: int) -> tuple[list[tuple[float, str]], str]:
    """The corpus as (weight, file prefix) pairs (one pair unless blended) and a description
    for the run's meta record."""
    if s.common.data.data_dir:
        blend = corpus.megatron_prefixes(s.common.data.data_dir, s.common.data.prefix)
        if len(blend) == 1:
            return blend, f"indexed:{blend[0][1]}"
        return blend, "blend:" + " ".join(f"{w:g} {p}" for w, p in blend)
    cache_dir = s.common.data.cache_dir or os.path.join(os.getcwd(), ".cache", "synthetic")
    n = synthetic_tokens(s)
    spec = s.common.data.synthetic
    prefix = os.path.join(cache_dir, synthetic.corpus_name(s.shape.vocab_size, n, s.common.train.seed, spec=spec))
    if local_rank == 0:
        synthetic.ensure_corpus(cache_dir, s.shape.vocab_size, n, s.common.train.seed, spec=spec)
    dist.barrier()
    return [(1.0, prefix)], f"synthetic:{os.path.basename(prefix)}"


class StepBatches:
    """This data-parallel rank's share of every optimizer step."""

    def __init__(self, prefix: str | list[tuple[float, str]], s: Settings, dp_rank: int, device: torch.device, pin_memory: bool = False):
        blend = [(1.0, prefix)] if isinstance(prefix, str) else list(prefix)
        readers = [IndexedReader(p) for _, p in blend]
        self.prefixes = [p for _, p in blend]
        self.vocab_size = s.shape.vocab_size
        try:
            self.windows = corpus.open_windows([r.tokens for r in readers], [w for w, _ in blend], s.shape.seq_length, s.common.train.seed)
        except ValueError as exc:
            raise ValueError(f"{' + '.join(self.prefixes)}: {exc}") from None
        self.share = windows.RankShare(self.windows, s.common.train.global_batch, s.layout.dp, dp_rank)
        self.s = s
        self.device = device
        self.pin_memory = pin_memory  # page-locked host batches for an accelerator (Accelerator.pin_memory)

    def local_samples(self, step: int) -> np.ndarray:
        """``[global_batch/dp, seq+1]`` int64 token windows of ``step`` (0-based) for this rank."""
        return windows.check_token_ids(
            self.share.samples(step), self.vocab_size, " + ".join(p + ".bin" for p in self.prefixes), f"step {step + 1}'s samples"
        )

    def microbatches(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """The step's microbatches on the device: tokens, labels, position ids."""
        seq, mb = self.s.shape.seq_length, self.s.layout.micro_batch
        host = torch.from_numpy(self.local_samples(step))
        if self.pin_memory:
            host = host.pin_memory()
        data = host.to(self.device, non_blocking=True)
        positions = torch.arange(seq, device=self.device).unsqueeze(0).expand(mb, seq)
        for chunk in windows.micro_split(data, self.s.layout.grad_accum, mb):
            yield {
                "tokens": chunk[:, :-1].contiguous(),
                "labels": chunk[:, 1:].contiguous(),
                "position_ids": positions,
            }
