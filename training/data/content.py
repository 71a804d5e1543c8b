"""The canonical content of data, what a fingerprint is taken of (docs/datasets.md, "Fingerprints").

A fingerprint hashes what training reads, decoded, never the bytes of the files it sits in:

- a token corpus: ``b"flagbench tokens v1\\0"``, the token count (uint64 LE), the count of document
  boundaries (uint64 LE) and the boundaries as token offsets (int64 LE: 0, the first token of each
  next document, ..., the token count), then every token id as uint32 LE in corpus order. A Megatron
  ``.bin``/``.idx`` pair, PaddleNLP's ``_ids.npy``/``_idx.npz`` pair and its mmap pair holding the same
  ids and documents, in uint16 or int32, under any name, have one content;
- LLaVA entries: the parsed JSON list re-serialized with sorted keys and no whitespace (UTF-8);
- an image: ``"<width>x<height>\\0"`` and its pixels decoded to RGB (what the ranks read), so its
  metadata and container do not count;
- a tokenizer: its ids and tokens, its BPE merges, its special tokens and its pipeline
  (``tokenizer.json``'s normalizer, pre-tokenizer, post-processor, decoder and model type), as sorted
  JSON; a sentencepiece ``tokenizer.model`` by its pieces and its bytes.

The hash object is the caller's (``new_hash()``: anything with ``update`` and ``hexdigest``): this
machine and the cluster's hosts use hashlib's SHA-256. numpy and the standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

TOKENS_MAGIC = b"flagbench tokens v1\0"
#: tokens hashed and scanned per chunk (64 Mi of them)
CHUNK = 1 << 26
#: the opt-in sampled fingerprint (data.fingerprint: sampled): this many blocks of this many tokens
SAMPLE_BLOCKS, SAMPLE_TOKENS = 64, 1 << 15


def document_starts(sequence_lengths: np.ndarray, sequence_documents: np.ndarray, head: int | None = None) -> np.ndarray:
    """Document boundaries as token offsets: ``sequence_documents`` are sequence indices (0, the
    first sequence of each next document, ..., the sequence count), as Megatron's
    ``document_indices`` and PaddleNLP's ``docs``; ``head`` keeps the first ``head`` tokens only."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(sequence_lengths, dtype=np.int64))])
    docs = np.asarray(sequence_documents, dtype=np.int64)
    docs = docs[(docs >= 0) & (docs < starts.size)]
    out = np.unique(starts[docs])
    if head is not None:
        out = np.concatenate([out[out < head], [head]])
    return out.astype("<i8")


def tokens(
    ids: np.ndarray, starts: np.ndarray, vocab_size: int, new_hash: Callable[[], Any], sampled: bool = False, chunk: int = CHUNK
) -> dict[str, Any]:
    """One pass over a token array (a memory map read chunk by chunk): the hex digest of its
    canonical content (``sampled``: of 64 blocks of 32 Ki tokens spread over it, the count and
    boundaries whole), its smallest and largest id and the first id outside ``[0, vocab_size)``
    with its position (None when all fit)."""
    n = int(ids.shape[0])
    h = new_hash()
    h.update(TOKENS_MAGIC)
    h.update(np.uint64(n).tobytes())
    b = np.ascontiguousarray(starts, dtype="<i8")
    h.update(np.uint64(b.size).tobytes())
    h.update(b.tobytes())
    scan = RangeScan(vocab_size)
    blocks = (
        {(n - SAMPLE_TOKENS) * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)}
        if sampled and n > SAMPLE_BLOCKS * SAMPLE_TOKENS
        else None
    )
    for start in range(0, n, chunk):
        part = scan.add(np.asarray(ids[start : start + chunk]), start)
        if blocks is None:
            h.update(part.astype("<u4", copy=False).data)
        else:
            for first in sorted(x for x in blocks if start <= x < start + chunk):
                block = np.asarray(ids[first : first + SAMPLE_TOKENS])
                h.update(np.uint64(first).tobytes())
                h.update(block.astype("<u4", copy=False).data)
    return {"digest": h.hexdigest()[:16], **scan.result()}


class RangeScan:
    """The smallest and largest id of a token array read chunk by chunk, and the first position
    holding an id outside ``[0, vocab_size)`` with that id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.lo: int | None = None
        self.hi: int | None = None
        self.bad: tuple[int, int] | None = None

    def add(self, part: np.ndarray, start: int) -> np.ndarray:
        """Take in the chunk that begins at token ``start``; returns it."""
        if part.size:
            cmin, cmax = int(part.min()), int(part.max())
            self.lo = cmin if self.lo is None else min(self.lo, cmin)
            self.hi = cmax if self.hi is None else max(self.hi, cmax)
            if self.bad is None and (cmin < 0 or cmax >= self.vocab_size):
                where = int(np.flatnonzero((part < 0) | (part >= self.vocab_size))[0])
                self.bad = (start + where, int(part[where]))
        return part

    def result(self) -> dict[str, Any]:
        return {"min": self.lo, "max": self.hi, "first_bad": self.bad}


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: what two spellings of one document share."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def entries(records: list[Any], new_hash: Callable[[], Any]) -> str:
    """The digest of a phase's LLaVA entries as parsed (the ones training reads)."""
    h = new_hash()
    h.update(canonical_json(records))
    return h.hexdigest()[:16]


def image_pixels(im: Any, new_hash: Callable[[], Any]) -> str:
    """The digest of a decoded Pillow image: its size and its RGB pixels."""
    rgb = im.convert("RGB")
    h = new_hash()
    h.update(f"{rgb.size[0]}x{rgb.size[1]}\0".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()[:16]


def _json_file(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def tokenizer(folder: str, ids: dict[int, str], new_hash: Callable[[], Any]) -> str:
    """The digest of a tokenizer folder's content (``ids``: every id and its token, as
    ``llava_schema.tokenizer_ids`` reads them). ValueError naming the file that does not parse."""
    body: dict[str, Any] = {"ids": sorted(ids.items())}
    fast = os.path.join(folder, "tokenizer.json")
    try:
        if os.path.isfile(fast):
            data = _json_file(fast)
            model = data.get("model") or {}
            body["merges"] = model.get("merges") or []
            body["pipeline"] = {k: data.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")}
            body["pipeline"]["model"] = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
            body["added"] = data.get("added_tokens") or []
        elif os.path.isfile(os.path.join(folder, "merges.txt")):
            with open(os.path.join(folder, "merges.txt"), encoding="utf-8") as fh:
                body["merges"] = [line.rstrip("\n") for line in fh if line.strip() and not line.startswith("#version")]
        spm = os.path.join(folder, "tokenizer.model")
        if os.path.isfile(spm):
            h = new_hash()
            with open(spm, "rb") as fh:
                h.update(fh.read())
            body["sentencepiece"] = h.hexdigest()
        special = os.path.join(folder, "special_tokens_map.json")
        if os.path.isfile(special):
            body["special"] = _json_file(special)
        config = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config):
            cfg = _json_file(config)
            body["config"] = {
                k: cfg.get(k)
                for k in sorted(cfg)
                if k.endswith("_token") or k in ("added_tokens_decoder", "add_bos_token", "add_eos_token", "chat_template", "legacy")
            }
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"tokenizer {folder}: a file does not parse ({exc})") from None
    h = new_hash()
    h.update(canonical_json(body))
    return h.hexdigest()[:16]
