"""A deterministic synthetic corpus in Megatron's indexed format.

Text is replaced by a seeded sparse Markov chain over the vocabulary: every
token has ``branching`` possible successors, drawn once from a Zipf-like
distribution over a shuffled vocabulary, taken with fixed skewed
probabilities.  The next-token entropy is about 1.2 nats (for the default 4
successors), far below ``ln(vocab)``, so a small model's loss falls clearly
within a few dozen steps, while every token id of the vocabulary can occur.
The same ``(vocab_size, num_tokens, seed, doc_length, branching)`` always
gives the same files, byte for byte.

Version 2 (:class:`Spec` with ``set_prob`` > 0) mixes in structure that only
attention carries: every span of ``span`` tokens draws a set of ``set_size``
tokens from a fixed alphabet of ``alphabet`` ids, and each next token is, with
probability ``set_prob``, one of its span's set (uniformly) instead of the chain's
successor.  Which ids a span's set holds is seen only in the tokens before, so a
model without attention, or with attention limited to a few keys back, cannot
predict them as well.  Version 1 (the Markov chain alone) stays what the
full-size references were made on.
"""

from __future__ import annotations

import os
import socket

import numpy as np

from training.data.corpus_spec import CORPUS_VERSION, SETS_VERSION, V1, Spec, read_spec
from training.data.indexed import IndexedReader, IndexedWriter, bin_path, idx_path, token_dtype

__all__ = ["CORPUS_VERSION", "SETS_VERSION", "V1", "Spec", "read_spec"]
SUCCESSOR_PROBS = {
    2: (0.7, 0.3),
    4: (0.55, 0.25, 0.12, 0.08),
    8: (0.4, 0.2, 0.12, 0.09, 0.07, 0.05, 0.04, 0.03),
}


def corpus_name(vocab_size: int, num_tokens: int, seed: int, doc_length: int = 1024, branching: int = 4, spec: Spec = V1) -> str:
    """File prefix (without directory) naming every parameter of the corpus."""
    return f"synthetic_v{spec.version}_V{vocab_size}_N{num_tokens}_S{seed}_D{doc_length}_B{branching}{spec.key()}"


def markov_tokens(vocab_size: int, num_tokens: int, seed: int, doc_length: int = 1024, branching: int = 4, spec: Spec = V1) -> np.ndarray:
    """The corpus as an array ``[num_docs, doc_length]`` (the last row may be padded; see ``documents``)."""
    if branching not in SUCCESSOR_PROBS:
        raise ValueError(f"branching must be one of {sorted(SUCCESSOR_PROBS)}, not {branching}")
    if vocab_size < 2 or num_tokens < 1 or doc_length < 1:
        raise ValueError("vocab_size >= 2, num_tokens >= 1 and doc_length >= 1 are required")
    if spec.alphabet > vocab_size:
        raise ValueError(f"data.synthetic.alphabet {spec.alphabet} is larger than the vocabulary ({vocab_size})")
    table_rng = np.random.default_rng([seed, vocab_size, branching, 0xC4A1])
    ranks = table_rng.permutation(vocab_size)  # token id -> frequency rank
    weights = 1.0 / (ranks + 10.0)
    weights /= weights.sum()
    successors = table_rng.choice(vocab_size, size=(vocab_size, branching), p=weights)
    cdf = np.cumsum(SUCCESSOR_PROBS[branching])
    cdf[-1] = 1.0

    doc_rng = np.random.default_rng([seed, vocab_size, num_tokens, doc_length, 0xD0C5])
    num_docs = -(-num_tokens // doc_length)
    out = np.empty((num_docs, doc_length), dtype=np.int64)
    cur = doc_rng.choice(vocab_size, size=num_docs, p=weights)
    if spec.version == SETS_VERSION:
        return _with_sets(
            out, cur, successors, cdf, branching, spec, np.random.default_rng([seed, vocab_size, num_tokens, doc_length, 0x5E75])
        )
    for t in range(doc_length):
        out[:, t] = cur
        pick = np.searchsorted(cdf, doc_rng.random(num_docs), side="right")
        cur = successors[cur, np.minimum(pick, branching - 1)]
    return out


def _with_sets(
    out: np.ndarray, cur: np.ndarray, successors: np.ndarray, cdf: np.ndarray, branching: int, spec: Spec, rng: np.random.Generator
) -> np.ndarray:
    """Version 2: the chain, each next token drawn from its span's set with ``spec.set_prob``."""
    num_docs, doc_length = out.shape
    alphabet = rng.choice(successors.shape[0], size=spec.alphabet, replace=False)
    rows = np.arange(num_docs)
    sets = alphabet[:1]
    for t in range(doc_length):
        if t % spec.span == 0:
            sets = alphabet[np.argsort(rng.random((num_docs, spec.alphabet)), axis=1)[:, : spec.set_size]]
        out[:, t] = cur
        pick = np.minimum(np.searchsorted(cdf, rng.random(num_docs), side="right"), branching - 1)
        from_set = rng.random(num_docs) < spec.set_prob
        cur = np.where(from_set, sets[rows, rng.integers(0, spec.set_size, num_docs)], successors[cur, pick])
    return out


def documents(vocab_size: int, num_tokens: int, seed: int, doc_length: int = 1024, branching: int = 4, spec: Spec = V1) -> list[np.ndarray]:
    """The corpus as a list of documents holding exactly ``num_tokens`` tokens."""
    rows = markov_tokens(vocab_size, num_tokens, seed, doc_length, branching, spec)
    docs = list(rows)
    tail = num_tokens - (len(docs) - 1) * doc_length
    docs[-1] = docs[-1][:tail]
    return docs


def write_corpus(
    prefix: str, vocab_size: int, num_tokens: int, seed: int, doc_length: int = 1024, branching: int = 4, spec: Spec = V1
) -> None:
    """Write the corpus to ``<prefix>.bin/.idx`` atomically.

    Both files are written under a temporary name unique to this process and
    renamed into place, ``.idx`` last: a reader that sees the ``.idx`` sees a
    complete pair, also when several writers race on a shared file system.
    """
    directory = os.path.dirname(prefix) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{prefix}.tmp-{socket.gethostname()}-{os.getpid()}"
    dtype = token_dtype(vocab_size)
    try:
        with IndexedWriter(tmp, dtype) as w:
            for doc in documents(vocab_size, num_tokens, seed, doc_length, branching, spec):
                w.add_document(doc)
        os.replace(bin_path(tmp), bin_path(prefix))
        os.replace(idx_path(tmp), idx_path(prefix))
    finally:
        for p in (bin_path(tmp), idx_path(tmp)):
            if os.path.exists(p):
                os.remove(p)


def ensure_corpus(
    cache_dir: str, vocab_size: int, num_tokens: int, seed: int, doc_length: int = 1024, branching: int = 4, spec: Spec = V1
) -> str:
    """Write the corpus into ``cache_dir`` unless it is there; return its prefix."""
    prefix = os.path.join(cache_dir, corpus_name(vocab_size, num_tokens, seed, doc_length, branching, spec))
    if not (os.path.exists(idx_path(prefix)) and os.path.exists(bin_path(prefix))):
        write_corpus(prefix, vocab_size, num_tokens, seed, doc_length, branching, spec)
    return prefix


def is_complete(prefix: str) -> bool:
    try:
        IndexedReader(prefix)
    except (OSError, ValueError):
        return False
    return True
