"""PaddleNLP's GPT pretraining corpus format: reader, writer, synthetic corpus, sampler.

A corpus is two files that share a prefix (FlagPerf's gpt3 cases use
``gpt_en_dataset_300m``)::

    <prefix>_ids.npy   1-D array: the token ids of every sentence of every
                       document, concatenated, no separators. dtype uint16 when
                       the tokenizer's vocabulary has fewer than 65535 entries,
                       else int32.
    <prefix>_idx.npz   "lens": int32 [num_sentences], the length of each
                       sentence (a sentence is one contiguous run of ``ids``);
                       "docs": int64 [num_documents + 1], cumulative sentence
                       counts: document d is sentences docs[d] .. docs[d+1]-1,
                       docs[0] == 0 and docs[-1] == num_sentences.

PaddleNLP's newer preprocessing (``paddlenlp.data.indexed_dataset.make_builder(path,
"mmap", dtype)``) writes ``<prefix>.bin`` + ``<prefix>.idx`` instead: Megatron's
indexed format (``training.data.indexed``, with PaddleNLP's dtype codes 9 and 10 for
uint32/uint64).  ``read_tokens`` reads either, the npy pair first, as PaddleNLP's
``make_dataset`` does.

The pair is what PaddleNLP's ``create_pretraining_data.py`` writes and what its
``CompatibleIndexedDataset`` reads (``paddlenlp/data/indexed_dataset.py``:
``np.load(path + "_ids.npy", mmap_mode="r")``, ``np.load(path + "_idx.npz")``,
``["lens"]``, ``["docs"]``).  Files from older releases may lack ``docs``; the
reader then treats every sentence as one document.  For GPT the appended
end-of-document token is part of the last sentence of each document.

Training samples are windows of ``seq_length + 1`` tokens cut from the
concatenated stream (consecutive windows share one token, as in Megatron and
PaddleNLP), visited in a seeded random order (``token_windows``, which is
``training.data.indexed.TokenWindows``); input = window[:-1], labels = window[1:].

Standard library and numpy only: no framework import.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
import zipfile

import numpy as np

from training.data import synthetic
from training.data.corpus import lone_halves
from training.data.indexed import IndexedReader, TokenWindows

IDS_SUFFIX = "_ids.npy"
IDX_SUFFIX = "_idx.npz"


def ids_dtype(vocab_size: int) -> np.dtype:
    """The dtype PaddleNLP's preprocessing picks for a vocabulary size."""
    return np.dtype(np.uint16) if vocab_size < 2**16 - 1 else np.dtype(np.int32)


def write_corpus(prefix: str, documents: list[list[np.ndarray]] | list[np.ndarray], vocab_size: int) -> None:
    """Write ``<prefix>_ids.npy`` and ``<prefix>_idx.npz``.

    ``documents`` is a list of documents; a document is either one 1-D array
    of token ids (one sentence) or a list of such arrays (its sentences).
    Empty sentences are dropped, as PaddleNLP's preprocessing does.
    """
    dtype = ids_dtype(vocab_size)
    chunks: list[np.ndarray] = []
    lens: list[int] = []
    docs = [0]
    for doc in documents:
        sentences = [doc] if isinstance(doc, np.ndarray) else list(doc)
        for sent in sentences:
            sent = np.asarray(sent)
            if sent.size == 0:
                continue
            if sent.min() < 0 or sent.max() >= vocab_size:
                raise ValueError(f"token id out of range [0, {vocab_size}) in document {len(docs) - 1}")
            chunks.append(sent.astype(dtype, copy=False))
            lens.append(int(sent.size))
        docs.append(len(lens))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    _save_pair(prefix, ids, np.asarray(lens, dtype=np.int32), np.asarray(docs, dtype=np.int64))


def _save_pair(prefix: str, ids: np.ndarray, lens: np.ndarray, docs: np.ndarray) -> None:
    """Write both files through temporary names, then rename (readers never see half a file)."""
    directory = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(directory, exist_ok=True)
    fd, tmp_ids = tempfile.mkstemp(dir=directory, suffix=".npy.tmp")
    os.close(fd)
    fd, tmp_idx = tempfile.mkstemp(dir=directory, suffix=".npz.tmp")
    os.close(fd)
    try:
        with open(tmp_ids, "wb") as fh:
            np.save(fh, ids)
        with open(tmp_idx, "wb") as fh:
            np.savez(fh, lens=lens, docs=docs)
        # idx last: its presence marks a complete pair
        os.replace(tmp_ids, prefix + IDS_SUFFIX)
        os.replace(tmp_idx, prefix + IDX_SUFFIX)
    finally:
        for tmp in (tmp_ids, tmp_idx):
            if os.path.exists(tmp):
                os.unlink(tmp)


@dataclasses.dataclass
class Corpus:
    """A corpus read back: ids memory-mapped, index in memory."""

    prefix: str
    ids: np.ndarray  # 1-D, memory-mapped
    lens: np.ndarray  # int32 [num_sentences]
    docs: np.ndarray  # int64 [num_documents + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.docs.shape[0] - 1)

    def sentence(self, i: int) -> np.ndarray:
        start = int(self.lens[:i].sum())
        return np.asarray(self.ids[start : start + int(self.lens[i])])

    def document(self, d: int) -> list[np.ndarray]:
        offsets = np.concatenate([[0], np.cumsum(self.lens, dtype=np.int64)])
        return [np.asarray(self.ids[offsets[s] : offsets[s + 1]]) for s in range(int(self.docs[d]), int(self.docs[d + 1]))]


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + IDS_SUFFIX) and os.path.isfile(prefix + IDX_SUFFIX)


def mmap_exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def layout(prefix: str) -> str | None:
    """``"npy"`` (the _ids.npy/_idx.npz pair), ``"mmap"`` (.bin/.idx) or None, the pair first."""
    return "npy" if exists(prefix) else "mmap" if mmap_exists(prefix) else None


def read_tokens(prefix: str) -> np.ndarray:
    """Every token of the corpus at ``prefix``, in either layout, memory-mapped; errors name the file."""
    if layout(prefix) == "mmap":
        return IndexedReader(prefix).tokens
    return read_corpus(prefix).ids


def _load(path: str, **kw):  # type: ignore[no-untyped-def]
    """``np.load`` whose failures name the file (a truncated or foreign file, a pickled array)."""
    what = ".npz archive" if path.endswith(".npz") else ".npy array"
    try:
        with open(path, "rb") as fh:
            head = fh.read(6)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    magic = b"PK\x03\x04" if path.endswith(".npz") else b"\x93NUMPY"
    if not head.startswith(magic) and not (path.endswith(".npz") and head.startswith(b"\x93NUMPY")):
        if head.startswith(b"\x80") and not path.endswith(".npz"):  # what np.save(allow_pickle=True) writes for objects
            raise ValueError(f"{path}: not a readable numpy {what} (holds Python objects (a pickled array), not token ids)")
        raise ValueError(f"{path}: not a readable numpy {what} (bad magic {head!r}; a numpy file starts with {magic!r})")
    try:
        return np.load(path, allow_pickle=False, **kw)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "allow_pickle" in text or "Python objects" in text:
            text = "holds Python objects (a pickled array), not token ids"
        raise ValueError(f"{path}: not a readable numpy {what} ({text})") from None


def read_corpus(prefix: str) -> Corpus:
    """Read a corpus pair and check that its two files agree."""
    if not exists(prefix):
        raise FileNotFoundError(f"no corpus at {prefix!r}: need {prefix}{IDS_SUFFIX} and {prefix}{IDX_SUFFIX}")
    ids = _load(prefix + IDS_SUFFIX, mmap_mode="r")
    idx = _load(prefix + IDX_SUFFIX)
    if not hasattr(idx, "files"):
        raise ValueError(f"{prefix}{IDX_SUFFIX}: a single array, not an .npz archive of 'lens' and 'docs'")
    with idx:
        if "lens" not in idx:
            raise ValueError(f"{prefix}{IDX_SUFFIX} has no 'lens' array (keys: {sorted(idx.keys())})")
        try:
            lens = np.asarray(idx["lens"])
            docs = np.asarray(idx["docs"]) if "docs" in idx else np.arange(lens.shape[0] + 1, dtype=np.int64)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(
                f"{prefix}{IDX_SUFFIX}: an array cannot be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{prefix}{IDS_SUFFIX}: dtype {ids.dtype}: token ids must be stored as integers")
    if ids.ndim != 1:
        raise ValueError(f"{prefix}{IDS_SUFFIX} is {ids.ndim}-D, expected 1-D")
    total = int(lens.sum(dtype=np.int64))
    if total != ids.shape[0]:
        raise ValueError(f"{prefix}: sum(lens) = {total} but {prefix}{IDS_SUFFIX} holds {ids.shape[0]} tokens")
    if docs.shape[0] < 1 or int(docs[0]) != 0 or int(docs[-1]) != lens.shape[0]:
        raise ValueError(f"{prefix}: docs must run from 0 to num_sentences ({lens.shape[0]})")
    return Corpus(prefix, ids, lens, docs)


def find_prefix(data_dir: str) -> str:
    """The one corpus prefix in ``data_dir`` (e.g. ``<dir>/gpt_en_dataset_300m``): an
    ``_ids.npy``/``_idx.npz`` pair or a ``.bin``/``.idx`` pair."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data.data_dir {data_dir}: no such directory")
    npy = sorted(p[: -len(IDS_SUFFIX)] for p in glob.glob(os.path.join(data_dir, "*" + IDS_SUFFIX)))
    npy = [p for p in npy if os.path.isfile(p + IDX_SUFFIX)]
    mmap = sorted(p[:-4] for p in glob.glob(os.path.join(data_dir, "*.idx")) if os.path.isfile(p[:-4] + ".bin"))
    found = npy + [p for p in mmap if p not in npy]
    lone = lone_halves(data_dir, [(IDS_SUFFIX, IDX_SUFFIX), (".bin", ".idx")])
    if not found and lone:
        raise FileNotFoundError(f"data_dir {data_dir!r} holds no complete corpus: {lone[0]}")
    if not found:
        raise FileNotFoundError(
            f"data_dir {data_dir!r} holds no '<name>{IDS_SUFFIX}' + '<name>{IDX_SUFFIX}' pair "
            "(e.g. gpt_en_dataset_300m_ids.npy / gpt_en_dataset_300m_idx.npz) and no '<name>.bin' + '<name>.idx' pair"
        )
    if len(found) > 1:
        raise ValueError(f"data_dir {data_dir!r} holds several corpora: {[os.path.basename(p) for p in found]}; name one with data.prefix")
    return found[0]


# ---------------------------------------------------------------- synthetic corpus


def synthetic_prefix(cache_dir: str, vocab_size: int, num_tokens: int, seed: int, spec: synthetic.Spec = synthetic.V1) -> str:
    """Prefix of the synthetic corpus in PaddleNLP's format (named after every parameter)."""
    return os.path.join(cache_dir, "paddle_gpt_" + synthetic.corpus_name(vocab_size, num_tokens, seed, spec=spec))


def ensure_synthetic(cache_dir: str, vocab_size: int, num_tokens: int, seed: int, spec: synthetic.Spec = synthetic.V1) -> str:
    """Write the project's synthetic corpus (``training.data.synthetic``: a seeded
    sparse Markov chain whose loss a model can bring far below ln(vocab)) in
    PaddleNLP's format into ``cache_dir`` unless it is there; return its prefix.

    One sentence per document (GPT preprocessing without sentence splitting).
    Safe when several processes race: files are renamed into place, ``_idx.npz`` last.
    """
    prefix = synthetic_prefix(cache_dir, vocab_size, num_tokens, seed, spec)
    if not exists(prefix):
        write_corpus(prefix, synthetic.documents(vocab_size, num_tokens, seed, spec=spec), vocab_size)
    return prefix


def token_windows(corpus: Corpus, seq_length: int, seed: int) -> TokenWindows:
    """Training samples over a corpus: windows of ``seq_length + 1`` tokens in a
    seeded order, the same for every parallel layout (``training.data.indexed``)."""
    return TokenWindows(corpus.ids, seq_length, seed)
