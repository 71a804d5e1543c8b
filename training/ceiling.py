"""The kernel ceiling of a training step: its GEMMs and its attention alone, on this device.

For a case, the layout it runs and the device it runs on, the ceiling times the case's own
per-GPU matrix products (every linear layer's forward, data-gradient and weight-gradient
product at its tensor-parallel shard's shape) and its attention (forward and backward, with
the kernel the case calls), and asks: if a step did nothing else, how many tokens per GPU
per second would it train? Norms, RoPE, activations, the loss's softmax, the optimizer,
communication, recompute and idle time all come on top, so a run's tokens/p/s over the
ceiling (its ``efficiency``) says how close the software comes to the chip's own kernels,
not only to a nominal peak.

Per micro batch of ``b`` sequences of ``s`` tokens, one GPU of a ``tp``-way tensor-parallel
group computes every layer's shard: ``t_mb = L * (sum of the layer's GEMM times + attention
time) + output layer's GEMM times``. Pipeline stages split the layers (evenly, no bubble
counted) and data-parallel replicas repeat the work, so neither changes the ceiling:
``tokens/p/s = b * s / (t_mb * tp)``.

The case supplies its GEMM list (:func:`decoder_gemms` for a decoder-only model) and an
attention callable taking ``[b, heads, s, d]`` query and ``[b, groups, s, d]`` key/value;
:func:`measure` times them. The value goes out in the case's ``run_meta`` record as
``kernel_ceiling`` (and as an ``info`` record of that key under ``start_task.py
--ceiling``); the host reads it with :func:`efficiency`.

Standard library at import (the host imports :func:`efficiency`); torch and the device's
calls (training/accelerator.py: its timing events, else the wall clock between synchronizes)
inside the timing functions.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from training.metriclog import K_KERNEL_CEILING  # run_meta key and info-record key

if TYPE_CHECKING:
    from training.accelerator import Accelerator


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One linear layer ``y = x W^T`` of ``m`` rows: ``x [m, k]``, ``W [n, k]``, ``y [m, n]``;
    ``per_layer``: once in every transformer layer (else once per model, e.g. the output layer)."""

    name: str
    m: int
    n: int
    k: int
    per_layer: bool = True

    @property
    def flops(self) -> float:
        """Forward, data-gradient and weight-gradient products together."""
        return 3 * 2.0 * self.m * self.n * self.k


def decoder_gemms(
    hidden: int, ffn: int, heads: int, groups: int, head_dim: int, vocab: int, tp: int, tokens: int, gated: bool = True
) -> list[Gemm]:
    """A decoder layer's linear layers and the output layer, one tensor-parallel rank's shard
    (column-parallel: QKV, fc1, output; row-parallel: the attention projection, fc2)."""
    return [
        Gemm("qkv", tokens, (heads + 2 * groups) * head_dim // tp, hidden),
        Gemm("attn_proj", tokens, hidden, heads * head_dim // tp),
        Gemm("fc1", tokens, (2 if gated else 1) * ffn // tp, hidden),
        Gemm("fc2", tokens, hidden, ffn // tp),
        Gemm("output", tokens, vocab // tp, hidden, per_layer=False),
    ]


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention: the forward's two products over the
    causal half (``2 * b * h * s^2 * d``), the backward 2.5 times the forward."""
    return 3.5 * 2.0 * batch * heads * seq * seq * head_dim


def _accelerator(device: Any, accelerator: Accelerator | None) -> Accelerator:
    from training.accelerator import Accelerator

    return accelerator if accelerator is not None else Accelerator.of(device)


def time_op(
    fn: Callable[[], Any], device: Any, warmup: int = 2, repeat: int = 5, trials: int = 3, accelerator: Accelerator | None = None
) -> float:
    """Seconds per call of ``fn``: after ``warmup`` calls, the median of ``trials`` means over
    ``repeat`` back-to-back calls each (the device's timing events where it has them, the wall
    clock between synchronizes elsewhere: ``Accelerator.seconds_per_call``)."""
    acc = _accelerator(device, accelerator)
    for _ in range(warmup):
        fn()
    acc.synchronize(device)
    return statistics.median(acc.seconds_per_call(fn, repeat, device) for _ in range(trials))


def time_gemm(g: Gemm, dtype: Any, device: Any, **kw: Any) -> dict[str, float]:
    """The three products of one linear layer, each timed alone, in the layouts a linear
    layer's autograd runs them: ``x @ W^T``, ``dy @ W``, ``dy^T @ x``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(g.m, g.k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(g.n, g.k, dtype=dtype, device=device, generator=gen)
    dy = torch.randn(g.m, g.n, dtype=dtype, device=device, generator=gen)
    out = {
        "fwd_s": time_op(lambda: torch.matmul(x, w.t()), device, **kw),
        "dgrad_s": time_op(lambda: torch.matmul(dy, w), device, **kw),
        "wgrad_s": time_op(lambda: torch.matmul(dy.t(), x), device, **kw),
    }
    return out  # the tensors go with this frame


def time_attention(
    attend: Callable[[Any, Any, Any], Any], batch: int, heads: int, groups: int, seq: int, head_dim: int, dtype: Any, device: Any, **kw: Any
) -> float:
    """Forward + backward of ``attend`` on query ``[b, heads, s, d]`` and key/value
    ``[b, groups, s, d]``, handed as permuted views of ``[s, b, ., d]`` tensors (the layout a
    megatron layer hands its core attention)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)

    def make(h: int) -> Any:
        return torch.randn(seq, batch, h, head_dim, dtype=dtype, device=device, generator=gen).requires_grad_()

    q, k, v = make(heads), make(groups), make(groups)
    grad = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, generator=gen)

    def step() -> None:
        out = attend(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3))
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return time_op(step, device, **kw)


def measure(
    gemms: list[Gemm],
    num_layers: int,
    attend: Callable[[Any, Any, Any], Any],
    attention: str,
    *,
    batch: int,
    heads: int,
    groups: int,
    seq: int,
    head_dim: int,
    tp: int,
    dtype: Any,
    device: Any,
    repeat: int = 5,
    accelerator: Accelerator | None = None,
) -> dict[str, Any]:
    """Time the GEMMs and the attention of one micro batch on one GPU; the ceiling as a dict
    (JSON-ready): ``tokens_per_gpu_s``, the micro batch's kernel time and its parts.
    ``accelerator``: the vendor's device calls (default: those of ``device``'s type), which
    time the kernels and name the device."""
    acc = _accelerator(device, accelerator)
    kw = {"repeat": repeat, "accelerator": acc}
    parts: dict[str, dict[str, float]] = {}
    gemm_s = gemm_flops = 0.0
    for g in gemms:
        t = time_gemm(g, dtype, device, **kw)
        total = t["fwd_s"] + t["dgrad_s"] + t["wgrad_s"]
        times = num_layers if g.per_layer else 1
        gemm_s += times * total
        gemm_flops += times * g.flops
        parts[g.name] = {
            **{k: round(v * 1e3, 4) for k, v in ((k.replace("_s", "_ms"), v) for k, v in t.items())},
            "m": g.m,
            "n": g.n,
            "k": g.k,
            "per_layer": g.per_layer,
            "tflops": round(g.flops / total / 1e12, 2),
        }
    att = time_attention(attend, batch, heads, groups, seq, head_dim, dtype, device, **kw)
    att_flops = causal_attention_flops(batch, heads, seq, head_dim)
    parts["attention"] = {"fwd_bwd_ms": round(att * 1e3, 4), "tflops": round(att_flops / att / 1e12, 2)}
    micro = gemm_s + num_layers * att
    acc.empty_cache()
    name = acc.device_name(device)
    return {
        "tokens_per_gpu_s": batch * seq / (micro * tp),
        "micro_batch_s": micro,
        "gemm_s": gemm_s,
        "attention_s": num_layers * att,
        "gemm_tflops": gemm_flops / gemm_s / 1e12,
        "attention_tflops": att_flops / att / 1e12,
        "attention": attention,
        "device": name,
        "dtype": str(dtype).replace("torch.", ""),
        "tp": tp,
        "micro_batch": batch,
        "seq_length": seq,
        "layers": num_layers,
        "repeat": repeat,
        "parts": parts,
    }


def efficiency(meta: Mapping[str, Any] | None, tokens_per_gpu_s: float | None) -> tuple[float | None, float | None]:
    """A phase's ceiling (tokens/p/s) from its ``run_meta`` and its throughput over it;
    (None, None) where the case measured none, efficiency None without a throughput."""
    c = (meta or {}).get(K_KERNEL_CEILING)
    ceiling = c.get("tokens_per_gpu_s") if isinstance(c, Mapping) else None
    if not isinstance(ceiling, (int, float)) or isinstance(ceiling, bool) or not ceiling > 0:
        return None, None
    return float(ceiling), (None if tokens_per_gpu_s is None else tokens_per_gpu_s / ceiling)
