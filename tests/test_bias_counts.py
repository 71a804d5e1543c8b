"""Linear biases of some projections only in the FLOPs counter (training/flops.py): Qwen2 has
biases on q, k and v alone; GPT-3 on every linear (``bias: true``)."""

from __future__ import annotations

import pytest

from training import flops, shapes

# Qwen2-7B's published shape (its config.json): 7,615,616,512 parameters, untied output layer
QWEN2_7B = dict(
    num_layers=28,
    hidden_size=3584,
    num_heads=28,
    num_kv_groups=4,
    seq_length=32768,
    vocab_size=152064,
    ffn_hidden_size=18944,
    bias=["q", "k", "v"],
)


def test_qwen2_counts_its_query_key_value_biases():
    c = flops.param_counts(flops.decoder_shape(QWEN2_7B))
    assert c["total"] == 7_615_616_512
    without = flops.param_counts(flops.decoder_shape({**QWEN2_7B, "bias": False}))
    assert c["total"] - without["total"] == 28 * (3584 + 2 * 512)  # q, then k and v at the KV width


def test_every_linear_biased_is_the_same_as_naming_them_all():
    shape = {**QWEN2_7B, "num_layers": 2}
    every = flops.param_counts(flops.decoder_shape({**shape, "bias": True}))
    named = flops.param_counts(flops.decoder_shape({**shape, "bias": list(shapes.BIASED)}))
    assert every == named
    o_only = flops.param_counts(flops.decoder_shape({**shape, "bias": ["o"]}))
    assert o_only["per_layer"] - flops.param_counts(flops.decoder_shape({**shape, "bias": False}))["per_layer"] == 3584


@pytest.mark.parametrize("bad", [["qkv"], [], "q"])
def test_an_unknown_projection_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="bias: true, false or a list of q, k, v, o, mlp"):
        flops.decoder_shape({**QWEN2_7B, "bias": bad})
