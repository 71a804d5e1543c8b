"""The kernel ceiling of baichuan2/deepspeed (training/ceiling.py).

ZeRO-3 data parallelism keeps every layer whole on every GPU (tp 1), so one GPU's micro
batch of ``train.micro_batch`` sequences of ``seq_length`` tokens runs, per decoder layer,
the model's own linear layers (model.py): ``W_pack`` (the fused q, k, v projection,
hidden -> 3 hidden), ``o_proj``, ``gate_proj`` and ``up_proj`` (hidden -> ffn each) and
``down_proj``, and once the NormHead output layer ``lm_head`` (hidden -> vocabulary; its
rows' normalization is elementwise, left out), each with its forward, data-gradient and
weight-gradient product; and the causal ALiBi attention, forward and backward, with the
kernel ``parallel.attention`` picks:

- ``sdpa``: ``scaled_dot_product_attention`` with the ALiBi bias and the causal mask as one
  additive mask, made by model.py's ``alibi_causal_mask``, the call ``Attention.forward``
  makes;
- ``flex``: model.py's ``flex_attention`` (compiled FlexAttention) with the score
  modification and block mask of its ``flex_alibi``.

Query, key and value reach the kernel as views of one ``[b, s, 3, heads, d]`` tensor, as
``W_pack``'s output does. Recompute (``parallel.recompute``) is left out: the ceiling counts
a step's own kernels once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from training import ceiling
from training.metriclog import MetricLogger

if TYPE_CHECKING:
    import torch

    from cases.baichuan2.deepspeed.settings import Settings
    from training.accelerator import Accelerator

PHASE = "train"


def gemms(shape: dict[str, Any], micro_batch: int) -> list[ceiling.Gemm]:
    """One micro batch's linear layers (every product of each), by model.py's names."""
    h, f, v = int(shape["hidden_size"]), int(shape["ffn_hidden_size"]), int(shape["vocab_size"])
    tokens = micro_batch * int(shape["seq_length"])
    return [
        ceiling.Gemm("W_pack", tokens, 3 * h, h),
        ceiling.Gemm("o_proj", tokens, h, h),
        ceiling.Gemm("gate_proj", tokens, f, h),
        ceiling.Gemm("up_proj", tokens, f, h),
        ceiling.Gemm("down_proj", tokens, h, f),
        ceiling.Gemm("lm_head", tokens, v, h, per_layer=False),
    ]


def attention(kind: str, heads: int, seq: int, dtype: torch.dtype, device: torch.device) -> tuple[Any, str]:
    """The case's attention call for ``parallel.attention`` ``kind`` and its name (the one
    run_meta's ``attention`` gives), its mask or block mask made once, as the model caches it."""
    import torch.nn.functional as F

    from cases.baichuan2.deepspeed import model

    if kind == "flex":
        bias = model.flex_alibi(heads, seq, device)
        return (lambda q, k, v: model.flex_attention(q, k, v, bias)), "flex, ALiBi score_mod + causal block mask"
    mask = model.alibi_causal_mask(heads, seq, dtype, device)
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)), "sdpa, ALiBi + causal additive mask"


def kernel_ceiling(s: Settings, device: torch.device, accelerator: Accelerator | None = None, repeat: int = 5) -> dict[str, Any]:
    """training/ceiling.py's ceiling of this phase's micro batch on ``device``, timed and named
    by ``accelerator`` (the vendor's; default: the device type's calls)."""
    from cases.baichuan2.deepspeed import model
    from training.deepspeed_loop import DTYPES

    shape, tr = s.shape, s.common.train
    layers, heads, seq = int(shape["num_layers"]), int(shape["num_heads"]), int(shape["seq_length"])
    kind = model.speed_switches(s.common.sections["parallel"], layers)["attention"]
    dtype = DTYPES[tr.precision]
    attend, name = attention(kind, heads, seq, dtype, device)
    return ceiling.measure(
        gemms(shape, tr.micro_batch),
        layers,
        attend,
        name,
        batch=tr.micro_batch,
        heads=heads,
        groups=heads,
        seq=seq,
        head_dim=int(shape["hidden_size"]) // heads,
        tp=1,
        dtype=dtype,
        device=device,
        repeat=repeat,
        accelerator=accelerator,
        layout="bs3hd",
        hold_s=tr.ceiling_hold_s,
    )


def ceiling_only(cfg: dict, log: MetricLogger) -> None:
    """``--ceiling`` (start_task.py --ceiling): the ceiling of the configured layout on this
    process's first device, as one ``info`` record; no process group, model or data."""
    from cases.baichuan2.deepspeed import settings as case_settings

    ceiling.record_alone(cfg, log, lambda world, _, device, acc: kernel_ceiling(case_settings.from_config(cfg, world, PHASE), device, acc))
