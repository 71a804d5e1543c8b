"""Mixture-of-experts models in the FLOPs and memory counters (training/flops.py,
training/memory.py): 6N and PaLM FLOPs count the parameters a token passes (the router and
top-k experts), memory counts every expert."""

from __future__ import annotations

import pytest

from training import flops, shapes
from training.memory import megatron_states

# Mixtral 8x7B's published shape: 46.7e9 parameters, 12.9e9 active per token
MIXTRAL = dict(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_groups=8,
    seq_length=4096,
    vocab_size=32000,
    ffn_hidden_size=14336,
    num_experts=8,
    moe_top_k=2,
)
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=128, ffn_hidden_size=96, num_experts=4, moe_top_k=1)


def test_mixtral_counts_all_and_active_parameters():
    c = flops.param_counts(shapes.ModelShape(**MIXTRAL))
    assert round(c["total"] / 1e9, 1) == 46.7 and round(c["active"] / 1e9, 1) == 12.9
    expert = 3 * 4096 * 14336  # one SwiGLU expert
    assert c["experts"] == 32 * 8 * expert and c["total"] - c["active"] == 32 * 6 * expert


def test_experts_by_hand():
    c = flops.param_counts(shapes.ModelShape(**TINY))
    dense = flops.param_counts(shapes.ModelShape(**{**TINY, "num_experts": 0, "moe_top_k": 0}))
    expert = 3 * 64 * 96
    router = 64 * 4
    assert c["per_layer"] == dense["per_layer"] - expert + router + 4 * expert
    assert c["active"] == dense["total"] + 2 * router  # one expert a token: the dense model plus the routers
    assert dense["active"] == dense["total"] and dense["experts"] == 0
    narrow = flops.param_counts(shapes.ModelShape(**{**TINY, "moe_ffn_hidden_size": 48}))
    assert narrow["experts"] == 2 * 4 * 3 * 64 * 48


def test_flops_count_active_parameters():
    model = {"params_nominal": 46.7e9, "shape": MIXTRAL}
    counts = flops.decoder_flops(model)
    c = flops.param_counts(shapes.ModelShape(**MIXTRAL))
    assert counts["params_exact"] == c["total"] and counts["params_active"] == c["active"]
    assert counts["flops_per_token_6n"] == 6 * c["active"]  # not 6 x 46.7e9
    attention = flops.attention_flops_per_token_palm(32, 32, 128, 4096)
    assert counts["flops_per_token_palm"] == 6 * c["non_embedding_active"] + attention
    named = flops.decoder_flops({**model, "params_active_nominal": 12.9e9})
    assert named["flops_per_token_6n"] == 6 * 12.9e9
    dense = flops.decoder_flops({"params_nominal": 8e9, "shape": {**MIXTRAL, "num_experts": 0}})
    assert dense["flops_per_token_6n"] == 6 * 8e9 and "params_active" not in dense


def test_top_k_is_checked():
    with pytest.raises(ValueError, match="moe_top_k must be 1..num_experts"):
        shapes.ModelShape(**{**TINY, "moe_top_k": 5})


def test_memory_holds_every_expert_split_over_expert_parallel_ranks():
    counts = flops.decoder_flops({"params_nominal": 46.7e9, "shape": MIXTRAL})
    p, e = counts["params_exact"], counts["params_experts"]
    one = megatron_states(counts, {"tp": 1, "pp": 1}, 1, 1)
    assert one["device_bytes"] == 18 * p  # all parameters, not the active ones
    # 8 ranks, EP4: dense part sharded over 8 data-parallel ranks, experts held by a quarter
    # of the ranks each and their optimizer states sharded over the 2 that hold the same ones
    ep = megatron_states(counts, {"tp": 1, "pp": 1, "ep": 4}, 8, 8)
    dense = p - e
    assert ep["device_bytes"] == pytest.approx(6 * dense + 12 * dense / 8 + 6 * e / 4 + 12 * e / 4 / 2)
    assert "EP4" in ep["basis"]
