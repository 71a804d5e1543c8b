"""Training data of the gpt3/paddle case: corpus, sample order, per-rank batches.

With ``data.data_dir`` set, the corpus is PaddleNLP's GPT pretraining pair in
that directory (``gpt_en_dataset_300m_ids.npy`` + ``gpt_en_dataset_300m_idx.npz``
in FlagPerf; see ``training.data.paddle_gpt``), chosen by ``data.prefix`` or
found as the only pair there.  Without it, the project's synthetic corpus is
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

from gpt3_settings import Settings
from training.data import paddle_gpt, windows

#: smallest and largest synthetic corpus written when data.synthetic_tokens is not set
SYNTHETIC_MIN_TOKENS = 1 << 20
SYNTHETIC_MAX_TOKENS = 1 << 25


def synthetic_tokens(s: Settings) -> int:
    return windows.synthetic_tokens(
        s.synthetic_tokens, s.steps, s.global_batch, s.shape.seq_length, SYNTHETIC_MIN_TOKENS, SYNTHETIC_MAX_TOKENS
    )


def corpus_prefix(s: Settings, local_rank: int, barrier) -> tuple[str, str]:
    """The corpus prefix and a description of it for the meta record."""
    if s.data_dir:
        if s.data_prefix:
            prefix = os.path.join(s.data_dir, s.data_prefix)
            if not paddle_gpt.exists(prefix):
                raise FileNotFoundError(
                    f"data.data_dir/prefix: {prefix}{paddle_gpt.IDS_SUFFIX} and {prefix}{paddle_gpt.IDX_SUFFIX} must both exist"
                )
        else:
            prefix = paddle_gpt.find_prefix(s.data_dir)
        return prefix, f"paddle_gpt:{prefix}"
    cache_dir = s.cache_dir or os.path.join(os.getcwd(), ".cache", "synthetic")
    n = synthetic_tokens(s)
    if local_rank == 0:
        paddle_gpt.ensure_synthetic(cache_dir, s.shape.vocab_size, n, s.seed)
    barrier()
    prefix = paddle_gpt.synthetic_prefix(cache_dir, s.shape.vocab_size, n, s.seed)
    return prefix, f"synthetic:{os.path.basename(prefix)}"


class StepBatches:
    """This rank's micro-batches of each optimizer step, as numpy arrays."""

    def __init__(self, prefix: str, s: Settings, data_rank: int):
        self.corpus = paddle_gpt.read_corpus(prefix)
        top = int(np.max(self.corpus.ids[: min(self.corpus.num_tokens, 1 << 20)]))
        if top >= s.shape.vocab_size:
            raise ValueError(f"corpus {prefix} holds token id {top}, outside the model's vocabulary of {s.shape.vocab_size}")
        self.windows = paddle_gpt.token_windows(self.corpus, s.shape.seq_length, s.seed)
        self.share = windows.RankShare(self.windows, s.global_batch, s.layout.dp, data_rank)
        self.micro_batch = s.layout.micro_batch
        self.grad_accum = s.layout.grad_accum

    def step(self, step: int) -> np.ndarray:
        """All of this rank's samples of one step: ``[per_rank, seq + 1]`` int64."""
        return self.share.samples(step)

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``grad_accum`` pairs (input ids, labels), each ``[micro_batch, seq]``."""
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in windows.micro_split(self.step(step), self.grad_accum, self.micro_batch)]
