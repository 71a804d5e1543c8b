"""Data and settings of cases/baichuan2/deepspeed (numpy and the standard library only)."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

from training.data.indexed import write_indexed
from training.data.synthetic import corpus_name
from training.settings import SettingsError

CASE_DIR = Path(__file__).resolve().parent.parent / "cases" / "baichuan2" / "deepspeed"


data_mod = importlib.import_module("cases.baichuan2.deepspeed.data")
settings_mod = importlib.import_module("cases.baichuan2.deepspeed.settings")


def _corpus(tmp: Path, name: str = "owt_text_document", n_docs: int = 20, doc_len: int = 50, vocab: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, doc_len) for _ in range(n_docs)]
    write_indexed(str(tmp / name), docs, dtype=np.int32)
    return np.concatenate(docs)


def _data(d: dict, **kw):
    args = dict(seq_length=16, vocab_size=1000, global_batch=8, micro_batch=2, seed=1, dp_rank=0, dp_size=2)
    args.update(kw)
    return data_mod.CaseData(d, **args)


def test_real_corpus_found_and_windows_are_contiguous(tmp_path):
    tokens = _corpus(tmp_path)
    cd = _data({"data_dir": str(tmp_path)})
    assert cd.source == "indexed" and cd.prefix.endswith("owt_text_document")
    assert cd.num_tokens == tokens.size and cd.grad_accum == 2
    inp, lab = cd.micro_batch_tensors(0, 0) if _has_torch() else (None, None)
    batch = cd.micro_batch_tokens(0, 0)
    assert batch.shape == (2, 17) and batch.dtype == np.int64
    for row in batch:  # a window of the token stream
        start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 17) == row, axis=1))[0])
        assert np.array_equal(tokens[start : start + 17], row)
    if inp is not None:
        assert inp.shape == lab.shape == (2, 16) and (inp[:, 1:] == lab[:, :-1]).all()


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def test_max_tokens_keeps_the_head(tmp_path):
    _corpus(tmp_path)
    cd = _data({"data_dir": str(tmp_path), "max_tokens": 100})
    assert cd.num_tokens == 100


def test_prefix_is_needed_when_several_corpora(tmp_path):
    _corpus(tmp_path, "a")
    _corpus(tmp_path, "b")
    with pytest.raises(FileNotFoundError, match="name one with data.prefix"):
        _data({"data_dir": str(tmp_path)})
    assert _data({"data_dir": str(tmp_path), "prefix": "b"}).prefix == str(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match=r"data.prefix .c.: .*c\.idx does not exist"):
        _data({"data_dir": str(tmp_path), "prefix": "c"})


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    _corpus(tmp_path, vocab=5000)
    cd = _data({"data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        for step in range(5):
            for m in range(2):
                cd.micro_batch_tokens(step, m)


def test_samples_of_a_step_do_not_depend_on_the_layout(tmp_path):
    _corpus(tmp_path, n_docs=40)
    d = {"data_dir": str(tmp_path)}

    def step_samples(step, dp, micro):
        out = []
        for r in range(dp):
            cd = _data(d, dp_rank=r, dp_size=dp, micro_batch=micro)
            for m in range(cd.grad_accum):
                out += [tuple(x) for x in cd.micro_batch_tokens(step, m)]
        return sorted(out)

    for step in (0, 3):
        assert step_samples(step, 1, 8) == step_samples(step, 2, 2) == step_samples(step, 4, 1)


def test_synthetic_corpus_written_to_cache_dir(tmp_path):
    d = {"data_dir": None, "cache_dir": str(tmp_path / "cache"), "synthetic_tokens": 4096}
    cd = _data(d, vocab_size=300)
    assert cd.source == "synthetic" and cd.num_tokens == 4096
    assert cd.prefix == str(tmp_path / "cache" / corpus_name(300, 4096, 1))
    other = _data(d, vocab_size=300, dp_rank=1, local_rank=1)  # another rank waits for and reads the same files
    assert other.prefix == cd.prefix and other.num_tokens == 4096
    assert cd.micro_batch_tokens(0, 0).max() < 300


def test_shape_flat_or_nested_and_checked():
    flat = {
        "name": "m",
        "params_nominal": 1.0,
        "num_layers": 2,
        "hidden_size": 160,
        "ffn_hidden_size": 432,
        "num_heads": 10,
        "seq_length": 128,
        "vocab_size": 2048,
        "position_embedding": "alibi",
        "output_layer": "normhead",
    }
    s = settings_mod.shape({"model": flat})
    assert s["max_position_embeddings"] == 128 and s["norm_eps"] == 1e-5  # the schema's defaults, not the case's
    assert settings_mod.shape({"model": {"shape": flat}}) == s
    with pytest.raises(SettingsError, match="model.shape.vocab_size"):
        settings_mod.shape({"model": {k: v for k, v in flat.items() if k != "vocab_size"}})
    with pytest.raises(SettingsError, match="not a multiple of num_heads"):
        settings_mod.shape({"model": {**flat, "num_heads": 7}})
    with pytest.raises(SettingsError, match="exceeds max_position_embeddings 64"):
        settings_mod.shape({"model": {**flat, "max_position_embeddings": 64}})
    with pytest.raises(SettingsError, match="position_embedding is 'rope', Baichuan2 has 'alibi'"):
        settings_mod.shape({"model": {k: v for k, v in flat.items() if k != "position_embedding"}})
    with pytest.raises(SettingsError, match="num_kv_groups is 5"):
        settings_mod.shape({"model": {**flat, "num_kv_groups": 5}})
    assert settings_mod.model_name({"case": {"model": "x"}, "model": flat}) == "x"
