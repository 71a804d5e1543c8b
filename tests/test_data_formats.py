"""Every data format the cases read, written by its upstream library's own writer inside the
framework environment, run end to end on the tiny case through start_task.py.

- llama3/megatron and baichuan2/deepspeed: Megatron's ``IndexedDatasetBuilder`` (uint16 and
  int32), one corpus found in data_dir, and Megatron's blended ``weight prefix`` list;
- gpt3/paddle: PaddleNLP's ``make_builder(..., "mmap", ...)`` .bin/.idx, and the
  ``_ids.npy`` + ``_idx.npz`` pair as PaddleNLP's preprocessing lays it out;
- llava/deepspeed: LLaVA JSON for both stages with JPEG and PNG images made by PIL, a
  text-only entry, ``<image>`` after the text, multi-turn entries, a missing image under
  ``data.missing_images: skip``, and a Hugging Face tokenizer saved by ``transformers``.

A run on real data without a reference for it is unjudged ("no reference for this data");
``--record-reference`` refuses one run (a reference has 3 repeats that differ in rounding), makes
the mean of three micro batches' curves the reference for that data, and a second run aligns
against it. The token streams are the project's synthetic Markov chain, so the loss
falls and two runs on one corpus give one curve.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from run_benchmarks import typed_results as tr
from run_benchmarks.planning.registry import ROOT
from tests.case_helpers import start_task

MEGATRON_WRITER = textwrap.dedent("""
    # Megatron's own builder: python - SPEC.json; SPEC: [{"prefix", "dtype", "vocab", "tokens", "seed"}]
    import json, sys
    import numpy as np, torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from training.data import synthetic
    for c in json.load(open(sys.argv[1])):
        b = IndexedDatasetBuilder(c["prefix"] + ".bin", dtype=np.dtype(c["dtype"]).type)
        for doc in synthetic.documents(c["vocab"], c["tokens"], c["seed"]):
            b.add_item(torch.from_numpy(doc.astype(np.int64)))
            b.end_document()
        b.finalize(c["prefix"] + ".idx")
""")

PADDLE_WRITER = textwrap.dedent("""
    # PaddleNLP's mmap builder, and the npy/npz pair as its create_pretraining_data.py writes it
    import sys
    import numpy as np
    from paddlenlp.data.indexed_dataset import make_builder
    from training.data import synthetic
    mmap_prefix, npy_prefix, vocab, tokens, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    docs = synthetic.documents(vocab, tokens, seed)
    b = make_builder(mmap_prefix + ".bin", "mmap", np.uint16)
    for doc in docs:
        b.add_item(doc)
        b.end_document()
    b.finalize(mmap_prefix + ".idx")
    ids = np.concatenate(docs).astype(np.uint16)
    lens = np.array([len(d) for d in docs], dtype=np.int32)
    np.save(npy_prefix + "_ids.npy", ids)
    np.savez(npy_prefix + "_idx.npz", lens=lens, docs=np.arange(len(docs) + 1, dtype=np.int64))
""")

LLAVA_WRITER = textwrap.dedent("""
    # LLaVA's JSON for both stages, images by PIL, a tokenizer saved by transformers
    import json, os, sys
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    root, tok_dir, n_words = sys.argv[1], sys.argv[2], int(sys.argv[3])
    words = ["a", "red", "blue", "green", "cat", "dog", "house", "tree", "on", "the", "what", "is", "in",
             "picture", "colour", "it", "shows", "sky", "and", "car", "small", "big", "describe", "image", "there"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words + [f"w{k}" for k in range(max(0, n_words - len(words) - 3))]:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>").save_pretrained(tok_dir)
    rng = np.random.default_rng(0)
    colours = {"red": (200, 30, 30), "blue": (30, 30, 200), "green": (30, 160, 30)}
    os.makedirs(os.path.join(root, "LLaVA-Pretrain", "images", "00000"), exist_ok=True)
    os.makedirs(os.path.join(root, "coco", "train2017"), exist_ok=True)
    pre, fine = [], []
    for i in range(40):
        name = list(colours)[i % 3]
        arr = np.clip(np.array(colours[name]) + rng.integers(-20, 20, (64, 80, 3)), 0, 255).astype(np.uint8)
        ext = "jpg" if i % 2 else "png"
        Image.fromarray(arr).save(os.path.join(root, "LLaVA-Pretrain", "images", "00000", f"{i:05d}.{ext}"))
        Image.fromarray(arr).save(os.path.join(root, "coco", "train2017", f"{i:012d}.{ext}"))
        pre.append({"id": f"{i:05d}", "image": f"00000/{i:05d}.{ext}", "conversations": [
            {"from": "human", "value": "<image>\\ndescribe the image" if i % 4 else "describe the image\\n<image>"},
            {"from": "gpt", "value": f"a {name} picture"}]})
        turns = [{"from": "human", "value": "<image>\\nwhat is the colour"}, {"from": "gpt", "value": f"it is {name}"}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "is it big"}, {"from": "gpt", "value": "it is small"}]
        fine.append({"id": f"c{i}", "image": f"coco/train2017/{i:012d}.{ext}", "conversations": turns})
        if i % 5 == 0:
            fine.append({"id": f"t{i}", "conversations": [{"from": "human", "value": "what is the sky"},
                                                           {"from": "gpt", "value": "the sky is blue"}]})
    fine.append({"id": "gone", "image": "ocr_vqa/images/missing.jpg", "conversations": [
        {"from": "human", "value": "<image>\\nwhat is in the picture"}, {"from": "gpt", "value": "a car"}]})
    json.dump(pre, open(os.path.join(root, "LLaVA-Pretrain", "blip_laion_cc_sbu_558k.json"), "w"))
    json.dump(fine, open(os.path.join(root, "llava_v1_5_mix665k.json"), "w"))
""")


def framework_run(py: str, script: str, *args: str, timeout: int = 300) -> None:
    """Run ``script`` with the framework's Python, the repository on PYTHONPATH."""
    proc = subprocess.run(
        [py, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def megatron_corpora(py: str, specs: list[dict]) -> None:
    spec_file = Path(specs[0]["prefix"]).parent / "spec.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(specs))
    framework_run(py, MEGATRON_WRITER, str(spec_file))
    spec_file.unlink()


def llava_data(py: str, root: Path, tok_dir: Path, n_words: int = 40) -> None:
    root.mkdir(parents=True, exist_ok=True)
    framework_run(py, LLAVA_WRITER, str(root), str(tok_dir), str(n_words))


def run_case(case: str, log_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, tr.RunResults | None]:
    proc = start_task("--vendor", "cpu", "--case_name", case, "--log-dir", str(log_dir), *args)
    runs = sorted(p for p in log_dir.iterdir() if p.is_dir()) if log_dir.is_dir() else []
    return proc, (tr.load(runs[-1] / "results.json") if runs else None)


NO_REFERENCE = "loss not judged: no reference for this data (fingerprint "


@pytest.fixture(scope="module")
def megatron_data(tmp_path_factory, megatron_python) -> dict[str, Path]:
    """The Megatron corpora of this module's tests, a folder per test, written by Megatron's
    builder in one process (megatron-core imported once): llama3's one corpus, the two of the
    blend (uint16 and int32), baichuan2's."""
    root = tmp_path_factory.mktemp("megatron_data")
    dirs = {name: root / name for name in ("llama3", "blend", "baichuan2")}
    for d in dirs.values():
        d.mkdir()
    megatron_corpora(
        megatron_python,
        [
            {"prefix": str(dirs["llama3"] / "my-corpus_text_document"), "dtype": "uint16", "vocab": 1024, "tokens": 60_000, "seed": 11},
            {"prefix": str(dirs["blend"] / "wudao_a"), "dtype": "uint16", "vocab": 1024, "tokens": 40_000, "seed": 1},
            {"prefix": str(dirs["blend"] / "wudao_b"), "dtype": "int32", "vocab": 1024, "tokens": 40_000, "seed": 2},
            {"prefix": str(dirs["baichuan2"] / "owt_text_document"), "dtype": "uint16", "vocab": 2048, "tokens": 50_000, "seed": 3},
        ],
    )
    return dirs


@pytest.fixture(scope="module")
def paddle_data(tmp_path_factory, paddle_python) -> dict[str, Path]:
    """One corpus in PaddleNLP's two layouts, each alone in its folder ("mmap", "npy"), written
    by one process."""
    root = tmp_path_factory.mktemp("paddle_data")
    dirs = {layout: root / layout for layout in ("mmap", "npy")}
    for d in dirs.values():
        d.mkdir()
    framework_run(paddle_python, PADDLE_WRITER, str(dirs["mmap"] / "gpt_corpus"), str(dirs["npy"] / "gpt_corpus"), "1024", "60000", "5")
    return dirs


@pytest.mark.framework("megatron")
def test_llama3_on_megatron_builder_data_then_its_own_reference(tmp_path, megatron_data):
    data = megatron_data["llama3"]
    proc, res = run_case("llama3_tiny:megatron:cpu:1:1", tmp_path / "first", "--data-dir", str(data))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (rnd,) = res.rounds
    (p,) = rnd.phases
    ident = res.data["train"]
    assert ident["format"] == "megatron" and ident["corpora"][0]["prefix"] == "my-corpus_text_document"
    assert ident["corpora"][0]["tokens"] == 60_000 and ident["corpora"][0]["dtype"] == "uint16" and len(ident["fingerprint"]) == 16
    assert p.meta["data"] == f"indexed:{data / 'my-corpus_text_document'}"  # the prefix was found, not configured
    assert rnd.status == "unjudged" and p.gate.verdict == "not judged" and p.reference is None
    made = "start_task.py --record-reference RUN/results.json ... makes one from 3 runs)"
    assert rnd.error == f"phase train: {NO_REFERENCE}{ident['fingerprint']}; {made}"
    terminal = " ".join(proc.stderr.split())  # the round's line, however the terminal wrapped it
    assert "round 1: unjudged - phase train: loss not judged: no reference for this data" in terminal
    assert "%" not in p.gate.reason  # no meaningless percentage
    assert p.loss[25] < p.loss[1] - 1.0  # it learns the corpus

    first = tmp_path / "first" / res.run_id / "results.json"
    shown = f"cases/llama3/megatron/reference/llama3_tiny/standard.data-{ident['fingerprint']}.json"
    ref_file = ROOT / shown
    try:
        one = start_task("--record-reference", str(first), timeout=120)  # one curve has no spread: no reference
        assert one.returncode == 2 and "1 round(s) give 1 distinct curve(s); a reference needs at least 3 repeats" in one.stderr
        assert not ref_file.exists()
        runs = [first]
        for mb in (2, 4):  # the same data at other micro batches: curves that differ in rounding
            _, more = run_case(
                "llama3_tiny:megatron:cpu:1:1", tmp_path / f"mb{mb}", "--data-dir", str(data), "--set", f"train.micro_batch={mb}"
            )
            runs.append(tmp_path / f"mb{mb}" / more.run_id / "results.json")
        rec = start_task("--record-reference", *map(str, runs), timeout=120)
        assert rec.returncode == 0, rec.stdout + rec.stderr
        assert rec.stdout.startswith(f"wrote {shown} (phase train, recipe standard, 3 run(s), spread "), rec.stdout
        doc = json.loads(ref_file.read_text())
        assert doc["data"]["fingerprint"] == ident["fingerprint"] and 0 < doc["spread"] < 1e-4, doc.get("spread")
        assert doc["loss"] == pytest.approx([p.loss[s] for s in range(1, 31)], rel=1e-4)
        again = start_task("--record-reference", *map(str, runs), timeout=120)  # a reference is not replaced unasked
        assert (
            again.returncode == 2
            and again.stderr.strip() == f"error: {shown}: a reference of this model, recipe and data exists; --replace replaces it"
        )
        # the second run on the same data aligns against it
        proc2, res2 = run_case("llama3_tiny:megatron:cpu:1:1", tmp_path / "second", "--data-dir", str(data))
        assert proc2.returncode == 0, proc2.stdout + proc2.stderr
        (p2,) = res2.rounds[0].phases
        assert res2.rounds[0].status == "ok" and p2.gate.verdict == "aligned" and p2.reference.path == shown
        assert p2.gate.mre < 1e-3 and res2.data["train"]["fingerprint"] == ident["fingerprint"]
        # a synthetic run given the real data's run as --reference is refused before anything runs
        syn, res3 = run_case("llama3_tiny:megatron:cpu:1:1", tmp_path / "third", "--reference", str(first))
        assert syn.returncode == 2 and res3 is None, syn.stdout + syn.stderr
        assert f"--reference {first}: made on other data (fingerprint {ident['fingerprint']}) than the run's phase train" in syn.stderr
    finally:
        ref_file.unlink(missing_ok=True)


@pytest.mark.framework("megatron")
def test_llama3_on_a_blend_of_two_corpora(tmp_path, megatron_data):
    data = megatron_data["blend"]
    dry = start_task("--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:1", "--data-dir", str(data), "--dry-run", "--json")
    assert dry.returncode == 2 and "holds 2 Megatron corpora" in dry.stderr and "name one with data.prefix" in dry.stderr
    proc, res = run_case(
        "llama3_tiny:megatron:cpu:1:1",
        tmp_path / "logs",
        "--data-dir",
        str(data),
        "--set",
        "data.prefix=0.3 wudao_a 0.7 wudao_b",
        "--set",
        "train.steps=8",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # unjudged: no reference for this data
    (p,) = res.rounds[0].phases
    assert res.rounds[0].status == "unjudged" and p.steps_run == 8
    assert p.meta["data"] == f"blend:0.3 {data / 'wudao_a'} 0.7 {data / 'wudao_b'}"
    assert [(c["prefix"], c["weight"], c["dtype"]) for c in res.data["train"]["corpora"]] == [
        ("wudao_a", 0.3, "uint16"),
        ("wudao_b", 0.7, "int32"),
    ]


@pytest.mark.framework("paddle")
@pytest.mark.parametrize("layout", ["mmap", "npy"])
def test_gpt3_on_paddlenlp_data(tmp_path, paddle_data, layout):
    data = paddle_data[layout]  # the corpus in this layout alone
    proc, res = run_case("gpt3_tiny:paddle:cpu:1:1", tmp_path / "logs", "--data-dir", str(data), "--set", "train.steps=8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (p,) = res.rounds[0].phases
    assert res.rounds[0].status == "unjudged" and p.steps_run == 8 and NO_REFERENCE in res.rounds[0].error
    kind = "paddle_mmap" if layout == "mmap" else "paddle_gpt"
    assert p.meta["data"] == f"{kind}:{data / 'gpt_corpus'}"
    assert res.data["train"]["format"] == f"paddle_gpt:{layout}" and res.data["train"]["tokens"] == 60_000


@pytest.mark.framework("deepspeed")
@pytest.mark.framework("megatron")
def test_baichuan2_on_megatron_builder_data(tmp_path, megatron_data, deepspeed_python):
    data = megatron_data["baichuan2"]
    proc, res = run_case("baichuan2_tiny:deepspeed:cpu:1:1", tmp_path / "logs", "--data-dir", str(data), "--set", "train.steps=7")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (p,) = res.rounds[0].phases
    assert res.rounds[0].status == "unjudged" and p.steps_run == 7 and NO_REFERENCE in res.rounds[0].error
    assert p.meta["data"]["prefix"] == str(data / "owt_text_document") and p.meta["data"]["source"] == "indexed"


@pytest.mark.framework("deepspeed")
def test_llava_on_llava_json_both_stages(tmp_path, deepspeed_python):
    data, tok = tmp_path / "data", tmp_path / "tokenizer"
    llava_data(deepspeed_python, data, tok)
    args = ["--data-dir", str(data), "--set", f"data.tokenizer_path={tok}", "--set", "train.steps=6", "--set", "train.warmup_steps=2"]
    failed = start_task("--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2", "--log-dir", str(tmp_path / "no"), *args)
    missing = data / "ocr_vqa/images/missing.jpg"
    assert failed.returncode == 2 and not (tmp_path / "no").exists(), failed.stdout + failed.stderr
    assert failed.stderr.startswith(
        f"error: {missing}: image of entry 48 of {data / 'llava_v1_5_mix665k.json'} (phase finetune) is missing"
    )
    proc, res = run_case("llava_tiny:deepspeed:cpu:1:2", tmp_path / "logs", *args, "--set", "data.missing_images=skip")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    pre, fine = res.rounds[0].phases
    assert res.rounds[0].status == "unjudged" and pre.steps_run == fine.steps_run == 6
    assert pre.meta["tokenizer"] == f"hf:{tok}" and pre.meta["data"] == "real" and pre.meta["dataset_samples"] == 40
    assert fine.meta["dataset_samples"] == 48 and fine.meta["skipped_missing_images"] == 1  # 40 images + 8 text-only kept
    assert res.data["finetune"]["skipped_missing_images"] == 1 and res.data["pretrain"]["skipped_missing_images"] == 0
    assert res.data["pretrain"]["fingerprint"] != res.data["finetune"]["fingerprint"]
    assert all(pre.loss[s] > 0 for s in pre.loss) and fine.loss[6] < fine.loss[1]
