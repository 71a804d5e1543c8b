"""Training data of the gpt3/paddle case: corpus, sample order, per-rank batches.

With ``data.data_dir`` set, the corpus is PaddleNLP's GPT pretraining pair in
that directory (``gpt_en_dataset_300m_ids.npy`` + ``gpt_en_dataset_300m_idx.npz``
in FlagPerf; see ``training.data.paddle_gpt``) or the ``<prefix>.bin`` +
``<prefix>.idx`` pair PaddleNLP's ``make_builder(..., "mmap", ...)`` writes, chosen by
``data.prefix`` or found as the only corpus there.  Without it, the project's synthetic corpus is
written once in that format into ``data.cache_dir`` by local rank 0 of each
node; the other ranks wait on a barrier.

Optimizer step ``t`` (0-based) uses samples ``t*G .. t*G+G-1`` of the seeded
window order (G = global batch); data-parallel rank ``r`` (paddle's
``sharding_degree * dp_rank + sharding_rank``) takes the ``r``-th contiguous
slice of ``G / dp`` samples, cut into ``grad_accum`` micro-batches
(``training.data.windows``).  TP ranks and pipeline stages of one replica read
the same samples.  So the sequences of a step are the same for every layout.
"""

from __future__ import annotations

import os

import numpy as np

from cases.gpt3.paddle.settings import Settings
from training.data import paddle_gpt, windows

#: smallest and largest synthetic corpus written when data.synthetic_tokens is not set
SYNTHETIC_MIN_TOKENS = 1 << 20
SYNTHETIC_MAX_TOKENS = 1 << 25


def synthetic_tokens(s: Settings) -> int:
    return windows.synthetic_tokens(
        s.common.data.synthetic_tokens,
        s.common.train.steps,
        s.common.train.global_batch,
        s.shape.seq_length,
        SYNTHETIC_MIN_TOKENS,
        SYNTHETIC_MAX_TOKENS,
    )


def corpus_prefix(s: Settings, local_rank: int, barrier) -> tuple[str, str]:
    """The corpus prefix and a description of it for the meta record."""
    if s.common.data.data_dir:
        if s.common.data.prefix:
            prefix = (
                s.common.data.prefix if os.path.isabs(s.common.data.prefix) else os.path.join(s.common.data.data_dir, s.common.data.prefix)
            )
            for ext in (".bin", ".idx", paddle_gpt.IDS_SUFFIX, paddle_gpt.IDX_SUFFIX):
                prefix = prefix[: -len(ext)] if prefix.endswith(ext) else prefix
            if paddle_gpt.layout(prefix) is None:
                raise FileNotFoundError(
                    f"data.prefix {s.common.data.prefix!r}: neither {prefix}{paddle_gpt.IDS_SUFFIX} + {prefix}{paddle_gpt.IDX_SUFFIX} "
                    f"nor {prefix}.bin + {prefix}.idx exist (data.data_dir {s.common.data.data_dir})"
                )
        else:
            prefix = paddle_gpt.find_prefix(s.common.data.data_dir)
        kind = "paddle_gpt" if paddle_gpt.layout(prefix) == "npy" else "paddle_mmap"
        return prefix, f"{kind}:{prefix}"
    cache_dir = s.common.data.cache_dir or os.path.join(os.getcwd(), ".cache", "synthetic")
    n = synthetic_tokens(s)
    spec = s.common.data.synthetic
    if local_rank == 0:
        paddle_gpt.ensure_synthetic(cache_dir, s.shape.vocab_size, n, s.common.train.seed, spec)
    barrier()
    prefix = paddle_gpt.synthetic_prefix(cache_dir, s.shape.vocab_size, n, s.common.train.seed, spec)
    return prefix, f"synthetic:{os.path.basename(prefix)}"


class StepBatches:
    """This rank's micro-batches of each optimizer step, as numpy arrays."""

    def __init__(self, prefix: str, s: Settings, data_rank: int):
        self.prefix = prefix
        self.vocab_size = s.shape.vocab_size
        tokens = paddle_gpt.read_tokens(prefix)
        top = int(np.max(tokens[: min(int(tokens.shape[0]), 1 << 20)]))
        if top >= s.shape.vocab_size:
            raise ValueError(f"corpus {prefix} holds token id {top}, outside the model's vocabulary of {s.shape.vocab_size}")
        try:
            self.windows = paddle_gpt.TokenWindows(tokens, s.shape.seq_length, s.common.train.seed)
        except ValueError as exc:
            raise ValueError(f"corpus {prefix}: {exc}") from None
        self.share = windows.RankShare(self.windows, s.common.train.global_batch, s.layout.dp, data_rank)
        self.micro_batch = s.layout.micro_batch
        self.grad_accum = s.layout.grad_accum

    def step(self, step: int) -> np.ndarray:
        """All of this rank's samples of one step: ``[per_rank, seq + 1]`` int64."""
        return windows.check_token_ids(self.share.samples(step), self.vocab_size, f"corpus {self.prefix}", f"step {step + 1}'s samples")

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``grad_accum`` pairs (input ids, labels), each ``[micro_batch, seq]``."""
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in windows.micro_split(self.step(step), self.grad_accum, self.micro_batch)]
