"""Data that is what it says (docs/datasets.md): every data key used or refused, Megatron's blend
convention read as given, identities that chain from phase to phase, fingerprints of the decoded
content, images kept inside their folder and under the pixel limit, a wrong .idx dtype code named.

The data is written here in the upstream formats (Megatron's indexed .bin/.idx, PaddleNLP's
_ids.npy/_idx.npz pair, LLaVA JSON with Pillow's PNG/JPEG images, a tokenizers tokenizer.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image, PngImagePlugin

from run_benchmarks.errors import InputError
from run_benchmarks.planning import datacheck
from run_benchmarks.planning.registry import CASES_DIR, ROOT
from tests.test_data_identity import SHAPE, llava
from training.data import paddle_gpt
from training.data.indexed import IndexedWriter, write_indexed

START = str(ROOT / "run_benchmarks" / "start_task.py")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGBENCH_CACHE_DIR", str(tmp_path / "cache"))


def dry(case: str, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", case, "--dry-run", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0][len("error: ") :]


def docs(n: int = 6, length: int = 700, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, length) for _ in range(n)]


def megatron(prefix: Path, documents: list[np.ndarray], dtype=np.uint16) -> Path:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_indexed(str(prefix), documents, dtype)
    return prefix


def mega_ident(prefix: Path, **extra) -> dict:
    out = datacheck.check_megatron({"data_dir": str(prefix.parent), "prefix": prefix.name, **extra}, SHAPE, "m", "train")
    return {**out, "fingerprint": datacheck.fingerprint(out)}


# --------------------------------------------------------------------------- 1. read as given, or refused


def test_a_megatron_blend_without_data_dir_is_read_where_it_points(tmp_path):
    megatron(tmp_path / "a" / "wudao_text_document", docs(seed=1))
    megatron(tmp_path / "b" / "my_text_document", docs(seed=2), np.int32)
    blend = f"data.prefix=0.3 {tmp_path}/a/wudao_text_document 0.7 b/my_text_document"  # absolute, and relative to the cwd
    proc = dry("llama3_tiny:megatron:cpu:1:2", "--set", blend, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ident = json.loads(proc.stdout)["data"]["train"]
    assert ident["kind"] == "real" and [c["path"] for c in ident["corpora"]] == [
        f"{tmp_path}/a/wudao_text_document",
        f"{tmp_path}/b/my_text_document",
    ]
    assert [c["weight"] for c in ident["corpora"]] == [0.3, 0.7]
    assert f"{tmp_path}/b/my_text_document (4,200 tokens, int32, weight 0.7), checked; fingerprint {ident['fingerprint']}" in (
        " ".join(proc.stderr.split())
    )
    assert "no reference for this data" in " ".join(json.loads(proc.stdout)["judged_by"])  # not the synthetic curve
    # gpt3 reads one corpus: a blend is refused in one line
    msg = one_line(dry("gpt3_tiny:paddle:cpu:1:2", "--set", blend, cwd=tmp_path))
    assert msg.startswith("data.prefix '0.3 ") and "a blend of corpora; the paddle_gpt reader of this case reads one corpus" in msg
    assert "data synthetic (the harness's own corpus)" in dry("llama3_tiny:megatron:cpu:1:2").stderr  # beside --json's plan
    # the synthetic corpus is said, too: with the plan, on stdout
    cmd = [sys.executable, START, "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "data synthetic (the harness's own corpus)" in proc.stdout and not proc.stderr.strip(), proc.stderr


def test_a_prefix_outside_data_dir_is_refused_in_a_container(tmp_path):
    megatron(tmp_path / "in" / "c", docs())
    megatron(tmp_path / "out" / "d", docs())
    settings = {"data": {"format": "megatron", "data_dir": str(tmp_path / "in"), "prefix": f"1 c 1 {tmp_path}/out/d"}}
    with pytest.raises(InputError, match=rf"^data.prefix '{tmp_path}/out/d': outside data_dir {tmp_path}/in, which is all a container"):
        datacheck.settle(settings, {"data": {"format": "megatron"}}, [], str(tmp_path), True, True)
    datacheck.settle(settings, {"data": {"format": "megatron"}}, [], str(tmp_path), True, False)  # processes: read where it is
    apart = {"data": {"format": "megatron", "data_dir": None, "prefix": f"1 {tmp_path}/in/c 1 /proc/x"}}
    with pytest.raises(InputError, match="its corpora share no folder but /, which a container does not mount"):
        datacheck.settle(apart, {"data": {"format": "megatron"}}, [], str(tmp_path), False, True)
    inside = {"data": {"format": "megatron", "data_dir": None, "prefix": f"1 {tmp_path}/in/c 1 {tmp_path}/out/d"}}
    datacheck.settle(inside, {"data": {"format": "megatron"}}, [], str(tmp_path), True, True)
    assert inside["data"]["data_dir"] == str(tmp_path)  # the folder of them all: what the container mounts


def data_keys(case_yaml: Path) -> list[str]:
    standard = yaml.safe_load(case_yaml.read_text())["standard"]["data"]
    out = []
    for key, value in standard.items():
        if key == "phases":
            out += [f"phases.{ph}.{k}" for ph, over in value.items() for k in over]
        else:
            out.append(key)
    return out


def wrong_value(key: str) -> str:
    leaf = key.split(".")[-1]
    if leaf.endswith(("_path", "_dir", "checkpoint", "json", "image_folder")) or leaf == "prefix":
        return "/nonexistent/flagbench-46"
    if leaf in ("format", "missing_images", "template", "image_aspect_ratio", "fingerprint"):
        return "bogus-46"
    return "-46"


CASES = {"llama3": "llama3_tiny:megatron:cpu:1:2", "baichuan2": "baichuan2_tiny:deepspeed:cpu:1:2"}
CASES |= {"gpt3": "gpt3_tiny:paddle:cpu:1:2", "llava": "llava_tiny:deepspeed:cpu:1:2"}
KEYS = [(fam, key) for fam, case in CASES.items() for key in data_keys(next(CASES_DIR.glob(f"{fam}/*/case.yaml")))]


@pytest.mark.parametrize(("family", "key"), KEYS, ids=[f"{f}-{k}" for f, k in KEYS])
def test_every_data_key_given_a_wrong_value_is_refused_or_used(family, key):
    value = wrong_value(key)
    proc = dry(CASES[family], "--set", f"data.{key}={value}")
    if proc.returncode == 0:  # used: the value is what the plan hands the ranks, and what the data line shows
        plan = json.loads(proc.stdout)
        where = plan["settings"]["data"]
        for part in key.split("."):
            where = where[part]
        assert str(where) == value and value in " ".join(proc.stderr.split()), f"data.{key}={value} dropped: {proc.stderr}"
        return
    msg = one_line(proc)
    assert key.split(".")[-1] in msg, msg  # the refusal names the key


# --------------------------------------------------------------------------- 2. identities that chain


def llava_pretrain_sets(d: dict) -> list[str]:
    return [x for k, v in d.items() for x in ("--set", f"data.phases.pretrain.{k}={v}")]


def test_a_finetune_after_a_pretrain_on_other_data_is_not_judged(tmp_path):
    d = llava(tmp_path / "a")
    proc = dry("llava_tiny:deepspeed:cpu:1:2", *llava_pretrain_sets(d))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    pre, fine = out["data"]["pretrain"], out["data"]["finetune"]
    assert pre["kind"] == "real" and fine["kind"] == "synthetic" and fine["own_fingerprint"] == "synthetic"
    assert fine["starts_from"] == [{"phase": "pretrain", "fingerprint": pre["fingerprint"], "recipe": "standard"}]
    assert fine["fingerprint"] not in ("synthetic", pre["fingerprint"])
    why = f"not judged: the pretrain ran on other data (fingerprint {pre['fingerprint']}, the reference's synthetic)"
    assert any(why in line and line.startswith("reference (finetune): none") for line in out["judged_by"]), out["judged_by"]
    assert "starts from phase pretrain's weights" in proc.stderr
    # a pretrain of another recipe: the finetune is not judged either
    proc = dry("llava_tiny:deepspeed:cpu:1:2", "--set", "train.phases.pretrain.lr=0.5")
    out = json.loads(proc.stdout)
    assert out["data"]["finetune"]["starts_from"][0]["recipe"] == "standard with train.phases.pretrain.lr=0.5"
    assert any("the pretrain ran another recipe" in line for line in out["judged_by"]), out["judged_by"]
    # the plain synthetic chain keeps the committed references' identity
    out = json.loads(dry("llava_tiny:deepspeed:cpu:1:2").stdout)
    assert out["data"]["finetune"] == {"kind": "synthetic", "fingerprint": "synthetic"}
    assert all("standard." in line for line in out["judged_by"]), out["judged_by"]


def test_a_checkpoint_loaded_by_path_enters_the_identity(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights-1")
    (ckpt / "config.json").write_text("{}")
    ident = {"pretrain": {"kind": "synthetic", "fingerprint": "synthetic"}, "finetune": {"kind": "synthetic", "fingerprint": "synthetic"}}

    class P:  # the two fields of a plan the chain reads
        settings = {"data": {"model_path": str(ckpt)}}
        recipe, user_overrides = "standard", []

    first = datacheck.chain(P, json.loads(json.dumps(ident)))
    assert first["pretrain"]["starts_from"][0]["setting"] == "data.model_path" and first["pretrain"]["fingerprint"] != "synthetic"
    assert first["finetune"]["starts_from"][0]["fingerprint"] == first["pretrain"]["fingerprint"]
    (ckpt / "model.safetensors").write_bytes(b"weights-2")
    again = datacheck.chain(P, json.loads(json.dumps(ident)))
    assert again["pretrain"]["fingerprint"] != first["pretrain"]["fingerprint"] != again["finetune"]["fingerprint"]
    # a checkpoint on the cluster's hosts only (not here, not taken there): no fingerprint, never judged as synthetic
    P.settings = {"data": {"model_path": "/on/the/hosts/ckpt"}}
    away = datacheck.chain(P, json.loads(json.dumps(ident)))
    assert away["pretrain"]["fingerprint"] is None and away["finetune"]["fingerprint"] is None
    assert (
        away["pretrain"]["reason"]
        == "data.model_path /on/the/hosts/ckpt is not on this machine: the starting checkpoint's content is not fingerprinted"
    )


# --------------------------------------------------------------------------- 3. fingerprints of the content


def test_a_changed_token_between_the_sampled_blocks_changes_the_fingerprint(tmp_path):
    n = 3_000_000  # more than 64 blocks of 32 Ki tokens: the sampled form skips most of it
    p = megatron(tmp_path / "c", [np.random.default_rng(0).integers(0, 1000, n)])
    full, sampled = mega_ident(p), mega_ident(p, fingerprint="sampled")
    assert sampled["sampled"] is True and sampled["fingerprint"] != full["fingerprint"]
    assert "(sampled: data.fingerprint=sampled)" in datacheck.describe({"train": {**sampled, "checked": True}})[0]
    assert datacheck.identity_text({**sampled, "checked": True}).endswith("(sampled)")
    bin_ = Path(str(p) + ".bin")
    st = bin_.stat()
    pos = 40_000  # between the first block (0 .. 32 Ki) and the second (~46 Ki)
    with open(bin_, "r+b") as fh:
        fh.seek(2 * pos)
        old = np.frombuffer(fh.read(2), np.uint16)[0]
        fh.seek(2 * pos)
        fh.write(np.uint16((old + 1) % 1000).tobytes())
    os.utime(bin_, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as they were
    assert mega_ident(p)["fingerprint"] != full["fingerprint"]  # the cache's key has the ctime: read again
    assert mega_ident(p, fingerprint="sampled")["fingerprint"] == sampled["fingerprint"]  # what sampling cannot see


def test_one_corpus_has_one_fingerprint_whatever_its_name_folder_dtype_or_layout(tmp_path):
    documents = docs(8, 900, 3)
    fp = mega_ident(megatron(tmp_path / "x" / "wudao_text_document", documents))["fingerprint"]
    assert mega_ident(megatron(tmp_path / "y" / "other_name", documents, np.int32))["fingerprint"] == fp
    assert mega_ident(megatron(tmp_path / "z" / "c", documents[:-1] + [documents[-1][:-1]]))["fingerprint"] != fp
    joined = megatron(tmp_path / "j" / "c", [np.concatenate(documents[:2]), *documents[2:]])  # one boundary less
    assert mega_ident(joined)["fingerprint"] != fp
    # gpt3: PaddleNLP's npy pair and its mmap pair of the same ids and documents
    paddle_gpt.write_corpus(str(tmp_path / "npy" / "gpt_en"), documents, 1024)
    (tmp_path / "mmap").mkdir()
    with IndexedWriter(str(tmp_path / "mmap" / "gpt_en"), np.int32) as w:  # PaddleNLP's make_builder(path, "mmap", int32)
        for doc in documents:
            w.add_sequence(doc)
            w.end_document()
    npy = datacheck.check_paddle_gpt({"data_dir": str(tmp_path / "npy")}, SHAPE, "g", "train")
    mmap = datacheck.check_paddle_gpt({"data_dir": str(tmp_path / "mmap")}, SHAPE, "g", "train")
    assert npy["format"] == "paddle_gpt:npy" and mmap["format"] == "paddle_gpt:mmap"
    assert datacheck.fingerprint(npy) == datacheck.fingerprint(mmap)


def test_llava_fingerprints_see_pixels_and_entries_not_whitespace_or_metadata(tmp_path):
    d = llava(tmp_path / "a")

    def fp() -> str:
        return datacheck.fingerprint(datacheck.check_llava(d, SHAPE, "llava_tiny", "pretrain"))

    first = fp()
    js = Path(d["data_dir"]) / "data.json"
    js.write_text(json.dumps(json.loads(js.read_text()), indent=4))  # re-indented
    assert fp() == first
    img = Path(d["data_dir"]) / "img" / "001.png"
    meta = PngImagePlugin.PngInfo()
    meta.add_text("Software", "another writer")
    Image.open(img).save(img, pnginfo=meta)  # same pixels, other metadata and bytes
    assert fp() == first
    st = img.stat()
    Image.fromarray(np.full((8, 8, 3), 77, dtype=np.uint8)).save(img)  # other pixels, rewritten in place
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert img.stat().st_mtime_ns == st.st_mtime_ns
    changed = fp()
    assert changed != first  # the image cache's key has the ctime and inode
    tok = Path(d["tokenizer_path"]) / "tokenizer.json"
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=2))  # whitespace
    assert fp() == changed
    body = json.loads(tok.read_text())
    body["model"]["merges"] = ["w 1"]
    tok.write_text(json.dumps(body))
    assert fp() != changed


# --------------------------------------------------------------------------- 4. images inside their folder


@pytest.mark.parametrize("path", ["../../../etc/passwd", "/etc/passwd", "sub/../../x.png"])
def test_an_image_path_leaving_its_folder_is_refused_naming_the_entry(tmp_path, path):
    d = llava(tmp_path / "a")
    js = Path(d["data_dir"]) / "data.json"
    recs = json.loads(js.read_text())
    recs[2]["image"] = path
    js.write_text(json.dumps(recs))
    with pytest.raises(InputError) as exc:
        datacheck.check_llava(d, SHAPE, "llava_tiny", "pretrain")
    assert str(exc.value).startswith(f"{path}: ") and str(exc.value).endswith(f"image of entry 2 (id 'r2') of {js} (phase pretrain)")


def test_a_symlink_inside_the_folder_is_followed_and_said(tmp_path):
    d = llava(tmp_path / "a")
    elsewhere = tmp_path / "store" / "real.png"
    elsewhere.parent.mkdir()
    Image.fromarray(np.full((8, 8, 3), 20, dtype=np.uint8)).save(elsewhere)
    link = Path(d["data_dir"]) / "img" / "001.png"
    link.unlink()
    link.symlink_to(elsewhere)
    proc = dry("llava_tiny:deepspeed:cpu:1:2", *llava_pretrain_sets(d))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["data"]["pretrain"]["symlinks"] == {"001.png": str(elsewhere)}
    assert f"1 image(s) are symlinks, followed: 001.png -> {elsewhere}" in " ".join(proc.stderr.split())


def test_an_image_above_the_pixel_limit_is_refused_in_one_line(tmp_path):
    d = llava(tmp_path / "a")
    big = Path(d["data_dir"]) / "img" / "003.png"
    Image.new("1", (20_000, 20_000)).save(big)  # a decompression bomb: 400 M pixels in a few KB
    assert big.stat().st_size < 200_000
    msg = one_line(dry("llava_tiny:deepspeed:cpu:1:2", *llava_pretrain_sets(d)))
    js = Path(d["data_dir"]) / "data.json"
    assert msg == (
        f"{big}: 20,000 x 20,000 pixels, above data.max_image_pixels 89,478,485: image of entry 3 (id 'r3') of {js} (phase pretrain)"
    )
    msg = one_line(dry("llava_tiny:deepspeed:cpu:1:2", *llava_pretrain_sets(d), "--set", "data.max_image_pixels=32"))
    assert "8 x 8 pixels, above data.max_image_pixels 32" in msg  # the setting is read, the first image over it named


# --------------------------------------------------------------------------- 5. a dtype code that does not fit


def test_an_idx_dtype_code_that_does_not_fit_the_bin_names_the_sizes_that_would(tmp_path):
    p = megatron(tmp_path / "d" / "c_text_document", docs())
    raw = bytearray(Path(str(p) + ".idx").read_bytes())
    raw[17] = 4  # int32 on a uint16 corpus
    Path(str(p) + ".idx").write_bytes(bytes(raw))
    msg = one_line(dry("llama3_tiny:megatron:cpu:1:2", "--data-dir", str(p.parent)))
    assert msg == (
        f"{p}.idx: dtype code 4 (int32, 4 bytes a token) does not fit c_text_document.bin: its 8400 bytes hold the "
        "index's 4200 tokens at 2 bytes a token (dtype codes 3 (int16), 8 (uint16))"
    )
