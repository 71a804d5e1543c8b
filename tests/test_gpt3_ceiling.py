"""gpt3/paddle's kernel ceiling (cases/gpt3/paddle/ceiling.py on training/ceiling.py).

The GEMM list at the real shapes of gpt3_6.7B and gpt3_13B, TP1 and TP2, fused and separate
QKV (arithmetic, no paddle); in the paddle environment (``FB_TEST_PADDLE_PYTHON``, skipped
without it): the list against the layers of the model PaddleNLP builds, the attention
function the ceiling times against causal attention by hand, and ``start_task.py --ceiling``
on gpt3_tiny. That a run records the ceiling in its results.json is checked on
tests/test_gpt3_run.py's one-process run.
"""

from __future__ import annotations

import functools
import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from cases.gpt3.paddle import ceiling as gpt3_ceiling
from cases.gpt3.paddle import settings as S
from tests.case_helpers import framework_python, start_task
from training import flops, shapes

ROOT = Path(__file__).resolve().parent.parent
CASE_DIR = ROOT / "cases" / "gpt3" / "paddle"
CASE = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))


def settings(model: str, world: int, **parallel) -> S.Settings:
    m = CASE["models"][model]
    train = {**CASE["standard"]["train"], **m.get("train", {}), "micro_batch": parallel.pop("micro_batch", 1)}
    cfg = {
        "case": {"model": model},
        "model": {"name": model, "params_nominal": m["params_nominal"], **m["shape"]},
        "train": train,
        "parallel": {**CASE["standard"]["parallel"], **parallel},
        "data": {"data_dir": None, "cache_dir": "/tmp/x"},
        "vendor": {"device": "cuda", "dist_backend": "nccl"},
    }
    return S.from_config(cfg, world)


def shapes(s: S.Settings) -> dict[str, tuple]:
    return {g.name: (g.m, g.n, g.k, g.times(s.shape.num_layers), g.products) for g in gpt3_ceiling.gemms(s)}


ALL = ("fwd", "dgrad", "wgrad")


def test_gemms_of_the_6_7b_and_13b_models_per_tp_rank():
    # gpt3_6.7B (h 4096, ffn 16384, vocab 50304, 32 layers, seq 2048), micro batch 1, TP1, q, k, v apart
    assert shapes(settings("gpt3_6.7B", 8)) == {
        "q_proj, k_proj, v_proj": (2048, 4096, 4096, 96, ALL),
        "out_proj": (2048, 4096, 4096, 32, ALL),
        "linear1": (2048, 16384, 4096, 32, ALL),
        "linear2": (2048, 4096, 16384, 32, ALL),
        "lm_head": (2048, 50304, 4096, 1, ALL),
    }
    # TP2 with the fused QKV: column-parallel layers split their outputs, row-parallel their inputs
    assert shapes(settings("gpt3_6.7B", 8, tp=2, fuse_attention_qkv=True, micro_batch=2)) == {
        "qkv_proj": (4096, 6144, 4096, 32, ALL),
        "out_proj": (4096, 4096, 2048, 32, ALL),
        "linear1": (4096, 8192, 4096, 32, ALL),
        "linear2": (4096, 4096, 8192, 32, ALL),
        "lm_head": (4096, 25152, 4096, 1, ALL),
    }
    # gpt3_13B (h 5120, ffn 20480, 40 layers), TP2, q, k, v apart; sequence parallelism keeps the shapes
    assert shapes(settings("gpt3_13B", 8, tp=2, sequence_parallel=True)) == {
        "q_proj, k_proj, v_proj": (2048, 2560, 5120, 120, ALL),
        "out_proj": (2048, 5120, 2560, 40, ALL),
        "linear1": (2048, 10240, 5120, 40, ALL),
        "linear2": (2048, 5120, 10240, 40, ALL),
        "lm_head": (2048, 25152, 5120, 1, ALL),
    }


@pytest.mark.parametrize("model,implied", [("gpt3_6.7B", 6_648_496_128), ("gpt3_13B", 12_840_468_480), ("gpt3_tiny", 262_144)])
@pytest.mark.parametrize("tp,fused", [(1, False), (2, True), (4, False)])
def test_the_gemms_are_six_flops_per_weight_and_token(model, implied, tp, fused):
    """Every product of every matrix once: 6 FLOPs per weight and token, over TP. The weights
    they imply are training.flops' count without the position table, the biases and the norms
    (the tied embedding counted once, as the output layer)."""
    s = settings(model, 8, tp=tp, fuse_attention_qkv=fused)
    sh, L, h, f = s.shape, s.shape.num_layers, s.shape.hidden_size, s.shape.ffn_hidden_size
    tokens = sh.seq_length  # micro batch 1
    per_token = sum(g.times(L) * g.flops for g in gpt3_ceiling.gemms(s)) / tokens
    weights = per_token * tp / 6
    assert weights == implied
    counts = flops.param_counts(sh)
    biases_and_norms = L * (4 * h + f + h + 2 * 2 * h) + 2 * h
    assert implied == counts["total"] - counts["positions"] - biases_and_norms
    assert implied == L * (4 * h * h + 2 * h * f) + sh.vocab_size * h


def _paddle_python() -> str:
    return framework_python("FB_TEST_PADDLE_PYTHON", "no paddle environment")


@pytest.mark.framework("paddle")
def test_the_gemms_are_the_built_models_layers_and_the_attention_is_causal():
    """gpt3_tiny built by PaddleNLP (q, k, v apart and fused): each GEMM is a layer of the
    model with its weight's shape (``[in, out]`` for an ``nn.Linear``, the tied embedding
    ``[vocab, hidden]``); the attention function the ceiling times (the model's own, with
    GPTModel's mask) gives causal softmax attention computed by hand."""
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path[:0] = [{str(ROOT)!r}]
        import numpy as np, paddle, yaml
        from training import shapes
        from cases.gpt3.paddle import ceiling, model as gpt3_model
        from cases.gpt3.paddle.settings import from_config
        case = shapes.complete(yaml.safe_load(open({str(CASE_DIR / "case.yaml")!r})))
        m = case["models"]["gpt3_tiny"]
        out = {{}}
        for fused in (False, True):
            s = from_config({{"case": {{"model": "gpt3_tiny"}}, "model": {{"params_nominal": m["params_nominal"], **m["shape"]}},
                             "train": {{**case["standard"]["train"], **m["train"], "micro_batch": 2}},
                             "parallel": {{**case["standard"]["parallel"], "fuse_attention_qkv": fused}}, "vendor": {{"device": "cpu"}}}}, 1)
            model = gpt3_model.build_model(s, gpt3_model.gpt_config(s, 1, 0, False))
            params = {{n: list(p.shape) for n, p in model.named_parameters()}}
            got = {{}}
            for g in ceiling.gemms(s):
                for name in g.name.split(", "):
                    key = "gpt.embeddings.word_embeddings.weight" if name == "lm_head" else f"gpt.decoder.layers.0.self_attn.{{name}}.weight"
                    if name.startswith("linear"):
                        key = f"gpt.decoder.layers.0.{{name}}.weight"
                    got[name] = [params.get(key), [g.n, g.k] if name in ceiling.OUT_IN_WEIGHTS else [g.k, g.n]]
            out[str(fused)] = got
            out["tied"] = model.lm_head.weight is model.gpt.embeddings.word_embeddings.weight
        attend, name = ceiling.attention(s, False)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((2, 128, 4, 16)).astype("float32") for _ in range(3))
        o = attend(*(paddle.to_tensor(x) for x in (q, k, v))).numpy().reshape(2, 128, 4, 16)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        scores[:, :, np.triu_indices(128, 1)[0], np.triu_indices(128, 1)[1]] = -np.inf
        w = np.exp(scores - scores.max(-1, keepdims=True))
        ref = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)
        out["attention"] = [name, float(np.abs(o - ref).max())]
        print("RESULT", json.dumps(out))
        """
    )
    res = subprocess.run([_paddle_python(), "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert set(got["False"]) == {"q_proj", "k_proj", "v_proj", "out_proj", "linear1", "linear2", "lm_head"}
    assert set(got["True"]) == {"qkv_proj", "out_proj", "linear1", "linear2", "lm_head"}
    for fused in ("False", "True"):
        for name, (model_shape, gemm_shape) in got[fused].items():
            assert model_shape == gemm_shape, (fused, name)
    assert got["tied"] is True
    name, err = got["attention"]
    assert name == "core attention (QK^T, additive -1e4 causal mask, softmax, AV)" and err < 1e-4


start = functools.partial(start_task, timeout=300, cwd=ROOT)


@pytest.mark.framework("paddle")
def test_ceiling_alone_on_the_cpu():
    base = ("--vendor", "cpu", "--python", _paddle_python(), "--ceiling")
    # TP2 (which paddle's CPU build cannot train, but times: no process group) with the fused QKV
    proc = start(
        *base, "--case_name", "gpt3_tiny:paddle:cpu:1:2", "--variant", "TP2", "--set", "parallel.fuse_attention_qkv=true", "--json"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    c = json.loads(proc.stdout)
    # gpt3_tiny: hidden 64, 4 heads of 16, ffn 256, vocab 1024, 4 layers, seq 128; TP2's micro batch 4
    assert (c["tp"], c["micro_batch"], c["seq_length"], c["layers"], c["device"], c["dtype"]) == (2, 4, 128, 4, "cpu", "float32")
    assert c["attention"] == "core attention (QK^T, additive -1e4 causal mask, softmax, AV)"
    assert {k: (v["m"], v["n"], v["k"], v["count"]) for k, v in c["parts"].items() if k != "attention"} == {
        "qkv_proj": (512, 96, 64, 4),
        "out_proj": (512, 64, 32, 4),
        "linear1": (512, 128, 64, 4),
        "linear2": (512, 64, 128, 4),
        "lm_head": (512, 512, 64, 1),
    }
    att = c["parts"]["attention"]
    assert (att["batch"], att["heads"], att["seq"], att["head_dim"], att["count"], att["causal"]) == (4, 2, 128, 16, 4, True)
    assert att["fwd_bwd_ms"] > 0 and att["kernel"] == c["attention"]
    assert all(p[f"{d}_ms"] > 0 for k, p in c["parts"].items() if k != "attention" for d in ALL)
    assert c["micro_batch_s"] == pytest.approx(c["gemm_s"] + c["attention_s"])
    assert c["tokens_per_gpu_s"] == pytest.approx(512 / (c["micro_batch_s"] * 2))
    # the table, one process, q, k, v apart
    text = start(*base, "--case_name", "gpt3_tiny:paddle:cpu:1:1")
    assert text.returncode == 0, text.stdout[-3000:] + text.stderr[-3000:]
    assert "kernel ceiling of gpt3_tiny:paddle:cpu:1:1 on cpu (TP1, micro batch 8" in text.stdout
    assert "tokens/p/s" in text.stdout and "q_proj, k_proj, v_proj 1024 x 64 x 64" in text.stdout and "x12" in text.stdout
