"""Pre-launch data checks (run_benchmarks/planning/datacheck.py): each corruption a user meets is exit 2
before anything starts, one line naming the file and the problem; the ranks' readers name the
file too when they meet one.

The corpora are written by Megatron's IndexedDatasetBuilder, PaddleNLP's layout and LLaVA JSON
(tests/test_data_formats.py's writers, in the framework environments), then damaged here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from run_benchmarks.planning.registry import ROOT
from tests.test_data_formats import PADDLE_WRITER, framework_run, llava_data, megatron_corpora
from training.data import corpus, paddle_gpt
from training.data.indexed import IndexedReader, write_indexed

START = str(ROOT / "run_benchmarks" / "start_task.py")


def start(case: str, log_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """A real start (not a dry run): the check must stop it before the run folder exists."""
    return subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", case, "--log-dir", str(log_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def refused(proc: subprocess.CompletedProcess, log_dir: Path) -> str:
    """The one error line of a run refused before launch."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not log_dir.exists()  # no run folder: nothing started
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0][len("error: ") :]


@pytest.fixture(scope="module")
def megatron_corpus(tmp_path_factory, megatron_python) -> Path:
    """A uint16 corpus in Megatron's format, written by Megatron's builder."""
    d = tmp_path_factory.mktemp("megatron")
    megatron_corpora(
        megatron_python, [{"prefix": str(d / "c_text_document"), "dtype": "uint16", "vocab": 1024, "tokens": 30_000, "seed": 4}]
    )
    return d / "c_text_document"


def _copy(src: Path, dst_dir: Path, name: str = "c_text_document") -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(str(src) + ext, dst_dir / (name + ext))
    return dst_dir / name


LLAMA = "llama3_tiny:megatron:cpu:1:1"


@pytest.mark.framework("megatron")
def test_megatron_corruptions_are_refused_before_launch(megatron_corpus, tmp_path):
    logs = tmp_path / "logs"
    # a truncated .idx: the header promises more than the file holds
    p = _copy(megatron_corpus, tmp_path / "short_idx")
    raw = Path(str(p) + ".idx").read_bytes()
    Path(str(p) + ".idx").write_bytes(raw[:-100])
    msg = refused(start(LLAMA, logs, "--data-dir", str(p.parent)), logs)
    assert msg.startswith(f"{p}.idx: truncated: {len(raw) - 100} bytes, its header describes ")
    # a truncated .bin
    p = _copy(megatron_corpus, tmp_path / "short_bin")
    size = Path(str(p) + ".bin").stat().st_size
    with open(str(p) + ".bin", "r+b") as fh:
        fh.truncate(size - 10)
    assert refused(start(LLAMA, logs, "--data-dir", str(p.parent)), logs) == (
        f"{p}.bin: {size - 10} bytes, the index c_text_document.idx describes {size} (truncated)"
    )
    # float32 token ids
    d = tmp_path / "float"
    d.mkdir()
    write_indexed(str(d / "f"), [np.arange(500, dtype=np.float32)], np.float32)
    assert refused(start(LLAMA, logs, "--data-dir", str(d)), logs) == (
        f"{d / 'f'}.idx: dtype float32 (code 7): token ids must be stored as integers"
    )
    # an id outside the vocabulary far into the corpus (the first sample is fine)
    d = tmp_path / "vocab"
    d.mkdir()
    tokens = np.asarray(IndexedReader(str(megatron_corpus)).tokens).copy()
    tokens[25_000] = 1024
    write_indexed(str(d / "v"), [tokens], np.uint16)
    assert refused(start(LLAMA, logs, "--data-dir", str(d)), logs) == (
        f"{d / 'v'}.bin: token id 1024 at position 25,000 is outside the model's vocabulary [0, 1024) "
        "(model.vocab_size of llama3_tiny; largest id in the file 1024)"
    )
    # the prefix: none there, the wrong one named, a blend that does not parse
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "set data.prefix to the corpus's prefix" in refused(start(LLAMA, logs, "--data-dir", str(empty)), logs)
    good = _copy(megatron_corpus, tmp_path / "good")
    msg = refused(start(LLAMA, logs, "--data-dir", str(good.parent), "--set", "data.prefix=wudao_llama3bpe_content_document"), logs)
    assert msg == (
        f"data.prefix 'wudao_llama3bpe_content_document': {good.parent / 'wudao_llama3bpe_content_document'}.idx "
        f"does not exist (data.data_dir {good.parent}; corpora there: c_text_document)"
    )
    msg = refused(start(LLAMA, logs, "--data-dir", str(good.parent), "--set", "data.prefix=0.5 c_text_document 0.5"), logs)
    assert msg.startswith("data.prefix '0.5 c_text_document 0.5': a blend is 'weight prefix weight prefix ...'")
    # the good copy passes, and says what it read
    ok = subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", LLAMA, "--data-dir", str(good.parent), "--dry-run", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    ident = json.loads(ok.stdout)["data"]["train"]
    assert ident["corpora"][0]["tokens"] == 30_000 and ident["checked"] is True
    # the same corpus elsewhere has the same fingerprint; other tokens do not
    again = json.loads(
        subprocess.run(
            [
                sys.executable,
                START,
                "--vendor",
                "cpu",
                "--case_name",
                LLAMA,
                "--data-dir",
                str(_copy(megatron_corpus, tmp_path / "again").parent),
                "--dry-run",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )["data"]["train"]
    assert again["fingerprint"] == ident["fingerprint"]


def test_runtime_readers_name_the_file(tmp_path):
    """What the ranks meet when data changes after the check: the file named, no bare numpy error."""
    p = str(tmp_path / "c")
    write_indexed(p, [np.arange(100)], np.int32)
    raw = Path(p + ".idx").read_bytes()
    Path(p + ".idx").write_bytes(raw[:20])
    with pytest.raises(ValueError, match=rf"^{p}\.idx: truncated: 20 bytes, shorter than the 34-byte header$"):
        IndexedReader(p)
    Path(p + ".idx").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match=rf"^{p}\.idx: truncated: {len(raw) - 4} bytes"):
        IndexedReader(p)
    # PaddleNLP's pair: garbage, truncated, pickled
    q = str(tmp_path / "g")
    paddle_gpt.write_corpus(q, [np.arange(50)], 1024)
    ids = Path(q + "_ids.npy").read_bytes()
    Path(q + "_ids.npy").write_bytes(ids[:-20])
    with pytest.raises(ValueError, match=rf"^{q}_ids\.npy: not a readable numpy \.npy array"):
        paddle_gpt.read_tokens(q)
    Path(q + "_ids.npy").write_bytes(b"garbage, not numpy")
    with pytest.raises(ValueError, match=rf"^{q}_ids\.npy: not a readable numpy \.npy array"):
        paddle_gpt.read_tokens(q)
    np.save(q + "_ids.npy", np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match=rf"^{q}_ids\.npy: .*holds Python objects \(a pickled array\), not token ids"):
        paddle_gpt.read_tokens(q)
    np.save(q + "_ids.npy", np.arange(50, dtype=np.uint16))
    npz = Path(q + "_idx.npz").read_bytes()
    Path(q + "_idx.npz").write_bytes(npz[: len(npz) // 2])
    with pytest.raises(ValueError, match=rf"^{q}_idx\.npz: not a readable numpy \.npz archive"):
        paddle_gpt.read_tokens(q)
    # a blend's weights
    with pytest.raises(corpus.DataError, match="blend weights must be positive"):
        corpus.parse_blend("0 a 1 b")
    assert corpus.parse_blend(["0.25", "a", "0.75", "b"]) == [(0.25, "a"), (0.75, "b")]
    which, within = corpus.blend_order([0.25, 0.75], 400)
    assert abs(int((which == 0).sum()) - 100) <= 1 and list(within[which == 1][:5]) == [0, 1, 2, 3, 4]


@pytest.mark.framework("paddle")
def test_paddle_corruptions_are_refused_before_launch(tmp_path, paddle_python):
    good = tmp_path / "good"
    good.mkdir()
    framework_run(paddle_python, PADDLE_WRITER, str(good / "m"), str(good / "n"), "1024", "20000", "5")
    logs = tmp_path / "logs"
    gpt = "gpt3_tiny:paddle:cpu:1:1"
    both = refused(start(gpt, logs, "--data-dir", str(good)), logs)
    assert both.startswith(f"data_dir {str(good)!r} holds several corpora: ['n', 'm']; name one with data.prefix")
    cases = {
        "truncated_npy": lambda d: Path(d / "n_ids.npy").write_bytes(Path(good / "n_ids.npy").read_bytes()[:-64]),
        "garbage_npy": lambda d: Path(d / "n_ids.npy").write_bytes(b"\x93NUMPY garbage"),
        "truncated_npz": lambda d: Path(d / "n_idx.npz").write_bytes(Path(good / "n_idx.npz").read_bytes()[:200]),
    }
    for name, damage in cases.items():
        d = tmp_path / name
        d.mkdir()
        for f in ("n_ids.npy", "n_idx.npz"):
            shutil.copy(good / f, d / f)
        damage(d)
        msg = refused(start(gpt, logs, "--data-dir", str(d)), logs)
        bad = "n_idx.npz" if name.endswith("npz") else "n_ids.npy"
        kind = ".npz archive" if name.endswith("npz") else ".npy array"
        assert msg.startswith(f"{d / bad}: not a readable numpy {kind} ("), (name, msg)
    d = tmp_path / "mmap_short"
    d.mkdir()
    for f in ("m.bin", "m.idx"):
        shutil.copy(good / f, d / f)
    with open(d / "m.bin", "r+b") as fh:
        fh.truncate(1000)
    assert (
        refused(start(gpt, logs, "--data-dir", str(d)), logs) == f"{d / 'm'}.bin: 1000 bytes, the index m.idx describes 40000 (truncated)"
    )


@pytest.mark.framework("deepspeed")
def test_llava_schema_images_and_tokenizer_are_checked_before_launch(tmp_path, deepspeed_python):
    data, tok = tmp_path / "data", tmp_path / "tok"
    llava_data(deepspeed_python, data, tok)
    big_tok, clash_tok = tmp_path / "big", tmp_path / "clash"
    llava_data(deepspeed_python, tmp_path / "d2", big_tok, n_words=1100)  # 1100 ids, vocab 1024
    llava_data(deepspeed_python, tmp_path / "d3", clash_tok, n_words=1010)  # id 1000 is a word: the image token's id
    logs = tmp_path / "logs"
    llava = "llava_tiny:deepspeed:cpu:1:2"
    base = ["--data-dir", str(data), "--set", "data.missing_images=skip"]
    fine = data / "llava_v1_5_mix665k.json"
    assert refused(start(llava, logs, *base), logs).startswith("data.data_dir is set but no tokenizer is")
    assert refused(start(llava, logs, *base, "--set", f"data.tokenizer_path={big_tok}"), logs) == (
        f"tokenizer {big_tok}: the tokenizer has 1100 ids, more than the model's vocab_size 1024"
    )
    assert refused(start(llava, logs, *base, "--set", f"data.tokenizer_path={clash_tok}"), logs) == (
        f"tokenizer {clash_tok}: the tokenizer's id 1000 is 'w972', which the model takes for its image token "
        "(model.image_token_index 1000)"
    )
    args = [*base, "--set", f"data.tokenizer_path={tok}"]
    entries = json.loads(fine.read_text())
    # the finetune file, broken: found before the pretrain phase would have run
    fine.write_text(fine.read_text()[:-30])
    msg = refused(start(llava, logs, *args), logs)
    assert msg.startswith(f"phase finetune: {fine}: not JSON: ") and "line 1 column" in msg
    bad = [dict(e) for e in entries]
    bad[3] = {"id": bad[3]["id"], "image": bad[3]["image"], "messages": bad[3]["conversations"]}
    fine.write_text(json.dumps(bad))
    assert refused(start(llava, logs, *args), logs) == (
        f"phase finetune: {fine}: entry 3 (id '{bad[3]['id']}'): no 'conversations' list (keys: id, image, messages)"
    )
    bad = [dict(e) for e in entries]
    bad[5] = {**bad[5], "conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "hi"}]}
    fine.write_text(json.dumps(bad))
    assert refused(start(llava, logs, *args), logs) == (
        f"phase finetune: {fine}: entry 5 (id '{bad[5]['id']}'): conversations[0] is from 'gpt'; turns alternate human, gpt, human, ..."
    )
    fine.write_text(json.dumps(entries))
    ok = subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", llava, *args, "--dry-run", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    ident = json.loads(ok.stdout)["data"]
    assert ident["pretrain"]["entries"] == 40 and ident["finetune"]["entries"] == 49
    assert ident["finetune"]["skipped_missing_images"] == 1 and ident["pretrain"]["tokenizer"]["size"] == 40
