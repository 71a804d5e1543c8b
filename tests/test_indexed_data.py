"""Megatron's indexed dataset format and the synthetic corpus (training.data)."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import textwrap

import pytest

np = pytest.importorskip("numpy")

from training.data import synthetic
from training.data.indexed import (
    INDEX_HEADER,
    IndexedReader,
    IndexedWriter,
    TokenWindows,
    bin_path,
    idx_path,
    write_indexed,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs(rng, n=20, vocab=50000):
    return [rng.integers(0, vocab, size=int(rng.integers(1, 300))) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = _docs(rng)
    prefix = str(tmp_path / "corpus")
    write_indexed(prefix, docs, dtype)
    r = IndexedReader(prefix)
    assert r.dtype == np.dtype(dtype)
    assert len(r) == len(docs) and r.document_count == len(docs) + 1
    assert list(r.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert np.array_equal(r[i], d)
        assert np.array_equal(r.get(i, offset=0, length=min(3, len(d))), d[:3])
    assert np.array_equal(np.asarray(r.tokens), np.concatenate(docs))
    with open(idx_path(prefix), "rb") as fh:
        assert fh.read(len(INDEX_HEADER)) == b"MMIDIDX\x00\x00"


def test_multi_sequence_documents(tmp_path):
    prefix = str(tmp_path / "c")
    with IndexedWriter(prefix, np.uint16) as w:
        w.add_sequence([1, 2, 3])
        w.add_sequence([4])
        w.end_document()
        w.add_sequence([5, 6])
        w.end_document()
    r = IndexedReader(prefix)
    assert list(r.sequence_lengths) == [3, 1, 2]
    assert list(r.sequence_pointers) == [0, 6, 8]  # bytes, uint16
    assert list(r.document_indices) == [0, 2, 3]


def test_reader_rejects_bad_files(tmp_path):
    prefix = str(tmp_path / "bad")
    write_indexed(prefix, [[1, 2, 3]], np.int32)
    with open(bin_path(prefix), "ab") as fh:
        fh.write(b"\0\0\0\0")
    with pytest.raises(ValueError, match=r"bad\.bin: 16 bytes, the index bad\.idx describes 12 \(longer than its index\)"):
        IndexedReader(prefix)
    with open(idx_path(prefix), "r+b") as fh:
        fh.write(b"NOTIDX")
    with pytest.raises(ValueError, match="bad magic"):
        IndexedReader(prefix)
    with pytest.raises(ValueError, match="out of range"):
        write_indexed(str(tmp_path / "big"), [[70000]], np.uint16)


def test_token_windows_are_contiguous_and_seeded():
    tokens = np.arange(1000, dtype=np.int32)
    w = TokenWindows(tokens, seq_length=16, seed=7)
    assert w.num_windows == (1000 - 1) // 16
    seen = set()
    for k in range(w.num_windows):
        x = w.window(k)
        assert len(x) == 17 and np.array_equal(x, np.arange(x[0], x[0] + 17))
        assert x[0] % 16 == 0
        seen.add(int(x[0]))
    assert len(seen) == w.num_windows  # one epoch visits every window once
    again = TokenWindows(tokens, seq_length=16, seed=7)
    assert np.array_equal(again.batch(0, 200), w.batch(0, 200))  # crosses into epoch 2
    other = TokenWindows(tokens, seq_length=16, seed=8)
    assert not np.array_equal(other.batch(0, 10), w.batch(0, 10))
    assert not np.array_equal(w.batch(0, w.num_windows)[:, 0], w.batch(w.num_windows, w.num_windows)[:, 0])


def test_synthetic_corpus_is_deterministic(tmp_path):
    a = synthetic.ensure_corpus(str(tmp_path / "a"), vocab_size=1024, num_tokens=50_000, seed=1234)
    b = synthetic.ensure_corpus(str(tmp_path / "b"), vocab_size=1024, num_tokens=50_000, seed=1234)
    c = synthetic.ensure_corpus(str(tmp_path / "c"), vocab_size=1024, num_tokens=50_000, seed=1235)
    assert os.path.basename(a) == os.path.basename(b)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(a + ext, b + ext, shallow=False)
    assert not filecmp.cmp(a + ".bin", c + ".bin", shallow=False)  # same lengths, other tokens
    r = IndexedReader(a)
    assert r.num_tokens == 50_000 and r.dtype == np.uint16
    toks = np.asarray(r.tokens).astype(np.int64)
    assert toks.min() >= 0 and toks.max() < 1024
    # a sparse Markov chain: inside a document each token has at most 4 distinct successors
    nxt: dict[int, set[int]] = {}
    for i in range(len(r)):
        doc = r[i].astype(np.int64)
        for x, y in zip(doc[:-1], doc[1:]):
            nxt.setdefault(int(x), set()).add(int(y))
    assert max(len(v) for v in nxt.values()) <= 4
    assert len(set(toks.tolist())) > 100  # many different tokens occur
    assert not any(p.name.startswith(os.path.basename(a) + ".tmp") for p in (tmp_path / "a").iterdir())
    # large vocabularies are stored as int32
    big = synthetic.ensure_corpus(str(tmp_path / "big"), vocab_size=128256, num_tokens=5000, seed=1)
    assert IndexedReader(big).dtype == np.int32


SETS = {"version": 2, "set_prob": 0.8, "set_size": 4, "alphabet": 16, "span": 256}


def test_version_2_mixes_in_sets_only_attention_can_see(tmp_path):
    """Version 2: in each span of 256 tokens, about 80 % of next tokens come from that span's set of
    4 ids (of a 16-id alphabet), so the ids seen earlier in a span predict the next one; the
    parameters are in the file name and the fingerprint; version 1 is unchanged by them."""
    from training.data import corpus_spec

    spec = synthetic.read_spec(SETS)
    a = synthetic.ensure_corpus(str(tmp_path / "a"), 1024, 50_000, 1234, spec=spec)
    b = synthetic.ensure_corpus(str(tmp_path / "b"), 1024, 50_000, 1234, spec=spec)
    assert os.path.basename(a) == "synthetic_v2_V1024_N50000_S1234_D1024_B4_P0.8_K4_A16_L256"
    assert filecmp.cmp(a + ".bin", b + ".bin", shallow=False)
    rows = synthetic.markov_tokens(1024, 50_000, 1234, spec=spec)
    alphabet = set(np.unique(rows).tolist())
    counts = np.bincount(rows.ravel(), minlength=1024)
    top = set(np.argsort(counts)[-16:].tolist())  # the alphabet's ids are the most frequent by far
    assert counts[sorted(top)].sum() > 0.75 * rows.size and len(alphabet) > 100
    for span in rows[:, 256:512]:  # each span's set ids: at most 4 of the alphabet carry most of it
        ids, n = np.unique(span, return_counts=True)
        assert np.sort(n)[-4:].sum() > 0.7 * len(span) and set(ids[np.argsort(n)[-4:]].tolist()) <= top
    assert np.array_equal(synthetic.markov_tokens(1024, 50_000, 1234), synthetic.markov_tokens(1024, 50_000, 1234, spec=synthetic.V1))
    assert corpus_spec.fingerprint(synthetic.V1) == "synthetic"
    assert corpus_spec.fingerprint(spec).startswith("synthetic-v2-")
    assert corpus_spec.fingerprint(spec) != corpus_spec.fingerprint(synthetic.read_spec({**SETS, "set_prob": 0.7}))
    for bad, says in (
        ({"version": 3}, "version: 1 or 2"),
        ({"version": 2, "set_prob": 0.8}, "version 2 needs set_size, alphabet, span"),
        ({**SETS, "set_prob": 1.5}, "set_prob: between 0 and 1"),
        ({**SETS, "set_size": 20}, "set_size 20 must be from 1 to alphabet 16"),
        ({**SETS, "spam": 1}, "unknown key 'spam'"),
        ({"version": 1, "span": 3}, r"version 1 \(the Markov chain alone\) takes no other key"),
        ("v2", "a mapping with version"),
    ):
        with pytest.raises(ValueError, match=says):
            synthetic.read_spec(bad)


@pytest.mark.e2e  # megatron-core reads the files in its environment
def test_megatron_reads_our_files(tmp_path):
    """megatron.core's own IndexedDataset reads what the writer wrote."""
    py = os.environ.get("FB_TEST_MEGATRON_PYTHON")
    if not py:
        pytest.skip("FB_TEST_MEGATRON_PYTHON is not set: no megatron-core environment to read the files with")
    rng = np.random.default_rng(3)
    docs = _docs(rng, n=12, vocab=128256)
    p32 = str(tmp_path / "i32")
    write_indexed(p32, docs, np.int32)
    p16 = synthetic.ensure_corpus(str(tmp_path / "syn"), vocab_size=1024, num_tokens=20_000, seed=5)
    script = textwrap.dedent(
        """
        import json, sys
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        out = {}
        for prefix in sys.argv[1:]:
            ds = IndexedDataset(prefix)
            out[prefix] = {"n": len(ds), "docs": [int(x) for x in ds.document_indices],
                           "seqs": [ds[i].tolist() for i in range(len(ds))], "dtype": str(ds[0].dtype)}
        print(json.dumps(out))
        """
    )
    proc = subprocess.run([py, "-c", script, p32, p16], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got[p32]["n"] == len(docs) and got[p32]["dtype"] == "int32"
    assert got[p32]["docs"] == list(range(len(docs) + 1))
    assert all(g == d.tolist() for g, d in zip(got[p32]["seqs"], docs))
    r16 = IndexedReader(p16)
    assert got[p16]["dtype"] == "uint16" and got[p16]["n"] == len(r16)
    assert all(got[p16]["seqs"][i] == r16[i].tolist() for i in range(len(r16)))
