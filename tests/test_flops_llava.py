"""training.flops_llava: seed 002's MFU figures, exact parameter counts, the palm count per phase."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from training import shapes
from training.flops import mfu
from training.flops_llava import llava_flops, llava_params, palm_flops_per_token

ROOT = Path(__file__).resolve().parent.parent
CASE = shapes.complete(yaml.safe_load((ROOT / "cases" / "llava" / "deepspeed" / "case.yaml").read_text()))
LLAVA7B = CASE["models"]["llava1.5_7b"]
TINY = CASE["models"]["llava_tiny"]
A800_BF16 = 312e12


@pytest.mark.parametrize(
    "phase, tokens_per_gpu_s, seed_mfu_percent",
    [("pretrain", 4013, 18.01), ("finetune", 2937, 39.57)],  # seed 002, A800 1x8
)
def test_seed_002_mfu_is_reproduced(phase, tokens_per_gpu_s, seed_mfu_percent):
    counts = llava_flops(LLAVA7B, phase)
    got = 100 * mfu(counts["flops_per_token_6n"], tokens_per_gpu_s, A800_BF16)
    assert got == pytest.approx(seed_mfu_percent, abs=0.1)


def test_6n_convention_is_two_n_then_six_n_of_the_nominal_count():
    assert llava_flops(LLAVA7B, "pretrain")["flops_per_token_6n"] == 2 * 7e9
    assert llava_flops(LLAVA7B, "finetune")["flops_per_token_6n"] == 6 * 7e9
    # the exact count would not give the seed's pretrain figure (18.17 %, not 18.01 %)
    exact = llava_flops(LLAVA7B, "pretrain")["params_exact"]
    assert 100 * mfu(2 * exact, 4013, A800_BF16) == pytest.approx(18.17, abs=0.01)


def test_exact_parameter_counts_of_llava_1_5_7b():
    p = llava_params(LLAVA7B["shape"])
    assert p["vision"] == 303_507_456  # CLIP ViT-L/14-336 vision tower
    assert p["projector"] == 20_979_712  # 1024 -> 4096 -> 4096, with biases
    assert p["language_model"] == 6_738_939_904  # LLaMA-2 7B with llava-hf's 32064-row vocabulary
    assert p["total"] == 7_063_427_072
    vicuna = llava_params({**LLAVA7B["shape"], "vocab_size": 32000})["language_model"]
    assert vicuna == 6_738_415_616  # the published LLaMA-2 7B count
    assert llava_flops(LLAVA7B, "finetune")["params_exact"] == p["total"]
    assert llava_flops(TINY, "pretrain")["params_exact"] == 821_888


def test_palm_count_by_hand_for_7b():
    s = LLAVA7B["shape"]
    n_lm = 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096 + 32064 * 4096  # layers, final norm, lm_head
    for phase, lm_passes in (("pretrain", 4), ("finetune", 6)):
        a = s["palm_assumptions"][phase]
        t, i = a["mean_seq_length"], a["images_per_sample"]
        lm = lm_passes * n_lm + 12 * 32 * 4096 * t
        vision = 2 * 577 * 24 * (4 * 1024**2 + 2 * 1024 * 4096) + 2 * 576 * 3 * 14 * 14 * 1024 + 4 * 24 * 577**2 * 1024
        projector = 576 * (4 * (1024 * 4096 + 4096 * 4096) + 2 * 4096 * 4096)
        want = lm + i * (vision + projector) / t
        parts = palm_flops_per_token(LLAVA7B, phase)
        assert parts["total"] == pytest.approx(want, rel=1e-12)
        assert llava_flops(LLAVA7B, phase)["flops_per_token_palm"] == parts["total"]
        assert parts["language_model"] == pytest.approx(lm, rel=1e-12)


def test_palm_orders_phases_and_parts():
    pre, fine = (palm_flops_per_token(LLAVA7B, ph) for ph in ("pretrain", "finetune"))
    assert fine["total"] > pre["total"]
    # pretrain: frozen LM forward + data-grad backward; finetune adds the weight grads
    attn = 12 * 32 * 4096 * (602.4 - 598.0)  # the attention term follows each phase's mean length
    assert fine["language_model"] - pre["language_model"] == pytest.approx(2 * 6_607_605_760 + attn, rel=1e-12)
    # the vision tower runs forward only in both phases; same cost per image
    assert pre["vision"] / 1.0 == pytest.approx(fine["vision"] / 0.9 * 602.4 / 598.0, rel=1e-12)
    for p in (pre, fine):
        assert p["total"] == pytest.approx(p["language_model"] + p["vision"] + p["projector"], rel=1e-12)


def test_counter_contract():
    for model in (LLAVA7B, TINY):
        for phase in CASE["phases"]:
            c = llava_flops(model, phase)
            assert set(c) == {"params_exact", "params_nominal", "flops_per_token_6n", "flops_per_token_palm", "params_trainable"}
            assert c["params_nominal"] == float(model["params_nominal"])
            parts = llava_params(model["shape"])  # pretrain trains the projector; finetune the language model too
            assert c["params_trainable"] == parts["projector"] + (parts["language_model"] if phase == "finetune" else 0)
            assert c["flops_per_token_palm"] > 0
    with pytest.raises(ValueError, match="phase"):
        llava_flops(LLAVA7B, "train")
