"""Training data of the baichuan2 case: samples of ``seq_length + 1`` tokens, read by the
shared ``training.data.token_batches`` (this module names it for the case).

Two sources, both Megatron indexed datasets (``training.data.indexed``):

- ``cfg["data"]["data_dir"]`` set: a tokenized corpus (seed 003: openwebtext,
  the first 1e8 tokens) in ``<data_dir>/<prefix>.bin`` + ``<prefix>.idx``,
  tokenized with the Baichuan2 tokenizer (ids below the model's vocabulary,
  125,696).  ``cfg["data"]["prefix"]`` names the pair, or Megatron's blended
  list ``"0.3 a 0.7 b"``; without it the directory must hold exactly one corpus
  (``training.data.corpus``).  ``cfg["data"]["max_tokens"]``
  (when set) keeps only the first that many tokens of the concatenated stream.
- ``data_dir`` null: a deterministic synthetic Markov corpus of
  ``cfg["data"]["synthetic_tokens"]`` tokens over the model's vocabulary,
  written once into ``cfg["data"]["cache_dir"]`` (by local rank 0; the others
  wait for the complete pair).  Its loss is not comparable to a real-data loss.

Samples are contiguous windows visited in a seeded order
(:class:`training.data.indexed.TokenWindows`).  Optimizer step ``s`` uses
samples ``s * global_batch`` to ``(s + 1) * global_batch - 1``, whatever the
data-parallel layout: micro step ``m`` of data-parallel rank ``r`` takes the
``micro_batch`` samples starting at ``s * global_batch + (m * dp + r) * micro_batch``.
"""

from __future__ import annotations

from training.data.token_batches import DEFAULT_SYNTHETIC_TOKENS, find_prefix, find_prefixes, synthetic_prefix
from training.data.token_batches import TokenBatches as CaseData

__all__ = ["DEFAULT_SYNTHETIC_TOKENS", "CaseData", "find_prefix", "find_prefixes", "synthetic_prefix"]
