"""Layout-invariant starting weights of the llama3 case on megatron-core.

megatron draws each tensor-parallel shard from a per-rank stream on GPUs, and
even its CPU initialisation consumes one global stream in stage order, so two
TP / PP layouts of one case would start from different models.  Instead,
:func:`overwrite` gives every parameter of this rank's stage the value it has in
the unsharded TP1/PP1 model, from ``training.weights``: the full tensor is drawn
on the parameter's device by ``full_normal(seed, name)`` (one parameter at a
time, float32, no host round trip), and this rank keeps its shard.  The model is
built with ``perform_initialization=False`` so that megatron's own init is
skipped (modeling.transformer_config).

Layout-free names are megatron's parameter names in the TP1/PP1 model: a
decoder layer's index is its global one (``TransformerLayer.layer_number - 1``;
stage-local indices differ between pipeline layouts).

Layouts (megatron-core 0.16 and 0.19, local and TransformerEngine specs):

* ``linear_qkv``: ``[ng * (np/ng + 2) * hn, h]``, query-group major (each group's
  query heads, then its key, then its value); TP rank r holds groups
  ``r*ng/tp .. (r+1)*ng/tp - 1``, a contiguous block of rows;
* ``linear_fc1`` (SwiGLU): the full weight is ``[gate; up]`` (``2 * ffn`` rows) and
  TP rank r holds ``[gate_r; up_r]``: each half is split, then re-joined;
* ``linear_proj``, ``linear_fc2`` (row parallel): split on dim 1;
* word embeddings and the output layer (vocab parallel): split on dim 0;
* norm weights (``*layernorm.weight``, TE's ``*.layer_norm_weight``): ones, not split.

Standard deviations follow megatron's rule for this config (TransformerConfig,
0.16.1 and 0.19.2): ``init_method_std`` for the embedding, QKV, fc1 and the
output layer; ``init_method_std / sqrt(2 * num_layers)`` for the output
projections of each layer (``output_layer_init_method``: linear_proj, linear_fc2).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import torch
from megatron.core import parallel_state

from cases.llama3.megatron.settings import Settings
from training import weights
from training.accelerator import Accelerator

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A parameter's full (TP1) shape, its start (normal with ``std``, or ones) and its TP split.

    The split is megatron's (``partition_dim``, ``partition_stride``): the full tensor is
    ``stride`` blocks along ``dim`` (SwiGLU's fc1: ``[gate; up]``), and TP rank r holds the
    r-th contiguous 1/tp of each block, the blocks kept in order.
    """

    shape: tuple[int, ...]
    std: float | None  # None: ones (norm weights)
    dim: int | None  # None: replicated on every TP rank
    stride: int = 1


def rule(name: str, s: Settings) -> Rule:
    """The rule of layout-free parameter ``name``; an unknown name is an error (nothing left undrawn)."""
    sh = s.shape
    h, head_dim = sh.hidden_size, sh.hidden_size // sh.num_heads
    std, out_std = s.common.train.init_std, s.common.train.init_std / math.sqrt(2.0 * sh.num_layers)
    if name.endswith(("layernorm.weight", ".layer_norm_weight")):
        return Rule((h,), None, None)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return Rule((sh.vocab_size, h), std, 0)
    layer_rules = {
        "self_attention.linear_qkv.weight": Rule(((sh.num_heads + 2 * sh.num_kv_groups) * head_dim, h), std, 0),
        "self_attention.linear_proj.weight": Rule((h, sh.num_heads * head_dim), out_std, 1),
        "mlp.linear_fc1.weight": Rule((2 * sh.ffn_hidden_size, h), std, 0, stride=2),
        "mlp.linear_fc2.weight": Rule((h, sh.ffn_hidden_size), out_std, 1),
    }
    m = _LAYER.match(name)
    if m and name[m.end() :] in layer_rules:
        return layer_rules[name[m.end() :]]
    raise ValueError(f"startweights: no starting rule for parameter {name!r} (cases/llama3/megatron/startweights.py)")


def layout_free_names(model: torch.nn.Module) -> dict[str, str]:
    """This stage's parameter names mapped to their names in the TP1/PP1 model (global layer index)."""
    layers = model.decoder.layers
    out = {}
    for name, _ in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            name_free = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.{name[m.end() :]}"
        else:
            name_free = name
        out[name] = name_free
    return out


def tp_shard(full: torch.Tensor, r: Rule, tp_rank: int, tp: int) -> list[torch.Tensor]:
    """Rank ``tp_rank``'s shard of ``full``: one view per block, in the order they sit along
    ``r.dim`` in the local weight."""
    if r.dim is None:
        return [full]
    return [weights.shard(block, r.dim, tp_rank, tp) for block in full.chunk(r.stride, r.dim)]


def _mark_tensor_parallel(p: torch.nn.Parameter, r: Rule, name: str) -> None:
    """Set megatron's TP attributes, which megatron-core 0.16 leaves unset without its own init
    (0.19 and TE set them), or check them: grad-norm clipping and the parameter count read them."""
    if r.dim is None:
        return
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if not hasattr(p, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(p, is_parallel=True, dim=r.dim, stride=r.stride)
    elif (p.tensor_model_parallel, p.partition_dim, p.partition_stride) != (True, r.dim, r.stride):
        raise RuntimeError(
            f"startweights: megatron marks {name} tensor_model_parallel={p.tensor_model_parallel}, "
            f"partition_dim={p.partition_dim}, partition_stride={p.partition_stride}, but the case "
            f"splits it on dim {r.dim} with stride {r.stride}"
        )


@torch.no_grad()
def overwrite(model: torch.nn.Module, s: Settings) -> dict:
    """Give every parameter of this rank's stage its layout-invariant starting value.

    Call it on the bare GPTModel, before Float16Module, DDP and the optimizer copy the
    weights.  Returns this rank's parameter count, the elements drawn for it (whole tensors)
    and the seconds it took (device synchronized at both ends).
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    names = layout_free_names(model)
    device = next(model.parameters()).device
    acc = Accelerator.of(device)
    acc.synchronize(device)
    t0 = time.perf_counter()
    drawn = 0
    for local, p in model.named_parameters():
        name = names[local]
        r = rule(name, s)
        _mark_tensor_parallel(p, r, name)
        local = list(r.shape)
        if r.dim is not None:
            local[r.dim] //= tp
        if tuple(p.shape) != tuple(local):
            raise RuntimeError(
                f"startweights: {name} has shape {tuple(p.shape)} on tp rank {tp_rank} of {tp}, "
                f"but its shard of the full {r.shape} is {tuple(local)}"
            )
        if r.std is None:
            p.fill_(1.0)
            continue
        full = weights.full_normal(s.common.train.seed, name, r.shape, r.std, p.device)
        at = 0
        for block in tp_shard(full, r, tp_rank, tp):
            n = block.shape[r.dim]
            p.narrow(r.dim, at, n).copy_(block)  # float32 -> the parameter's dtype
            at += n
        drawn += full.numel()
        del full
    acc.synchronize(device)
    seconds = time.perf_counter() - t0
    acc.empty_cache()  # the float32 full tensors were transient: give their cache back
    return {"params": sum(p.numel() for p in model.parameters()), "drawn": drawn, "seconds": seconds}
