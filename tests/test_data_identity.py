"""Data that keeps its identity (run_benchmarks/planning/datacheck.py): fingerprints that see a tokenizer's
content, the images' bytes and a blend's normalized weights; references of other data refused by
--judge and by a live run before anything starts; LLaVA images decoded before launch; the data
readers' messages for a short corpus, a garbage .npy, half a corpus pair, a data dir that is a file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from run_benchmarks.errors import InputError
from run_benchmarks.judging import recording
from run_benchmarks.planning import datacheck, references
from run_benchmarks.planning.registry import ROOT
from tests.test_results_models import fake_phase, fake_run
from training.data import corpus, llava_images, paddle_gpt
from training.data.indexed import write_indexed

START = str(ROOT / "run_benchmarks" / "start_task.py")
SHAPE = {"vocab_size": 1024, "seq_length": 128, "image_token_index": 1000}


def start(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, START, *args], capture_output=True, text=True, timeout=300)


def corpora(d: Path, names: dict[str, int], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for name, n in names.items():
        write_indexed(str(d / name), [rng.integers(0, 1000, n, dtype=np.int32)])


# --------------------------------------------------------------------------- fingerprints


def test_a_blend_is_fingerprinted_normalized_and_megatrons_unweighted_form_is_equal_weights(tmp_path):
    corpora(tmp_path, {"a": 3000, "b": 4000})

    def ident(prefix: str) -> dict:
        out = datacheck.check_megatron({"data_dir": str(tmp_path), "prefix": prefix}, SHAPE, "m", "train")
        return {**out, "fingerprint": datacheck.fingerprint(out)}

    assert ident("0.3 a 0.7 b")["fingerprint"] == ident("3 a 7 b")["fingerprint"] != ident("0.7 a 0.3 b")["fingerprint"]
    even = ident("a b")
    assert [c["weight"] for c in even["corpora"]] == [0.5, 0.5] and even["fingerprint"] == ident("1 a 1 b")["fingerprint"]
    assert corpus.parse_blend("a b") == [(1.0, "a"), (1.0, "b")]
    assert ident("a")["corpora"][0]["weight"] == 1.0  # one corpus: as before, so its fingerprint stays


def llava(root: Path, n: int = 6) -> dict:
    """A LLaVA phase (JSON, images written by Pillow, a tokenizer.json of 40 ids) and its settings."""
    (root / "img").mkdir(parents=True)
    recs = []
    for i in range(n):
        name = f"{i:03d}.png" if i % 2 else f"{i:03d}.jpg"
        Image.fromarray(np.full((8, 8, 3), 20 * i, dtype=np.uint8)).save(root / "img" / name)
        recs.append(
            {"id": f"r{i}", "image": name, "conversations": [{"from": "human", "value": "<image>\nx"}, {"from": "gpt", "value": "y"}]}
        )
    (root / "data.json").write_text(json.dumps(recs))
    tok = root / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"w{i}": i for i in range(40)}}, "added_tokens": []}))
    return {"data_dir": str(root), "json": "data.json", "image_folder": "img", "tokenizer_path": str(tok)}


def llava_fp(d: dict) -> str:
    return datacheck.fingerprint(datacheck.check_llava(d, SHAPE, "llava_tiny", "pretrain"))


def test_the_llava_fingerprint_sees_the_tokenizers_content_and_the_images_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGBENCH_CACHE_DIR", str(tmp_path / "cache"))
    d = llava(tmp_path / "a")
    first = llava_fp(d)
    assert llava_fp(d) == first
    tok = Path(d["tokenizer_path"]) / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"vocab": {f"v{i}": i for i in range(40)}}, "added_tokens": []}))  # same size
    other_tok = llava_fp(d)
    assert other_tok != first
    Image.fromarray(np.full((8, 8, 3), 255, dtype=np.uint8)).save(Path(d["data_dir"]) / "img" / "001.png")  # same name
    assert llava_fp(d) not in (first, other_tok)


def test_corrupt_images_are_named_with_their_entry_and_verdicts_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGBENCH_CACHE_DIR", str(tmp_path / "cache"))
    d = llava(tmp_path / "a")
    img = Path(d["data_dir"]) / "img"
    calls = []
    real = llava_images.inspect
    monkeypatch.setattr(llava_images, "inspect", lambda p, *a: calls.append(p) or real(p, *a))
    llava_fp(d)
    assert len(calls) == 6
    llava_fp(d)
    assert len(calls) == 6  # same size and mtime: from the cache
    png = (img / "003.png").read_bytes()
    (img / "003.png").write_bytes(png[:-20] + bytes([png[-20] ^ 0xFF]) + png[-19:])  # a byte of its pixels changed: bad CRC
    with pytest.raises(InputError) as exc:
        llava_fp(d)
    assert str(exc.value).startswith(f"{img / '003.png'}: corrupt image (")
    assert str(exc.value).endswith(f"image of entry 3 (id 'r3') of {Path(d['data_dir']) / 'data.json'} (phase pretrain)")
    (img / "003.png").write_bytes(png)
    (img / "004.jpg").write_bytes(os.urandom(500))  # random bytes
    (img / "001.png").write_bytes(os.urandom(500))
    with pytest.raises(
        InputError, match=r"001\.png: not an image Pillow can read: image of entry 1 \(id 'r1'\) .*; 2 of the 6 images are bad$"
    ):
        llava_fp(d)


def test_a_bad_finetune_image_is_refused_before_launch(tmp_path, deepspeed_python):
    from tests.test_data_formats import llava_data

    data, tok = tmp_path / "data", tmp_path / "tok"
    llava_data(deepspeed_python, data, tok)
    fine = json.loads((data / "llava_v1_5_mix665k.json").read_text())
    path = next(data / r["image"] for r in fine if "image" in r and (data / r["image"]).is_file())  # image_folder: data_dir
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    logs = tmp_path / "logs"
    proc = start(
        *("--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2", "--log-dir", str(logs), "--data-dir", str(data)),
        *("--set", "data.missing_images=skip", "--set", f"data.tokenizer_path={tok}"),
    )
    assert proc.returncode == 2 and not logs.exists(), proc.stderr
    assert f"{path.name}: " in proc.stderr and "(phase finetune)" in proc.stderr


# --------------------------------------------------------------------------- references of other data


def run_file(path: Path, fp: str | None, tps: float = 1000.0) -> Path:
    run = fake_run([{"status": "ok", "phases": [fake_phase("train", tps=tps)]}])
    data = None if fp is None else {"train": {"kind": "real", "format": "megatron", "checked": True, "fingerprint": fp}}
    path.write_text(json.dumps(run.model_copy(update={"data": data}).dump()))
    return path


def test_judge_refuses_a_reference_of_other_data_naming_both(tmp_path):
    real = run_file(tmp_path / "real.json", "0123456789abcdef")
    synthetic = run_file(tmp_path / "synth.json", None)
    with pytest.raises(InputError) as exc:
        recording.judge_again([real], [synthetic])
    msg = str(exc.value)
    assert f"--reference {synthetic}: made on other data (fingerprint synthetic)" in msg and "(fingerprint 0123456789abcdef)" in msg
    assert "no committed reference for this data" in msg
    proc = start("--judge", str(synthetic), "--reference", str(real))
    assert proc.returncode == 2 and "(fingerprint 0123456789abcdef) than the run's phase train (fingerprint synthetic)" in proc.stderr
    assert "the committed reference for this data is cases/llama3/megatron/reference/llama3_tiny/" in proc.stderr
    assert recording.judge_again([synthetic], [run_file(tmp_path / "s2.json", None)])  # same data: judged


def test_judge_refuses_to_judge_data_without_a_fingerprint(tmp_path):
    """Data of a run made before data on the hosts was fingerprinted there (or under a backend that
    takes none) has no fingerprint: no reference judges it, rather than any."""
    run = fake_run([{"status": "ok", "phases": [fake_phase("train")]}])
    why = "data_dir is not on this machine, and the slurm backend takes no fingerprint on its hosts"
    data = {"train": {"kind": "real", "checked": False, "dir": "/local/wudao", "fingerprint": None, "reason": why}}
    (tmp_path / "hosts.json").write_text(json.dumps(run.model_copy(update={"data": data}).dump()))
    ref = run_file(tmp_path / "ref.json", None)
    proc = start("--judge", str(tmp_path / "hosts.json"), "--reference", str(ref))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: --reference {ref}: the run's phase train read data without a fingerprint ({why}): no reference can judge it"
    ), proc.stderr


def test_a_live_run_given_a_reference_of_other_data_is_refused_before_anything_runs(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    corpora(data, {"my-corpus_text_document": 60_000})
    logs = tmp_path / "logs"
    ref = run_file(tmp_path / "synth.json", None)
    proc = start(
        *("--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--log-dir", str(logs)),
        *("--data-dir", str(data), "--reference", str(ref)),
    )
    assert proc.returncode == 2 and not logs.exists(), proc.stderr
    assert f"error: --reference {ref}: made on other data (fingerprint synthetic) than the run's phase train (fingerprint " in proc.stderr
    plan = SimpleNamespace(data={"train": {"fingerprint": "synthetic"}}, reference=[ref], case=SimpleNamespace(model="llama3_tiny"))
    assert references.same_data(plan, "train", SimpleNamespace(path=str(ref))) is not None


# --------------------------------------------------------------------------- messages


def test_one_window_of_seq_plus_one_tokens_is_enough(tmp_path):
    corpora(tmp_path, {"c": 129})
    ident = datacheck.check_megatron({"data_dir": str(tmp_path)}, SHAPE, "m", "train")
    assert ident["corpora"][0]["tokens"] == 129
    corpora(tmp_path, {"c": 128})
    with pytest.raises(InputError) as exc:
        datacheck.check_megatron({"data_dir": str(tmp_path)}, SHAPE, "m", "train")
    assert str(exc.value) == f"{tmp_path / 'c.bin'}: 128 tokens, fewer than the 129 of one sample (seq_length 128 + 1)"


def test_a_garbage_npy_and_half_a_corpus_pair_are_named(tmp_path):
    (tmp_path / "g_ids.npy").write_bytes(b"garbage!" * 64)
    with pytest.raises(ValueError, match=r"g_ids\.npy: not a readable numpy \.npy array \(bad magic b'garbag'"):
        paddle_gpt._load(str(tmp_path / "g_ids.npy"))
    lone = tmp_path / "lone"
    lone.mkdir()
    corpora(lone, {"c": 500})
    (lone / "c.idx").unlink()
    with pytest.raises(FileNotFoundError) as exc:
        corpus.megatron_prefixes(str(lone), None)
    assert str(exc.value).endswith(f"{lone / 'c.bin'} has no c.idx beside it") and "data.prefix" not in str(exc.value)
    with pytest.raises(FileNotFoundError, match="c.bin has no c.idx beside it"):
        paddle_gpt.find_prefix(str(lone))
    shutil.move(lone / "c.bin", lone / "d.idx")
    with pytest.raises(FileNotFoundError, match="d.idx has no d.bin beside it"):
        corpus.megatron_prefixes(str(lone), None)


def test_data_dir_a_file_and_tokenizer_path_a_data_location(tmp_path):
    f = tmp_path / "corpus.bin"
    f.write_bytes(b"x")
    proc = start("--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--data-dir", str(f), "--dry-run")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --data-dir {f}: a file, not a folder (the folder that holds the data)"
    proc = start(
        "--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2", "--set", f"data.tokenizer_path={tmp_path}", "--dry-run", "--json"
    )
    assert proc.returncode == 2 and "data.tokenizer_path: read from real data only" in proc.stderr  # not dropped in silence
    proc = start(
        "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--set", f"data.data_dir={tmp_path}", "--dry-run", "--json"
    )
    assert proc.returncode == 2 and f"data.data_dir {tmp_path} holds no Megatron corpus" in proc.stderr  # read, not a user override
    assert datacheck.is_data_location("data.phases.finetune.data_dir") and not datacheck.is_data_location("train.steps")


def test_a_large_image_set_shows_a_progress_bar(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FLAGBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FORCE_COLOR", "1")  # stderr counts as a terminal
    d = llava(tmp_path / "a")
    monkeypatch.setattr(datacheck, "PROGRESS_FROM", 6)  # six images: the bar
    llava_fp(d)
    assert "checking the pretrain images" in capfd.readouterr().err
    monkeypatch.setattr(datacheck, "PROGRESS_FROM", 7)  # a smaller set: no bar
    llava_fp(d)
    assert "checking" not in capfd.readouterr().err


def test_judge_exits_as_a_run_does(tmp_path):
    """``--judge``: 0 when every phase it judged is aligned, 1 when one is not aligned or not
    judged, 2 for bad input; the same with ``--update``."""
    ref = run_file(tmp_path / "ref.json", None)
    same = run_file(tmp_path / "same.json", None)
    run = fake_run([{"status": "ok", "phases": [fake_phase("train", loss_scale=1.3)]}])
    off = tmp_path / "off.json"
    off.write_text(json.dumps(run.dump()))
    short = fake_run([{"status": "ok", "phases": [fake_phase("train", steps=12)]}])
    shortf = tmp_path / "short.json"
    shortf.write_text(json.dumps(short.dump()))
    assert start("--judge", str(same), "--reference", str(ref)).returncode == 0
    proc = start("--judge", str(off), "--reference", str(ref))
    assert proc.returncode == 1 and "not aligned" in proc.stdout, proc.stdout + proc.stderr
    proc = start("--judge", str(shortf), "--reference", str(ref))
    assert proc.returncode == 1 and "not judged" in proc.stdout, proc.stdout + proc.stderr
    assert start("--judge", str(same), "--reference", str(tmp_path / "missing.json")).returncode == 2
    assert start("--judge", str(same), "--reference", str(ref), "--update").returncode == 0
    assert start("--judge", str(off), "--reference", str(ref), "--update").returncode == 1
