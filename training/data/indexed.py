"""Megatron's indexed dataset format (``.bin`` + ``.idx``, "MMIDIDX" version 1).

The ``.bin`` file is the token ids of every sequence, back to back, in one
numpy dtype.  The ``.idx`` file is::

    b"MMIDIDX\\x00\\x00"              9 bytes, magic
    <Q version = 1
    <B dtype code                     see DTYPE_CODES
    <Q sequence count S
    <Q document count D               len(document_indices)
    int32[S]  sequence lengths         tokens per sequence
    int64[S]  sequence pointers        byte offset of each sequence in .bin
    int64[D]  document indices         0, then the sequence index ending each document

This is the layout that ``megatron.core.datasets.indexed_dataset.IndexedDataset``
reads (without the optional multimodal mode array).  The writer and reader
here are independent of megatron so that data can be prepared and inspected
in any environment.

:class:`TokenWindows` turns a corpus into training samples: contiguous windows
of ``seq_length + 1`` tokens over the concatenated token stream, visited in a
deterministic shuffled order (a new permutation per epoch).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
    9: np.uint32,  # PaddleNLP's codes 9 and 10 (megatron-core stops at 8)
    10: np.uint64,
}
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def token_dtype(vocab_size: int) -> type:
    """The smallest dtype Megatron's preprocessing would choose for a vocabulary."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedWriter:
    """Writes one ``<prefix>.bin`` / ``<prefix>.idx`` pair.

    ``add_document(tokens)`` appends one document made of one sequence;
    ``add_sequence`` + ``end_document`` build multi-sequence documents.
    ``close()`` (or leaving the ``with`` block) writes the index.
    """

    def __init__(self, prefix: str, dtype: type = np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} is not one of the indexed format's dtypes")
        self._bin = open(bin_path(prefix), "wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        self._closed = False

    def add_sequence(self, tokens: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError("a sequence must be one-dimensional")
        if arr.size and np.issubdtype(arr.dtype, np.integer):
            info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
            if info is not None and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"token ids out of range for {self.dtype}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        self.add_sequence(tokens)
        self.end_document()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bin.close()
        if self._doc_indices[-1] != len(self._lengths):
            self._doc_indices.append(len(self._lengths))  # close an open document
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path(self.prefix), "wb") as fh:
            fh.write(INDEX_HEADER)
            fh.write(struct.pack("<Q", INDEX_VERSION))
            fh.write(struct.pack("<B", _CODE_OF[self.dtype]))
            fh.write(struct.pack("<Q", len(lengths)))
            fh.write(struct.pack("<Q", len(self._doc_indices)))
            fh.write(lengths.tobytes(order="C"))
            fh.write(pointers.tobytes(order="C"))
            fh.write(np.asarray(self._doc_indices, dtype=np.int64).tobytes(order="C"))

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # leave no half-written pair that looks valid
            self._closed = True
            self._bin.close()


def write_indexed(prefix: str, documents: Iterable[Sequence[int] | np.ndarray], dtype: type = np.int32) -> None:
    """Write every document (one sequence each) to ``<prefix>.bin/.idx``."""
    with IndexedWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)


class IndexedReader:
    """Reads ``<prefix>.bin/.idx`` through memory maps.

    Every problem with the pair (a short or foreign ``.idx``, a ``.bin`` whose size
    the index does not describe, a float dtype) is a ValueError whose message
    starts with the file at fault.
    """

    def __init__(self, prefix: str, integer_tokens: bool = True):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file")
        idx_size = os.path.getsize(ipath)
        with open(ipath, "rb") as fh:
            head = fh.read(HEADER_BYTES)
        if head[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(f"{ipath}: not a Megatron indexed dataset index (bad magic {head[: len(INDEX_HEADER)]!r})")
        if len(head) < HEADER_BYTES:
            raise ValueError(f"{ipath}: truncated: {idx_size} bytes, shorter than the {HEADER_BYTES}-byte header")
        at = len(INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", head, at)
        if version != INDEX_VERSION:
            raise ValueError(f"{ipath}: unsupported index version {version}")
        code = head[at + 8]
        if code not in DTYPE_CODES:
            raise ValueError(f"{ipath}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if integer_tokens and self.dtype.kind not in "iu":
            raise ValueError(f"{ipath}: dtype {self.dtype} (code {code}): token ids must be stored as integers")
        self.sequence_count, self.document_count = struct.unpack_from("<QQ", head, at + 9)
        n, d = self.sequence_count, self.document_count
        need = HEADER_BYTES + 4 * n + 8 * n + 8 * d
        if idx_size < need:
            raise ValueError(
                f"{ipath}: truncated: {idx_size} bytes, its header describes {n} sequences and {d} document indices ({need} bytes)"
            )
        offset = HEADER_BYTES
        idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n, offset=offset)
        offset += 4 * n
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n, offset=offset)
        offset += 8 * n
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=d, offset=offset)
        if n and (self.sequence_lengths.min() < 0):
            raise ValueError(f"{ipath}: negative sequence length")
        size = os.path.getsize(bpath)
        expected = int(self.sequence_lengths.astype(np.int64).sum()) * self.dtype.itemsize
        if size != expected:
            tokens = int(self.sequence_lengths.astype(np.int64).sum())
            fits = sorted({np.dtype(t).itemsize for t in DTYPE_CODES.values() if tokens and np.dtype(t).itemsize * tokens == size})
            if fits:  # the .bin holds the index's tokens at another element size: the dtype code is wrong
                codes = ", ".join(
                    f"{k} ({np.dtype(t).name})" for k, t in DTYPE_CODES.items() if np.dtype(t).itemsize in fits and np.dtype(t).kind in "iu"
                )
                raise ValueError(
                    f"{ipath}: dtype code {code} ({self.dtype.name}, {self.dtype.itemsize} bytes a token) does not fit "
                    f"{os.path.basename(bpath)}: its {size} bytes hold the index's {tokens} tokens at "
                    f"{' or '.join(str(b) for b in fits)} bytes a token (dtype codes {codes})"
                )
            raise ValueError(
                f"{bpath}: {size} bytes, the index {os.path.basename(ipath)} describes {expected} "
                f"({'truncated' if size < expected else 'longer than its index'})"
            )
        self._tokens = np.memmap(bpath, mode="r", dtype=self.dtype) if size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return self.sequence_count

    @property
    def num_tokens(self) -> int:
        return int(self._tokens.size)

    @property
    def tokens(self) -> np.ndarray:
        """All tokens, concatenated in file order (a read-only memory map)."""
        return self._tokens

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence ``idx`` (optionally a slice of it)."""
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[idx]) - offset if length is None else length
        return np.asarray(self._tokens[start : start + n])

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)


class TokenWindows:
    """Training samples: windows of ``seq_length + 1`` contiguous tokens.

    The corpus is cut into ``(num_tokens - 1) // seq_length`` non-overlapping
    windows (each window's last token is the next window's first, as in
    Megatron's GPT dataset).  Sample ``k`` is window ``perm_e[k mod W]`` of epoch
    ``e = k // W``, where ``perm_e`` is a permutation drawn from ``seed`` and
    ``e``: the order is deterministic and the same for every parallel layout.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int):
        self.tokens = tokens
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.num_windows = (int(tokens.size) - 1) // self.seq_length
        if self.num_windows < 1:
            raise ValueError(f"corpus of {tokens.size} tokens is shorter than one sample of {seq_length + 1} tokens")
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed, epoch, 0x5EED])
            self._perms = {epoch: rng.permutation(self.num_windows)}  # keep one epoch in memory
        return self._perms[epoch]

    def window(self, k: int) -> np.ndarray:
        epoch, pos = divmod(int(k), self.num_windows)
        w = int(self._perm(epoch)[pos])
        start = w * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def batch(self, first: int, count: int) -> np.ndarray:
        """Samples ``first .. first+count-1`` as an int64 array ``[count, seq_length+1]``."""
        return np.stack([self.window(first + i) for i in range(count)])
