"""Layout-invariant starting weights of PaddleNLP's GPT (training/weights.py's rule).

PaddleNLP initialises its GPT per layout: paddle's global generator for
replicated parameters, an RNG tracker stream per TP rank for TP-split ones,
and ``paddle.seed(1234 + layer index)`` per pipeline layer. So TP, PP and
plain layouts of one seed start from different models. Here every parameter
of the built model is overwritten with its value in the unsharded,
single-stage ``GPTForCausalLM``:

* the layout-free name is the parameter's name in that model
  (``gpt.decoder.layers.<global index>.linear1.weight``); pipeline names
  (``3.linear1.weight``, ``shared_layers.gpt_shared_weight.weight``) are mapped
  to it;
* the full value follows PaddleNLP's init rule (``GPTPretrainedModel._init_weights``):
  N(0, init_std) for the embeddings and linear weights, N(0, init_std / sqrt(2 L))
  for the two output projections of each block (``out_proj``, ``linear2``),
  zeros for biases, ones / zeros for LayerNorm weight / bias;
* a normal draw comes from the device's own generator seeded with
  ``stream_seed(seed, layout-free name)``, the full tensor on the device, of
  which a TP rank keeps its contiguous slice (column-parallel: the output
  axis, row-parallel and the vocabulary-parallel embedding / LM head: axis 0);
* the fused QKV weight (``fuse_attention_qkv``) is the q, k and v weights of
  the unfused model interleaved per head as PaddleNLP's fused attention reads
  it, so the fused and the unfused model are the same function.

The device's generator state is restored afterwards, so the dropout streams
(``paddle.seed`` and the RNG tracker in train.py) are as without this step.
Values drawn on a CPU and a GPU differ (different generators); on one device
type they depend on the seed and the name only.
"""

from __future__ import annotations

import math
import re
from typing import Any

from cases.gpt3.paddle.settings import Settings
from training.shapes import ModelShape
from training.weights import stream_seed

_LAYER = re.compile(r"gpt\.decoder\.layers\.(\d+)\.(.+)")
#: pipeline layer (GPTForCausalLMPipe) -> name in the single-stage model
_PIPE_SHARED = {
    "shared_layers.gpt_shared_weight.word_embeddings.weight": "gpt.embeddings.word_embeddings.weight",
    "shared_layers.gpt_shared_weight.position_embeddings.weight": "gpt.embeddings.position_embeddings.weight",
    # the LM head on a last stage that does not hold the embedding: the tied token table
    "shared_layers.gpt_shared_weight.weight": "gpt.embeddings.word_embeddings.weight",
}


def layout_free_name(name: str, pipe_prefixes: dict[str, str] | None) -> str:
    """The name of parameter ``name`` in the unsharded single-stage model.

    ``pipe_prefixes``: ``GPTForCausalLMPipe.get_sequential_name_prefixes()`` (global
    layer index -> single-model prefix), or None for ``GPTForCausalLM``."""
    if pipe_prefixes is None:
        return name
    if name in _PIPE_SHARED:
        return _PIPE_SHARED[name]
    index, _, rest = name.partition(".")
    if index not in pipe_prefixes or not rest:
        raise RuntimeError(f"pipeline parameter {name!r}: no single-model name for it (prefixes {sorted(pipe_prefixes)})")
    return f"{pipe_prefixes[index]}.{rest}"


def rule(lf_name: str, sh: ModelShape, init_std: float) -> tuple[str, tuple[int, ...], float]:
    """``(kind, full shape, value)`` of a layout-free name: kind ``normal`` (value = std),
    ``qkv`` (the fused weight, value = std), or ``const`` (value = the constant)."""
    h, f, L = sh.hidden_size, sh.ffn_hidden_size, sh.num_layers
    top = {
        "gpt.embeddings.word_embeddings.weight": ("normal", (sh.vocab_size, h), init_std),
        "gpt.embeddings.position_embeddings.weight": ("normal", (sh.seq_length, h), init_std),
        "gpt.decoder.norm.weight": ("const", (h,), 1.0),
        "gpt.decoder.norm.bias": ("const", (h,), 0.0),
    }
    if lf_name in top:
        return top[lf_name]
    m = _LAYER.fullmatch(lf_name)
    if m and int(m.group(1)) < L:
        scaled = init_std / math.sqrt(2 * L)  # PaddleNLP scales the block's two output projections
        per_layer = {
            "self_attn.q_proj.weight": ("normal", (h, h), init_std),
            "self_attn.k_proj.weight": ("normal", (h, h), init_std),
            "self_attn.v_proj.weight": ("normal", (h, h), init_std),
            "self_attn.qkv_proj.weight": ("qkv", (h, 3 * h), init_std),
            "self_attn.out_proj.weight": ("normal", (h, h), scaled),
            "linear1.weight": ("normal", (h, f), init_std),
            "linear2.weight": ("normal", (f, h), scaled),
            "self_attn.q_proj.bias": ("const", (h,), 0.0),
            "self_attn.k_proj.bias": ("const", (h,), 0.0),
            "self_attn.v_proj.bias": ("const", (h,), 0.0),
            "self_attn.qkv_proj.bias": ("const", (3 * h,), 0.0),
            "self_attn.out_proj.bias": ("const", (h,), 0.0),
            "linear1.bias": ("const", (f,), 0.0),
            "linear2.bias": ("const", (h,), 0.0),
            "norm1.weight": ("const", (h,), 1.0),
            "norm1.bias": ("const", (h,), 0.0),
            "norm2.weight": ("const", (h,), 1.0),
            "norm2.bias": ("const", (h,), 0.0),
        }
        if m.group(2) in per_layer:
            return per_layer[m.group(2)]
    raise RuntimeError(f"parameter {lf_name!r}: no initialisation rule for it in gpt3_weights.rule ({L} layers)")


def shard_slice(lf_name: str, full: tuple[int, ...], local: tuple[int, ...], tp_rank: int, tp: int) -> tuple[int, int, int] | None:
    """``(axis, start, stop)`` of this TP rank's part of the full tensor, or None when it holds all of it."""
    if tuple(local) == tuple(full):
        return None
    axes = [a for a, (n, m) in enumerate(zip(full, local)) if n != m]
    if len(full) != len(local) or len(axes) != 1 or local[axes[0]] * tp != full[axes[0]]:
        raise RuntimeError(f"parameter {lf_name!r} has shape {list(local)}: not the full shape {list(full)} nor a 1/{tp} TP shard of it")
    a = axes[0]
    return a, tp_rank * local[a], (tp_rank + 1) * local[a]


def _generator() -> Any:
    """The generator paddle's random ops use on the current device."""
    import paddle
    from paddle.base import core

    dev = paddle.get_device()
    if dev == "cpu":
        return core.default_cpu_generator()
    if dev.startswith("gpu:"):
        return core.default_cuda_generator(int(dev.split(":")[1]))
    raise RuntimeError(f"gpt3_weights: no generator for paddle device {dev!r} (the case runs on cpu or gpu)")


def _normal(gen: Any, seed: int, name: str, shape: tuple[int, ...], std: float) -> Any:
    import paddle

    gen.manual_seed(stream_seed(seed, name))
    return paddle.normal(0.0, std, list(shape))


def full_value(gen: Any, seed: int, lf_name: str, kind: str, shape: tuple[int, ...], std: float, heads: int) -> Any:
    """The full float32 tensor of a drawn parameter (kind ``normal`` or ``qkv``) on the device."""
    import paddle

    if kind == "normal":
        return _normal(gen, seed, lf_name, shape, std)
    # qkv: [h, 3h], columns per head [q | k | v] (how PaddleNLP's _fuse_prepare_qkv splits
    # them): the unfused model's q, k and v weights, each from its own stream, interleaved
    h = shape[0]
    base = lf_name[: -len("qkv_proj.weight")]
    parts = [_normal(gen, seed, f"{base}{p}_proj.weight", (h, h), std).reshape([h, heads, h // heads]) for p in "qkv"]
    return paddle.stack(parts, axis=2).reshape([h, 3 * h])


def init_weights(model: Any, s: Settings, tp_rank: int) -> int:
    """Overwrite every parameter of ``model`` with its layout-invariant starting value
    (this TP rank's shard of it); return how many tensors were set."""
    import paddle

    tp = s.layout.tp
    prefixes = model.get_sequential_name_prefixes() if s.layout.pp > 1 else None
    gen = _generator()
    saved = gen.get_state()
    count = 0
    try:
        with paddle.no_grad():
            for name, p in model.named_parameters():
                lf = layout_free_name(name, prefixes)
                kind, full, value = rule(lf, s.shape, s.common.train.init_std)
                cut = shard_slice(lf, full, tuple(p.shape), tp_rank, tp)
                if kind == "const":
                    local = paddle.full(list(p.shape), value, dtype="float32")
                else:
                    t = full_value(gen, s.common.train.seed, lf, kind, full, value, s.shape.num_heads)
                    local = t if cut is None else paddle.slice(t, axes=[cut[0]], starts=[cut[1]], ends=[cut[2]])
                p.set_value(local.astype(p.dtype))
                count += 1
    finally:
        gen.set_state(saved)
    return count
