"""PaddleNLP's GPT pretraining corpus format (training.data.paddle_gpt).

The round trip is checked twice: with this project's reader, and with
PaddleNLP's own ``CompatibleIndexedDataset`` inside the paddle environment
(``FB_TEST_PADDLE_PYTHON``; skipped without it), so the files are the format
FlagPerf's ``gpt_en_dataset_300m_ids.npy`` / ``_idx.npz`` are in.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from training.data import paddle_gpt

ROOT = Path(__file__).resolve().parent.parent


def _documents(rng, n=12, vocab=50304):
    """Documents of 1-3 sentences of random length."""
    return [[rng.integers(0, vocab, size=int(rng.integers(1, 200))) for _ in range(int(rng.integers(1, 4)))] for _ in range(n)]


@pytest.mark.parametrize("vocab,dtype", [(50304, np.uint16), (128256, np.int32)])
def test_round_trip(tmp_path, vocab, dtype):
    rng = np.random.default_rng(0)
    docs = _documents(rng, vocab=vocab)
    prefix = str(tmp_path / "gpt_en_dataset_300m")
    paddle_gpt.write_corpus(prefix, docs, vocab)
    assert sorted(os.listdir(tmp_path)) == ["gpt_en_dataset_300m_ids.npy", "gpt_en_dataset_300m_idx.npz"]

    raw_ids = np.load(prefix + "_ids.npy")
    with np.load(prefix + "_idx.npz") as idx:
        assert sorted(idx.keys()) == ["docs", "lens"]
        assert idx["lens"].dtype == np.int32 and idx["docs"].dtype == np.int64
        lens, doc_idx = idx["lens"], idx["docs"]
    assert raw_ids.dtype == dtype and raw_ids.ndim == 1
    sentences = [s for d in docs for s in d]
    assert np.array_equal(raw_ids, np.concatenate(sentences))  # ids: every sentence, back to back
    assert list(lens) == [len(s) for s in sentences]
    assert list(doc_idx) == list(np.cumsum([0] + [len(d) for d in docs]))

    c = paddle_gpt.read_corpus(prefix)
    assert c.num_tokens == sum(len(s) for s in sentences) and c.num_documents == len(docs)
    for d, doc in enumerate(docs):
        got = c.document(d)
        assert len(got) == len(doc) and all(np.array_equal(a, b) for a, b in zip(got, doc))
    assert np.array_equal(c.sentence(3), sentences[3])
    assert paddle_gpt.find_prefix(str(tmp_path)) == prefix


def test_reader_without_docs_and_bad_files(tmp_path):
    prefix = str(tmp_path / "old")
    np.save(prefix + "_ids.npy", np.arange(10, dtype=np.uint16))
    np.savez(prefix + "_idx.npz", lens=np.array([4, 6], dtype=np.int32))  # older files: "lens" only
    c = paddle_gpt.read_corpus(prefix)
    assert list(c.docs) == [0, 1, 2] and c.num_documents == 2

    np.savez(prefix + "_idx.npz", lens=np.array([4, 7], dtype=np.int32))
    with pytest.raises(ValueError, match="sum\\(lens\\) = 11"):
        paddle_gpt.read_corpus(prefix)
    with pytest.raises(FileNotFoundError, match="_ids.npy"):
        paddle_gpt.read_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no '<name>_ids.npy'"):
        paddle_gpt.find_prefix(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        paddle_gpt.find_prefix(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="out of range"):
        paddle_gpt.write_corpus(str(tmp_path / "x"), [np.array([5, 70000])], 50304)


def test_synthetic_corpus_is_deterministic_and_learnable(tmp_path):
    a = paddle_gpt.ensure_synthetic(str(tmp_path / "a"), 1024, 1 << 16, 7)
    b = paddle_gpt.ensure_synthetic(str(tmp_path / "b"), 1024, 1 << 16, 7)
    ca, cb = paddle_gpt.read_corpus(a), paddle_gpt.read_corpus(b)
    assert np.array_equal(np.asarray(ca.ids), np.asarray(cb.ids)) and ca.num_tokens == 1 << 16
    assert ca.ids.dtype == np.uint16 and list(ca.docs) == list(range(ca.num_documents + 1))
    # a sparse Markov chain: the next-token entropy is far below ln(vocab)
    ids = np.asarray(ca.ids, dtype=np.int64)
    pairs = ids[:-1] * 1024 + ids[1:]
    _, pair_counts = np.unique(pairs, return_counts=True)
    _, prev_counts = np.unique(ids[:-1], return_counts=True)
    h_cond = -(pair_counts * np.log(pair_counts)).sum() / pairs.size + (prev_counts * np.log(prev_counts)).sum() / pairs.size
    assert h_cond < 0.5 * np.log(1024)
    # windows of seq + 1 tokens, the same order for every reader
    w1 = paddle_gpt.token_windows(ca, 128, 1234).batch(0, 4)
    w2 = paddle_gpt.token_windows(cb, 128, 1234).batch(0, 4)
    assert w1.shape == (4, 129) and np.array_equal(w1, w2)


@pytest.mark.framework("paddle")
def test_paddlenlp_reads_our_files(tmp_path):
    py = os.environ.get("FB_TEST_PADDLE_PYTHON")
    if not py:
        pytest.skip("FB_TEST_PADDLE_PYTHON is not set: no paddle environment to read the files with PaddleNLP")
    rng = np.random.default_rng(1)
    docs = _documents(rng)
    prefix = str(tmp_path / "corpus")
    paddle_gpt.write_corpus(prefix, docs, 50304)
    script = textwrap.dedent(
        f"""
        import json
        from paddlenlp.data.indexed_dataset import CompatibleIndexedDataset, make_dataset
        ds = make_dataset({prefix!r}, "mmap")
        assert isinstance(ds, CompatibleIndexedDataset), type(ds)
        print("RESULT", json.dumps({{"sentences": [ds[i].tolist() for i in range(len(ds))],
                                    "doc_idx": [int(x) for x in ds.doc_idx]}}))
        """
    )
    out = subprocess.run([py, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    sentences = [s.tolist() for d in docs for s in d]
    assert got["sentences"] == sentences
    assert got["doc_idx"] == [int(x) for x in np.cumsum([0] + [len(d) for d in docs])]
