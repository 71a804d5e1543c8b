"""The kernel ceiling of the DeepSpeed cases (training/ceiling.py; cases/baichuan2/deepspeed/ceiling.py,
cases/llava/deepspeed/ceiling.py).

Pure arithmetic here: the GEMM lists of baichuan2_13b and llava1.5_7b at their real shapes (exact
m, n, k, the products each phase runs, FLOPs against the parameter counters and llava's PaLM
count). Torch unit tests (in the deepspeed environment when torch is not importable here): the
generalized timing (products, counts, forward-only and full-length attention, the three input
layouts) and that each case's attention callable computes what its model computes. On the CPU, end
to end: ``start_task.py --ceiling`` alone for both tiny cases, and short runs whose results.json
carries the ceiling of each phase, measured before training.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from cases.baichuan2.deepspeed import ceiling as baichuan2_ceiling
from cases.llava.deepspeed import ceiling as llava_ceiling
from run_benchmarks import typed_results as tr
from run_benchmarks.planning.registry import ROOT
from tests.case_helpers import start_task, torch_unit
from training import ceiling, flops, flops_llava, shapes

try:
    import torch
except ImportError:  # the host's test environment: the unit tests run in the framework env instead
    torch = None

needs_torch = torch_unit(torch is not None)
BAICHUAN2 = shapes.complete(yaml.safe_load((ROOT / "cases/baichuan2/deepspeed/case.yaml").read_text()))["models"]
LLAVA = shapes.complete(yaml.safe_load((ROOT / "cases/llava/deepspeed/case.yaml").read_text()))["models"]


def by_name(gemms: list[ceiling.Gemm]) -> dict[str, ceiling.Gemm]:
    return {g.name: g for g in gemms}


def per_micro_batch(gemms: list[ceiling.Gemm], num_layers: int = 0) -> float:
    return sum(g.times(num_layers) * g.flops for g in gemms)


# --------------------------------------------------------------------------- arithmetic


def test_baichuan2_13b_gemms_are_its_linear_layers():
    shape = BAICHUAN2["baichuan2_13b"]["shape"]
    g = by_name(baichuan2_ceiling.gemms(shape, micro_batch=1))
    assert {n: (x.m, x.n, x.k, x.per_layer, x.products) for n, x in g.items()} == {
        "W_pack": (2048, 15360, 5120, True, ceiling.PRODUCTS),
        "o_proj": (2048, 5120, 5120, True, ceiling.PRODUCTS),
        "gate_proj": (2048, 13696, 5120, True, ceiling.PRODUCTS),
        "up_proj": (2048, 13696, 5120, True, ceiling.PRODUCTS),
        "down_proj": (2048, 5120, 13696, True, ceiling.PRODUCTS),
        "lm_head": (2048, 125696, 5120, False, ceiling.PRODUCTS),
    }
    assert g["W_pack"].flops == 3 * 2 * 2048 * 15360 * 5120
    # every product of every linear layer: 6 FLOPs per weight and token; the weights are the
    # model's 13,896,668,160 less the embedding and the 81 RMSNorm weights
    linear = 13_896_668_160 - 125696 * 5120 - 81 * 5120
    assert decoder_flops_params(shape) == 13_896_668_160
    assert per_micro_batch(list(g.values()), 40) == 6 * 2048 * linear
    assert by_name(baichuan2_ceiling.gemms(shape, micro_batch=4))["lm_head"].m == 4 * 2048
    # its attention: causal, 40 heads of 128, forward + backward
    assert ceiling.attention_flops(1, 40, 2048, 128) == 3.5 * 2 * 40 * 2048**2 * 128 == ceiling.causal_attention_flops(1, 40, 2048, 128)


def decoder_flops_params(shape: dict) -> int:
    return flops.decoder_flops({"shape": shape, "params_nominal": 13e9})["params_exact"]


LLAVA_7B = LLAVA["llava1.5_7b"]["shape"]
LM = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def llava_expected(tokens: int, images: int) -> dict[str, tuple[int, int, int, int]]:
    """m, n, k and count of every llava1.5_7b GEMM (count 1: once a micro batch)."""
    rows, image_tokens = images * 577, images * 576
    return {
        "lm.q_proj": (tokens, 4096, 4096, 32),
        "lm.k_proj": (tokens, 4096, 4096, 32),
        "lm.v_proj": (tokens, 4096, 4096, 32),
        "lm.o_proj": (tokens, 4096, 4096, 32),
        "lm.gate_proj": (tokens, 11008, 4096, 32),
        "lm.up_proj": (tokens, 11008, 4096, 32),
        "lm.down_proj": (tokens, 4096, 11008, 32),
        "lm.lm_head": (tokens, 32064, 4096, 1),
        "vision.patch_embedding": (image_tokens, 1024, 3 * 14 * 14, 1),
        "vision.q_proj": (rows, 1024, 1024, 24),
        "vision.k_proj": (rows, 1024, 1024, 24),
        "vision.v_proj": (rows, 1024, 1024, 24),
        "vision.out_proj": (rows, 1024, 1024, 24),
        "vision.fc1": (rows, 4096, 1024, 24),
        "vision.fc2": (rows, 1024, 4096, 24),
        "projector.linear_1": (image_tokens, 4096, 1024, 1),
        "projector.linear_2": (image_tokens, 4096, 4096, 1),
    }


@pytest.mark.parametrize(
    ("phase", "micro_batch", "tokens", "images"),
    [("pretrain", 32, 32 * 598, 32), ("finetune", 16, 16 * 602, 14)],  # 602.4 -> 602; 16 x 0.9 images -> 14
)
def test_llava_7b_gemms_per_phase(phase, micro_batch, tokens, images):
    g = by_name(llava_ceiling.gemms(LLAVA_7B, phase, micro_batch))
    assert {n: (x.m, x.n, x.k, x.times(0)) for n, x in g.items()} == llava_expected(tokens, images)
    lm_products = ("fwd", "dgrad") if phase == "pretrain" else ("fwd", "dgrad", "wgrad")
    for name, x in g.items():
        if name.startswith("lm."):
            # pretrain: the frozen language model passes the gradient on to the image tokens, no weight-gradient
            assert x.products == lm_products, name
            assert ("wgrad" in x.products) == (phase == "finetune")
        elif name.startswith("vision."):
            assert x.products == ("fwd",), name  # frozen, fed by data: forward only
    assert g["projector.linear_1"].products == ("fwd", "wgrad")  # its input needs no gradient
    assert g["projector.linear_2"].products == ceiling.PRODUCTS
    mb = llava_ceiling.micro_batch_shape(LLAVA_7B, phase, micro_batch)
    assert (mb["seq_length"], mb["tokens"], mb["images"], mb["vision_seq"]) == (tokens // micro_batch, tokens, images, 577)


@pytest.mark.parametrize("phase", ["pretrain", "finetune"])
def test_llava_ceiling_counts_what_the_palm_count_counts(phase):
    """With whole-number assumptions, the GEMMs and the vision tower's attention of one micro batch
    are training/flops_llava.py's PaLM count of its tokens, less what the ceiling counts otherwise
    (the language model's attention: causal, with the backward at 2.5 x the forward) or not at all
    (the RMSNorm weights, which PaLM's count takes as matmul parameters)."""
    model = copy.deepcopy(LLAVA["llava1.5_7b"])
    shape = model["shape"]
    shape["palm_assumptions"][phase] = {"mean_seq_length": 600.0, "images_per_sample": 0.75}  # 16 x 0.75 = 12 images
    b, t, images, layers, h = 16, 600, 12, 32, 4096
    gemms = llava_ceiling.gemms(shape, phase, b)
    vision_attention = 24 * ceiling.attention_flops(images, 16, 577, 64, causal=False, backward=False)
    palm = flops_llava.palm_flops_per_token(model, phase)["total"] * b * t
    lm_attention = 3 * 4 * layers * h * t * b * t
    norms = (4 if phase == "pretrain" else 6) * (2 * layers + 1) * h * b * t
    assert per_micro_batch(gemms) + vision_attention == pytest.approx(palm - lm_attention - norms, rel=1e-12)


def test_llava_images_follow_the_assumption_and_bad_assumptions_are_named():
    shape = copy.deepcopy(LLAVA_7B)
    shape["palm_assumptions"]["finetune"]["images_per_sample"] = 0.0
    names = {g.name for g in llava_ceiling.gemms(shape, "finetune", 16)}
    assert names == {f"lm.{n}" for n in LM}  # no images: no vision tower, no projector
    del shape["palm_assumptions"]["pretrain"]
    with pytest.raises(ValueError, match="palm_assumptions.pretrain"):
        llava_ceiling.gemms(shape, "pretrain", 32)
    shape["palm_assumptions"]["finetune"]["mean_seq_length"] = 4096.0
    with pytest.raises(ValueError, match="mean_seq_length 4096.0 must be in 1..seq_length 2048"):
        llava_ceiling.gemms(shape, "finetune", 16)
    with pytest.raises(ValueError, match="products"):
        ceiling.Gemm("x", 1, 1, 1, products=("fwd", "bwd"))
    with pytest.raises(ValueError, match="layout"):
        ceiling.Attention("a", lambda q, k, v: q, "k", 1, 1, 1, 1, 1, count=1, layout="bhsd")


# --------------------------------------------------------------------------- torch units


@needs_torch
def test_measure_parts_times_only_the_products_that_run():
    cpu = torch.device("cpu")
    attend = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    gemms = [
        ceiling.Gemm("frozen", 64, 32, 16, products=("fwd", "dgrad"), count=3),
        ceiling.Gemm("fed", 64, 32, 16, products=("fwd",), per_layer=False),
        ceiling.Gemm("trained", 64, 32, 16),
    ]
    blocks = [
        ceiling.Attention("causal", attend, "sdpa", 2, 4, 2, 16, 8, count=3, layout="bshd"),
        ceiling.Attention("full", attend, "sdpa", 3, 4, 4, 9, 8, count=2, causal=False, backward=False, layout="bs3hd"),
    ]
    c = ceiling.measure_parts(gemms, blocks, tokens=32, tp=1, dtype=torch.float32, device=cpu, num_layers=5, repeat=1, about={"x": 1})
    p = c["parts"]
    assert set(p["frozen"]) >= {"fwd_ms", "dgrad_ms"} and "wgrad_ms" not in p["frozen"] and p["frozen"]["count"] == 3
    assert "dgrad_ms" not in p["fed"] and p["fed"]["count"] == 1 and p["trained"]["count"] == 5
    assert p["frozen"]["products"] == ["fwd", "dgrad"]
    assert "fwd_bwd_ms" in p["causal"] and "fwd_ms" in p["full"] and "fwd_bwd_ms" not in p["full"]
    assert (p["full"]["causal"], p["full"]["backward"], p["full"]["batch"], p["full"]["seq"]) == (False, False, 3, 9)
    gemm_s = sum(v["count"] * sum(v[f"{x}_ms"] for x in v["products"]) for k, v in p.items() if "products" in v) / 1e3
    att_s = (3 * p["causal"]["fwd_bwd_ms"] + 2 * p["full"]["fwd_ms"]) / 1e3
    # the parts' milliseconds are rounded to 4 places
    assert c["gemm_s"] == pytest.approx(gemm_s, abs=2e-6) and c["attention_s"] == pytest.approx(att_s, abs=1e-6)
    assert c["tokens_per_gpu_s"] == pytest.approx(32 / c["micro_batch_s"]) and c["x"] == 1 and c["tokens_per_micro_batch"] == 32
    with pytest.raises(ValueError, match="repeat"):
        ceiling.measure_parts(gemms[:1] * 2, [], tokens=1, tp=1, dtype=torch.float32, device=cpu)
    # the CPU tells no SM clock: none recorded
    assert "sm_clock_mhz" not in c and not any("sm_clock_mhz" in v for v in p.values())
    from training.accelerator import Accelerator

    assert Accelerator({"device": "cpu"}).sm_clock_mhz(cpu) is None
    # a device that tells (no GPU here: the clock answers from a list standing in for NVML's reading):
    # each part records the clock read as its timing ended, the ceiling their median
    readings = iter([1980.0, 1965.0, 1500.0, 1980.0, 1410.0])
    timers = dataclasses.replace(ceiling.torch_timers(cpu), clock_mhz=lambda _device: next(readings))
    c = ceiling.measure_parts(gemms, blocks, tokens=32, tp=1, dtype=torch.float32, device=cpu, num_layers=5, repeat=1, timers=timers)
    assert [c["parts"][n]["sm_clock_mhz"] for n in ("frozen", "fed", "trained", "causal", "full")] == [
        1980.0,
        1965.0,
        1500.0,
        1980.0,
        1410.0,
    ]
    assert c["sm_clock_mhz"] == 1965.0


@needs_torch
@pytest.mark.parametrize("layout", ceiling.LAYOUTS)
def test_attention_inputs_reach_the_kernel_in_their_layout(layout):
    seen = []

    grads = []

    def attend(q, k, v):
        seen.append((q.shape, k.shape, q.is_contiguous(), q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.register_hook(grads.append)
        return out

    block = ceiling.Attention("a", attend, "sdpa", 2, 4, 4, 8, 16, count=1, layout=layout)
    ceiling.time_attention(block, torch.float32, torch.device("cpu"), warmup=0, repeat=1, trials=1)
    q_shape, k_shape, contiguous, packed = seen[0]
    assert q_shape == k_shape == (2, 4, 8, 16) and not contiguous  # views, as the layers hand them
    assert packed == (layout == "bs3hd")  # q, k and v of one packed projection
    # the output's gradient comes back as a layer's output projection hands it: contiguous in the
    # token-major layout ([s, b, heads, d] for sbhd, [b, s, heads, d] otherwise), not in [b, heads, s, d]
    token_major = (2, 0, 1, 3) if layout == "sbhd" else (0, 2, 1, 3)
    assert grads and grads[0].permute(*token_major).is_contiguous() and not grads[0].is_contiguous()


@needs_torch
def test_baichuan2_attention_is_the_models():
    """The ceiling's ``sdpa`` call with the model's mask gives what the model's attention layer
    computes between its projections; ``flex`` is model.py's FlexAttention call with its ALiBi
    score modification (compiled: its equality with sdpa is test_baichuan2_perf_switches.py's)."""
    from cases.baichuan2.deepspeed import model

    cfg = model.Baichuan2Config(num_layers=1, hidden_size=40, num_heads=5, ffn_hidden_size=64, vocab_size=64)
    torch.manual_seed(0)
    layer = model.Attention(cfg).eval()
    x = torch.randn(2, 24, 40)
    full = model.Baichuan2ForCausalLM(cfg)
    with torch.no_grad():
        expected = layer(x, full.alibi_mask(24, x.dtype, x.device))
        q, k, v = layer.W_pack(x).view(2, 24, 3, 5, 8).permute(2, 0, 3, 1, 4).unbind(0)
        attend, name = baichuan2_ceiling.attention("sdpa", 5, 24, x.dtype, x.device)
        got = layer.o_proj(attend(q, k, v).transpose(1, 2).reshape(2, 24, 40))
    torch.testing.assert_close(got, expected)
    assert name == "sdpa, ALiBi + causal additive mask"
    assert baichuan2_ceiling.attention("flex", 5, 24, x.dtype, x.device)[1] == "flex, ALiBi score_mod + causal block mask"


@needs_torch
def test_llava_attention_is_transformers_sdpa_causal_or_full():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    for causal in (True, False):
        got = llava_ceiling.sdpa(LLAVA["llava_tiny"]["shape"], 4, 4, 8, causal)(q, k, v)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
        torch.testing.assert_close(got, want)  # [b, s, heads, d], as transformers' layers take it back


@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env(deepspeed_units):
    deepspeed_units.of(__file__)  # some passed, none failed


# --------------------------------------------------------------------------- on the CPU, end to end


@pytest.mark.framework("deepspeed")
def test_baichuan2_ceiling_alone_on_the_cpu(deepspeed_python):
    base = ("--vendor", "cpu", "--case_name", "baichuan2_tiny:deepspeed:cpu:1:2", "--python", deepspeed_python, "--ceiling")
    proc = start_task(*base, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    c = json.loads(proc.stdout)
    # baichuan2_tiny: hidden 160, 10 heads of 16, ffn 432, vocab 2048, 4 layers, seq 128, micro batch 4
    assert (c["tp"], c["micro_batch"], c["seq_length"], c["layers"], c["device"]) == (1, 4, 128, 4, "cpu")
    assert c["attention"] == "sdpa, ALiBi + causal additive mask"
    assert {k: (v["m"], v["n"], v["k"], v["count"]) for k, v in c["parts"].items() if k != "attention"} == {
        "W_pack": (512, 480, 160, 4),
        "o_proj": (512, 160, 160, 4),
        "gate_proj": (512, 432, 160, 4),
        "up_proj": (512, 432, 160, 4),
        "down_proj": (512, 160, 432, 4),
        "lm_head": (512, 2048, 160, 1),
    }
    att = c["parts"]["attention"]
    assert (att["batch"], att["heads"], att["seq"], att["head_dim"], att["causal"], att["count"]) == (4, 10, 128, 16, True, 4)
    assert att["fwd_bwd_ms"] > 0 and c["tokens_per_gpu_s"] == pytest.approx(512 / c["micro_batch_s"])
    text = start_task(*base)
    assert text.returncode == 0 and "tokens/p/s" in text.stdout and "W_pack" in text.stdout, text.stdout + text.stderr


@pytest.mark.framework("deepspeed")
def test_llava_ceiling_alone_per_phase_on_the_cpu(deepspeed_python):
    base = ("--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2", "--python", deepspeed_python, "--ceiling")
    proc = start_task(*base, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    both = json.loads(proc.stdout)
    assert list(both) == ["pretrain", "finetune"]
    # llava_tiny: micro batch 8 in both phases; mean lengths 38 and 94.5 (-> 94), 8 x 1.0 and 8 x 0.9 (-> 7) images
    for phase, length, images in (("pretrain", 38, 8), ("finetune", 94, 7)):
        c = both[phase]
        assert (c["phase"], c["micro_batch"], c["seq_length"], c["images_per_micro_batch"]) == (phase, 8, length, images)
        assert c["seq_length_source"] == f"palm_assumptions.{phase}.mean_seq_length"
        p = c["parts"]
        assert (p["lm.q_proj"]["m"], p["vision.fc1"]["m"], p["projector.linear_2"]["m"]) == (8 * length, images * 17, images * 16)
        lm_wgrad = [("wgrad_ms" in v) for k, v in p.items() if k.startswith("lm.") and k != "lm.attention"]
        assert lm_wgrad == [phase == "finetune"] * 8  # pretrain: the frozen language model runs no weight-gradient
        assert all(set(v["products"]) == {"fwd"} for k, v in p.items() if k.startswith("vision.") and k != "vision.attention")
        assert "fwd_bwd_ms" in p["lm.attention"] and p["lm.attention"]["causal"]
        assert "fwd_ms" in p["vision.attention"] and not p["vision.attention"]["causal"] and p["vision.attention"]["seq"] == 17
        assert c["tokens_per_gpu_s"] == pytest.approx(8 * length / c["micro_batch_s"])
    text = start_task(*base)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "phase pretrain" in text.stdout and "phase finetune" in text.stdout and "(forward only)" in text.stdout


def assert_llava_ceilings(run_dir: Path) -> None:
    """A llava_tiny round's results.json (a run of tests/test_llava_case.py): each phase carries
    the ceiling its ranks measured, at its own length, and its efficiency against it."""
    res = tr.load(run_dir / "results.json")
    phases = res.rounds[0].phases
    assert [p.phase for p in phases] == ["pretrain", "finetune"]
    raw = {p["phase"]: p for p in json.loads((run_dir / "results.json").read_text())["rounds"][0]["phases"]}
    for p, length in zip(phases, (38, 94), strict=True):
        c = p.meta["kernel_ceiling"]
        assert (c["phase"], c["seq_length"], c["device"], c["tp"]) == (p.phase, length, "cpu", 1) and c["tokens_per_gpu_s"] > 0
        assert ("wgrad_ms" in c["parts"]["lm.lm_head"]) == (p.phase == "finetune")
        assert p.ceiling_tokens_per_gpu_s == c["tokens_per_gpu_s"]
        assert p.ceiling_efficiency == pytest.approx(p.tokens_per_gpu_s / c["tokens_per_gpu_s"])
        assert raw[p.phase]["ceiling_efficiency"] == pytest.approx(p.ceiling_efficiency)
    assert phases[0].meta["kernel_ceiling"]["tokens_per_gpu_s"] != phases[1].meta["kernel_ceiling"]["tokens_per_gpu_s"]
    assert "of ceiling" in (run_dir / "results.md").read_text()


def assert_baichuan2_ceiling(run_dir: Path) -> None:
    """A baichuan2_tiny round on 2 processes (tests/test_baichuan2_run.py): its phase carries
    the ceiling of its micro batch and its efficiency against it."""
    (p,) = tr.load(run_dir / "results.json").rounds[0].phases
    c = p.meta["kernel_ceiling"]
    assert (c["micro_batch"], c["seq_length"], c["layers"], c["device"]) == (4, 128, 4, "cpu")
    assert p.ceiling_efficiency == pytest.approx(p.tokens_per_gpu_s / c["tokens_per_gpu_s"])
