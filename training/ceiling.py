"""The kernel ceiling of a training step: its GEMMs and its attention alone, on this device.

For a case, the layout it runs and the device it runs on, the ceiling times the case's own
per-GPU matrix products (every linear layer's forward, data-gradient and weight-gradient
product that the step runs, at its tensor-parallel shard's shape) and its attention (with
the kernel the case calls, forward and backward where the step differentiates it), and asks:
if a step did nothing else, how many tokens per GPU per second would it train? Norms, RoPE,
activations, the loss's softmax, the optimizer, communication, recompute and idle time all
come on top, so a run's tokens/p/s over the ceiling (its ``efficiency``) says how close the
software comes to the chip's own kernels, not only to a nominal peak.

One micro batch of ``tokens`` tokens on one GPU of a ``tp``-way tensor-parallel group runs
every :class:`Gemm` ``count`` times (a decoder layer's once per layer, the output layer's
once) with the products it lists, and every :class:`Attention` block ``count`` times::

    t_mb = sum(count * (the GEMM's products' times)) + sum(count * attention time)
    tokens/p/s = tokens / (t_mb * tp)

Pipeline stages split the layers (evenly, no bubble counted) and data-parallel replicas
(ZeRO's included) repeat the work, so neither changes the ceiling.

What a case describes:

- a decoder-only model trained whole (llama3/megatron, baichuan2/deepspeed): its layer's
  linear layers and the output layer (:func:`decoder_gemms`, or the case's own list where its
  projections are split), all three products, and one causal attention block, forward and
  backward, over its layers (:func:`measure` is this case);
- a model of several parts, some frozen (llava/deepspeed): each part's GEMMs with only the
  products its step runs (``Gemm.products``: a frozen language model that the loss's gradient
  must cross runs ``fwd`` and ``dgrad``, no ``wgrad``; a frozen vision tower fed by data runs
  ``fwd`` alone; a trained layer whose input needs no gradient runs ``fwd`` and ``wgrad``),
  and one :class:`Attention` block per part (causal or not, ``backward`` or forward only,
  with its own batch, heads and length); :func:`measure_parts` times any such list.

The value goes out in the case's ``run_meta`` record as ``kernel_ceiling`` (one per phase;
and as an ``info`` record of that key under ``start_task.py --ceiling``); the host reads it
with :func:`efficiency`.

How the kernels are timed is the framework's (:class:`Timers`): by default torch's
(:func:`torch_timers`: ``torch.matmul``, the case's attention call, training/accelerator.py's
timing events, else the wall clock between synchronizes); a case on another framework passes
its own (cases/gpt3/paddle/ceiling.py: paddle's), and the ceiling is the same dict.

Standard library at import (the host imports :func:`efficiency`); torch, or the case's
framework, only inside the timing functions.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from training.metriclog import K_KERNEL_CEILING  # run_meta key and info-record key

if TYPE_CHECKING:
    from training.accelerator import Accelerator
    from training.metriclog import MetricLogger

#: a linear layer's three products, in the order autograd runs them: ``x @ W^T`` (forward),
#: ``dy @ W`` (the gradient of its input), ``dy^T @ x`` (the gradient of its weight)
PRODUCTS = ("fwd", "dgrad", "wgrad")

#: how an attention block's query, key and value reach the kernel: permuted views of
#: ``[s, b, heads, d]`` tensors (what a megatron layer hands its core attention), transposed
#: views of ``[b, s, heads, d]`` projections (transformers' layers), or views of one packed
#: ``[b, s, 3, heads, d]`` projection (a fused QKV layer such as Baichuan2's ``W_pack``); torch's
#: timer makes them so (:func:`time_attention`), a framework's own timer reads them its way
#: (paddle's hands ``bshd`` blocks the ``[b, s, heads, d]`` tensors themselves, as PaddleNLP does)
LAYOUTS = ("sbhd", "bshd", "bs3hd")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One linear layer ``y = x W^T`` of ``m`` rows: ``x [m, k]``, ``W [n, k]``, ``y [m, n]``.

    ``per_layer``: once in every transformer layer (else once per model, e.g. the output
    layer); ``count``: how many times a micro batch runs it (None: the model's layers when
    ``per_layer``, else once); ``products``: which of :data:`PRODUCTS` the step runs."""

    name: str
    m: int
    n: int
    k: int
    per_layer: bool = True
    products: tuple[str, ...] = PRODUCTS
    count: int | None = None

    def __post_init__(self) -> None:
        if not self.products or len(set(self.products)) != len(self.products) or not set(self.products) <= set(PRODUCTS):
            raise ValueError(f"Gemm {self.name}: products must be distinct names of {', '.join(PRODUCTS)}, got {self.products!r}")
        if min(self.m, self.n, self.k) < 1 or (self.count is not None and self.count < 1):
            raise ValueError(f"Gemm {self.name}: m, n, k and count must be positive, got {self.m}, {self.n}, {self.k}, {self.count}")

    @property
    def flops(self) -> float:
        """The products that run, together: ``2 m n k`` each."""
        return len(self.products) * 2.0 * self.m * self.n * self.k

    def times(self, num_layers: int) -> int:
        """How many times a micro batch runs it, for a model of ``num_layers`` layers."""
        return self.count if self.count is not None else (num_layers if self.per_layer else 1)


@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention block: ``attend(q, k, v)`` (the kernel the case calls) on query
    ``[batch, heads, seq, head_dim]`` and key/value ``[batch, groups, seq, head_dim]``, handed
    in ``layout`` (:data:`LAYOUTS`), ``count`` times per micro batch; ``causal`` or over the
    full length; forward and ``backward`` (the gradient of q, k and v) or forward alone.
    ``kernel`` names what ``attend`` runs."""

    name: str
    attend: Callable[[Any, Any, Any], Any]
    kernel: str
    batch: int
    heads: int
    groups: int
    seq: int
    head_dim: int
    count: int
    causal: bool = True
    backward: bool = True
    layout: str = "sbhd"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"Attention {self.name}: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.layout == "bs3hd" and self.groups != self.heads:
            raise ValueError(f"Attention {self.name}: a packed QKV layout has as many key/value heads as query heads")
        if min(self.batch, self.heads, self.groups, self.seq, self.head_dim, self.count) < 1:
            raise ValueError(f"Attention {self.name}: batch, heads, groups, seq, head_dim and count must be positive")

    @property
    def flops(self) -> float:
        """One call's FLOPs (:func:`attention_flops`)."""
        return attention_flops(self.batch, self.heads, self.seq, self.head_dim, causal=self.causal, backward=self.backward)


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


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, *, causal: bool = True, backward: bool = True) -> float:
    """FLOPs of attention over ``seq`` positions: the forward's two products ``QK^T`` and ``AV``
    (``4 * b * h * s^2 * d`` over the full length, half of it causal), and with ``backward``
    the backward's 2.5 times the forward on top."""
    return (3.5 if backward else 1.0) * (2.0 if causal else 4.0) * batch * heads * seq * seq * head_dim


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention: the forward's two products over the
    causal half (``2 * b * h * s^2 * d``), the backward 2.5 times the forward."""
    return attention_flops(batch, heads, seq, head_dim, causal=True, backward=True)


def _accelerator(device: Any, accelerator: Accelerator | None) -> Accelerator:
    from training.accelerator import Accelerator

    return accelerator if accelerator is not None else Accelerator.of(device)


@dataclasses.dataclass(frozen=True)
class Timers:
    """How one framework times a ceiling's kernels on its device (:func:`measure_parts`).

    ``gemm(g, dtype, device, repeat)``: seconds per call of each product ``g.products`` names,
    under ``<product>_s``; ``attention(block, dtype, device, repeat)``: seconds per call of the
    block (forward, and backward where ``block.backward``); ``device_name(device)``: the device
    as its stack names it; ``release()``: after the measurement, the allocator's cached blocks
    given back to the device; ``clock_mhz(device)``: the device's SM clock just after a part was
    timed, None where the stack does not tell."""

    gemm: Callable[[Gemm, Any, Any, int], Mapping[str, float]]
    attention: Callable[[Attention, Any, Any, int], float]
    device_name: Callable[[Any], str]
    release: Callable[[], None]
    clock_mhz: Callable[[Any], float | None] = lambda _device: None


def median_seconds(
    fn: Callable[[], Any],
    synchronize: Callable[[], None],
    seconds_per_call: Callable[[Callable[[], Any], int], float],
    warmup: int = 2,
    repeat: int = 5,
    trials: int = 3,
) -> float:
    """Seconds per call of ``fn``: after ``warmup`` calls and a ``synchronize``, the median of
    ``trials`` means over ``repeat`` back-to-back calls each (``seconds_per_call(fn, repeat)``:
    the framework's timing of ``repeat`` calls)."""
    for _ in range(warmup):
        fn()
    synchronize()
    return statistics.median(seconds_per_call(fn, repeat) for _ in range(trials))


def time_op(
    fn: Callable[[], Any], device: Any, warmup: int = 2, repeat: int = 5, trials: int = 3, accelerator: Accelerator | None = None
) -> float:
    """Seconds per call of ``fn`` on a torch device (:func:`median_seconds`; the device's timing
    events where it has them, the wall clock between synchronizes elsewhere:
    ``Accelerator.seconds_per_call``)."""
    acc = _accelerator(device, accelerator)
    return median_seconds(
        fn, lambda: acc.synchronize(device), lambda f, n: acc.seconds_per_call(f, n, device), warmup=warmup, repeat=repeat, trials=trials
    )


def time_gemm(g: Gemm, dtype: Any, device: Any, **kw: Any) -> dict[str, float]:
    """The products of one linear layer that its step runs (``g.products``), each timed alone,
    in the layouts a linear layer's autograd runs them: ``x @ W^T``, ``dy @ W``, ``dy^T @ x``;
    seconds under ``<product>_s``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(g.m, g.k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(g.n, g.k, dtype=dtype, device=device, generator=gen)
    dy = torch.randn(g.m, g.n, dtype=dtype, device=device, generator=gen)
    calls = {
        "fwd": lambda: torch.matmul(x, w.t()),
        "dgrad": lambda: torch.matmul(dy, w),
        "wgrad": lambda: torch.matmul(dy.t(), x),
    }
    return {f"{p}_s": time_op(calls[p], device, **kw) for p in g.products}  # the tensors go with this frame


def time_attention(block: Attention, dtype: Any, device: Any, **kw: Any) -> float:
    """Seconds per call of one attention block: ``block.attend`` on query, key and value handed
    in ``block.layout``, and with ``block.backward`` the backward of its ``[b, heads, s, d]``
    output to q, k and v, the upstream gradient laid out as a layer hands it back (contiguous in
    ``[s, b, heads, d]`` for ``sbhd``, in ``[b, s, heads, d]`` otherwise: the gradient of the
    layer's output projection, seen through its reshape): a kernel's backward can take another
    path for another gradient layout."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    b, s, d = block.batch, block.seq, block.head_dim

    def make(*shape: int) -> Any:
        return torch.randn(*shape, dtype=dtype, device=device, generator=gen).requires_grad_(block.backward)

    if block.layout == "bs3hd":
        qkv = make(b, s, 3, block.heads, d)
        leaves = [qkv]

        def inputs() -> tuple[Any, Any, Any]:
            return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    else:
        if block.layout == "sbhd":
            leaves = [make(s, b, h, d) for h in (block.heads, block.groups, block.groups)]
            order = (1, 2, 0, 3)
        else:
            leaves = [make(b, s, h, d) for h in (block.heads, block.groups, block.groups)]
            order = (0, 2, 1, 3)

        def inputs() -> tuple[Any, Any, Any]:
            return tuple(t.permute(*order) for t in leaves)

    grad: list[Any] = []

    def step() -> None:
        out = block.attend(*inputs())
        if not block.backward:
            return
        if not grad:  # the upstream gradient as a layer hands it back: contiguous in its token-major layout
            b_, h_, s_, d_ = out.shape
            if block.layout == "sbhd":
                grad.append(torch.randn(s_, b_, h_, d_, dtype=dtype, device=device, generator=gen).permute(1, 2, 0, 3))
            else:
                grad.append(torch.randn(b_, s_, h_, d_, dtype=dtype, device=device, generator=gen).permute(0, 2, 1, 3))
        out.backward(grad[0])
        for t in leaves:
            t.grad = None

    return time_op(step, device, **kw)


def torch_timers(device: Any, accelerator: Accelerator | None = None) -> Timers:
    """torch's :class:`Timers` on ``device`` (:func:`time_gemm`, :func:`time_attention`), with
    the vendor's device calls ``accelerator`` (default: those of ``device``'s type)."""
    acc = _accelerator(device, accelerator)
    return Timers(
        gemm=lambda g, dtype, dev, repeat: time_gemm(g, dtype, dev, repeat=repeat, accelerator=acc),
        attention=lambda block, dtype, dev, repeat: time_attention(block, dtype, dev, repeat=repeat, accelerator=acc),
        device_name=acc.device_name,
        release=acc.empty_cache,
        clock_mhz=acc.sm_clock_mhz,
    )


def dtype_name(dtype: Any) -> str:
    """A framework's dtype without its module's prefix: ``torch.bfloat16``, ``paddle.float16``
    (what ``str`` gives of either) as ``bfloat16``, ``float16``."""
    return str(dtype).removeprefix("torch.").removeprefix("paddle.")


def measure_parts(
    gemms: list[Gemm],
    attentions: list[Attention],
    *,
    tokens: int,
    tp: int,
    dtype: Any,
    device: Any,
    num_layers: int = 0,
    repeat: int = 5,
    accelerator: Accelerator | None = None,
    about: Mapping[str, Any] | None = None,
    timers: Timers | None = None,
    hold_s: float = 0.0,
) -> dict[str, Any]:
    """Time the GEMMs and the attention blocks of one micro batch of ``tokens`` tokens on one
    GPU; the ceiling as a dict (JSON-ready): ``tokens_per_gpu_s``, the micro batch's kernel time
    and its parts (per GEMM: each product's milliseconds, its shape, ``count`` and
    ``products``; per attention block: ``fwd_bwd_ms`` or ``fwd_ms``, its shape and ``kernel``),
    with ``about``'s keys (what the case says of the shapes) on top. ``num_layers``: the count of
    a per-layer GEMM without its own. ``timers``: the framework's timing of the kernels (default:
    torch's, :func:`torch_timers` with ``accelerator``, the vendor's device calls, default those
    of ``device``'s type, which time the kernels and name the device). ``hold_s`` > 0: before
    each kernel is timed it runs back to back for about that long (:func:`held`), so it is timed
    at the clock the device holds under sustained load rather than the one a short burst gets."""
    if not hold_s >= 0:
        raise ValueError(f"kernel ceiling: hold_s must be 0 or more seconds, got {hold_s!r}")
    names = [g.name for g in gemms] + [a.name for a in attentions]
    if len(set(names)) != len(names):
        raise ValueError(f"kernel ceiling: part names repeat: {names}")
    if not gemms:
        raise ValueError("kernel ceiling: no GEMMs to time")
    timing = timers if timers is not None else torch_timers(device, accelerator)
    parts: dict[str, dict[str, Any]] = {}
    clocks: list[float] = []

    def clock() -> dict[str, float]:  # the SM clock the part ran at, read as its timing ends
        mhz = timing.clock_mhz(device)
        if mhz is None:
            return {}
        clocks.append(mhz)
        return {"sm_clock_mhz": mhz}

    gemm_s = gemm_flops = 0.0
    for g in gemms:
        t = held(lambda n, g=g: timing.gemm(g, dtype, device, n), repeat, hold_s)
        at = clock()
        total = sum(t.values())
        times = g.times(num_layers)
        gemm_s += times * total
        gemm_flops += times * g.flops
        parts[g.name] = {
            **{k.replace("_s", "_ms"): round(v * 1e3, 4) for k, v in t.items()},
            "m": g.m,
            "n": g.n,
            "k": g.k,
            "per_layer": g.per_layer,
            "count": times,
            "products": list(g.products),
            "tflops": round(g.flops / total / 1e12, 2),
            **at,
        }
    att_s = att_flops = 0.0
    for a in attentions:
        t = held(lambda n, a=a: timing.attention(a, dtype, device, n), repeat, hold_s)
        at = clock()
        att_s += a.count * t
        att_flops += a.count * a.flops
        parts[a.name] = {
            ("fwd_bwd_ms" if a.backward else "fwd_ms"): round(t * 1e3, 4),
            "tflops": round(a.flops / t / 1e12, 2),
            "kernel": a.kernel,
            "batch": a.batch,
            "heads": a.heads,
            "groups": a.groups,
            "seq": a.seq,
            "head_dim": a.head_dim,
            "count": a.count,
            "causal": a.causal,
            "backward": a.backward,
            **at,
        }
    micro = gemm_s + att_s
    timing.release()
    return {
        "tokens_per_gpu_s": tokens / (micro * tp),
        "micro_batch_s": micro,
        "gemm_s": gemm_s,
        "attention_s": att_s,
        "gemm_tflops": gemm_flops / gemm_s / 1e12,
        "attention_tflops": att_flops / att_s / 1e12 if att_s else None,
        **dict(about or {}),
        "device": timing.device_name(device),
        "dtype": dtype_name(dtype),
        "tp": tp,
        "tokens_per_micro_batch": tokens,
        "repeat": repeat,
        **({"hold_s": hold_s} if hold_s else {}),
        # the SM clock read as each part's timing ended (their median), where the device tells:
        # the clock the ceiling was timed at, beside the one the run's steps ran at (device_clocks)
        **({"sm_clock_mhz": statistics.median(clocks)} if clocks else {}),
        "parts": parts,
    }


def held(timed: Callable[[int], Any], repeat: int, hold_s: float) -> Any:
    """``timed(repeat)`` (a part's timing: seconds per call, or a dict of them per product), after
    the same kernels ran back to back for about ``hold_s`` seconds: a first timing gives the
    seconds per call, a second one with enough calls per trial that its three trials last
    ``hold_s`` is the load (its figures dropped), and the timing right after it is the part's.
    ``hold_s`` 0: ``timed(repeat)`` alone."""
    if not hold_s:
        return timed(repeat)
    first = timed(repeat)
    per_call = max(first.values()) if isinstance(first, Mapping) else first
    timed(max(repeat, math.ceil(hold_s / (3 * per_call))) if per_call > 0 else repeat)
    return timed(repeat)


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
    layout: str = "sbhd",
    timers: Timers | None = None,
    hold_s: float = 0.0,
) -> dict[str, Any]:
    """A decoder-only model's ceiling (:func:`measure_parts`): its GEMMs and one causal
    attention block (``attend``, named ``attention``), forward and backward, in each of its
    ``num_layers`` layers, over micro batches of ``batch`` sequences of ``seq`` tokens, timed
    by ``timers`` (default: torch's on ``device``, :func:`torch_timers`), each part after
    ``hold_s`` seconds of its own load (:func:`measure_parts`)."""
    block = Attention("attention", attend, attention, batch, heads, groups, seq, head_dim, count=num_layers, layout=layout)
    about = {"attention": attention, "micro_batch": batch, "seq_length": seq, "layers": num_layers}
    return measure_parts(
        gemms,
        [block],
        tokens=batch * seq,
        tp=tp,
        dtype=dtype,
        device=device,
        num_layers=num_layers,
        repeat=repeat,
        accelerator=accelerator,
        about=about,
        timers=timers,
        hold_s=hold_s,
    )


def record_alone(
    cfg: dict,
    log: MetricLogger,
    measure: Callable[[int, str | None, Any, Accelerator], dict[str, Any]],
    phases: Iterable[str | None] = (None,),
    first_device: Callable[[dict], tuple[Any, Any]] | None = None,
) -> None:
    """``--ceiling`` (start_task.py --ceiling) in a case's entry: ``measure(world_size, phase,
    device, accelerator)`` for each of ``phases`` on this process's first device (the vendor's
    device calls), one ``info`` record each, carrying its phase where the case has phases; no
    process group, model or data. A failure is written as an error record, then raised.
    ``first_device(cfg)``: that device and the calls ``measure`` takes with it, made current
    (default: torch's, training/accelerator.py's ``Accelerator`` of the vendor and its device 0)."""
    case = cfg["case"]
    world = int(case["nnodes"]) * int(case["nprocs"])
    device, acc = (first_device or _torch_first_device)(cfg)
    for phase in phases:
        try:
            log.info(K_KERNEL_CEILING, measure(world, phase, device, acc), phase=phase)
        except BaseException as exc:
            log.error(f"kernel ceiling: {type(exc).__name__}: {exc}", phase=phase)
            raise


def _torch_first_device(cfg: dict) -> tuple[Any, Accelerator]:
    from training.accelerator import Accelerator

    acc = Accelerator(cfg.get("vendor") or {})
    return acc.device(0), acc


def efficiency(meta: Mapping[str, Any] | None, tokens_per_gpu_s: float | None) -> tuple[float | None, float | None]:
    """A phase's ceiling (tokens/p/s) from its ``run_meta`` and its throughput over it;
    (None, None) where the case measured none, efficiency None without a throughput."""
    c = (meta or {}).get(K_KERNEL_CEILING)
    ceiling = c.get("tokens_per_gpu_s") if isinstance(c, Mapping) else None
    if not isinstance(ceiling, (int, float)) or isinstance(ceiling, bool) or not ceiling > 0:
        return None, None
    return float(ceiling), (None if tokens_per_gpu_s is None else tokens_per_gpu_s / ceiling)
