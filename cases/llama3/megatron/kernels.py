"""Faster kernels for llama3/megatron's elementwise work and attention, each behind a switch.

``parallel.fused_elementwise`` (none | compile | liger) swaps megatron's local RMSNorm
(``torch.nn.RMSNorm`` through ``WrappedTorchNorm``: every norm of the layers and the final
norm) and the MLP's SwiGLU for fused versions; ``parallel.attention: cudnn`` runs the core
attention on torch's cuDNN SDPA backend (modeling.CuDNNCoreAttention, checked here first).

* ``compile``: the same functions torch runs eagerly (``F.rms_norm``; ``silu(gate) * up`` on
  megatron's fused ``[gate; up]`` fc1 output: ``training.fused.torch_rms_norm`` and
  ``swiglu_packed``) as ``torch.compile`` regions (``training.fused.compiled``), full graph,
  static shapes: each is compiled once per input shape (forward and backward, Inductor on
  GPUs), so a norm is one kernel each way and SwiGLU saves only its input for the backward.
* ``liger``: liger-kernel's Triton kernels (``LigerRMSNormFunction`` in its ``llama`` casting
  mode, which is torch's: normalize in float32, round, then scale; and
  ``LigerFusedGateUpSiLUMulFunction``, which reads gate and up from the one fc1 buffer), never
  in place. CUDA only.

The modules keep megatron's builder signatures (``(config=, hidden_size=, eps=)`` for a norm,
``(config=)`` for the activation), so they slot into megatron-core 0.16's and 0.19's local
layer spec (``use_te_activation_func`` routes the MLP through an activation module). Unlike
megatron's torch-norm wrapper, the norms run under ``parallel.sequence_parallel`` (each rank
normalizes its share of the sequence; see ``_Norm``), which makes sequence parallelism
possible without TransformerEngine.

Imported after ``training.runtime.setup()``, like modeling.py.
"""

from __future__ import annotations

import importlib
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from cases.llama3.megatron import mcore_patches
from training import fused, gemm

FUSED_ELEMENTWISE = ("none", "compile", "liger")


_LIGER_OPS = {  # what: (liger-kernel module, autograd function)
    "rms_norm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
    "add_rms_norm": ("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction"),
    "swiglu": ("liger_kernel.ops.swiglu", "LigerFusedGateUpSiLUMulFunction"),
    "vocab_parallel_ce": ("liger_kernel.ops.vocab_parallel_cross_entropy", "LigerVocabParallelCEFunction"),
}


def _liger(what: str, switch: str = "parallel.fused_elementwise", instead: str = "none or compile") -> Any:
    """liger-kernel's autograd function for ``what``; where it does not import, an error that
    names ``switch`` and the values to choose ``instead``."""
    module, name = _LIGER_OPS[what]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"{switch}: liger needs liger-kernel 0.8.5 or later (and triton): {exc}; "
            f"install it (pip install liger-kernel==0.8.5) or choose {instead}"
        ) from exc


def _check_cuda(x: torch.Tensor, what: str, switch: str = "parallel.fused_elementwise") -> None:
    if x.device.type != "cuda":
        raise RuntimeError(f"{switch}: liger runs Triton kernels on CUDA devices; {what} got a {x.device.type} tensor")


class _Norm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (parameter ``weight``, made where megatron's would be) built with
    megatron's norm-builder arguments; subclasses change only the forward.

    Under sequence parallelism (``config.sequence_parallel``) a tensor-parallel rank normalizes
    its own share of the sequence, so its weight gradient is a partial sum: the weight is marked
    ``sequence_parallel`` as megatron marks its own norms', and megatron's
    ``finalize_model_grads`` sums such gradients over the tensor-parallel group."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"{type(self).__name__} is an RMSNorm; config.normalization is {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``residual + x`` and its RMSNorm, ``(norm, sum)``."""
    total = residual + x
    return fused.torch_rms_norm(total, weight, eps), total


class CompiledRMSNorm(_Norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.nn.RMSNorm's own arithmetic (F.rms_norm), not the round-then-scale order
        return fused.compiled(fused.torch_rms_norm)(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``parallel.fused_add_norm``: ``(norm(residual + x), residual + x)`` as one compiled region."""
        return fused.compiled(add_rms_norm)(x, residual, self.weight, self.eps)


class LigerRMSNorm(_Norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_cuda(x, "LigerRMSNorm")
        # offset 0, casting mode "llama" (torch's order), not in place, default row mode
        return _liger("rms_norm").apply(x, self.weight, self.eps, 0.0, "llama", False, None)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``parallel.fused_add_norm``: ``(norm(residual + x), residual + x)`` in one liger kernel
        each way (``LigerFusedAddRMSNormFunction``, casting mode "llama", not in place); its
        backward adds the two gradients of the sum too."""
        _check_cuda(x, "LigerRMSNorm")
        return _liger("add_rms_norm").apply(x, residual, self.weight, self.eps, 0.0, "llama", False)


class _SwiGLU(torch.nn.Module):
    """The MLP's activation module (megatron calls it on the whole fc1 output when
    ``config.use_te_activation_func`` is set)."""

    def __init__(self, config: Any = None, **kwargs: Any):
        super().__init__()
        if config is not None and not (getattr(config, "gated_linear_unit", True) and getattr(config, "activation_func", F.silu) is F.silu):
            raise ValueError(f"{type(self).__name__} is SwiGLU: it needs gated_linear_unit and activation_func F.silu")


class CompiledSwiGLU(_SwiGLU):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return fused.compiled(fused.swiglu_packed)(y)


class LigerSwiGLU(_SwiGLU):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        _check_cuda(y, "LigerSwiGLU")
        shape = y.shape
        out = _liger("swiglu").apply(y.reshape(-1, shape[-1]), False)  # not in place
        return out.view(*shape[:-1], shape[-1] // 2)


NORMS: dict[str, type] = {"compile": CompiledRMSNorm, "liger": LigerRMSNorm}
ACTIVATIONS: dict[str, type] = {"compile": CompiledSwiGLU, "liger": LigerSwiGLU}


# -- cuDNN attention -----------------------------------------------------------------------

_CUDNN_MODE: dict[tuple, str] = {}


def _sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: str) -> torch.Tensor:
    """Causal attention on the cuDNN backend alone, ``[b, h, s, d]`` inputs made contiguous.

    ``gqa``: ``native`` hands the kernel K/V with their own (fewer) heads (``enable_gqa``);
    ``repeat`` repeats each K/V head over its group's query heads first (a copy).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, groups = q.shape[1], k.shape[1]
    if gqa == "repeat" and heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa == "native" and heads != groups,
        )


def cudnn_attention_mode(heads: int, groups: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> str:
    """How this process runs cuDNN attention for this head layout: ``native`` GQA or ``repeat``.

    Checked once per process and layout on a small causal problem, forward and backward (the
    output handed on as the layer hands it, :func:`sbhd_hand_on`), against float32 attention;
    raises with torch's reasons when the cuDNN backend runs neither way here (no CUDA device, a
    torch without cuDNN attention, an unsupported card).
    """
    if device.type != "cuda":
        raise RuntimeError(
            f"parallel.attention: cudnn runs torch's cuDNN attention kernel, which needs a CUDA device "
            f"(this process computes on {device.type}); use parallel.attention: sdpa"
        )
    key = (heads, groups, head_dim, dtype, device.index)
    if key in _CUDNN_MODE:
        return _CUDNN_MODE[key]
    import warnings

    gen = torch.Generator(device=device).manual_seed(1234)
    s = 256
    q0 = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, generator=gen)
    k0 = torch.randn(1, groups, s, head_dim, device=device, dtype=dtype, generator=gen)
    v0 = torch.randn(1, groups, s, head_dim, device=device, dtype=dtype, generator=gen)
    g0 = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, generator=gen)
    scale = 1.0 / math.sqrt(head_dim)
    ref_in = [t.float().requires_grad_() for t in (q0, k0, v0)]
    rep = heads // groups
    ref = F.scaled_dot_product_attention(
        ref_in[0], ref_in[1].repeat_interleave(rep, 1), ref_in[2].repeat_interleave(rep, 1), is_causal=True, scale=scale
    )
    grad = sbhd_hand_on(g0).contiguous()  # the gradient as the layer's projection hands it back
    sbhd_hand_on(ref).backward(grad.float())
    errors = []
    for mode in ("native", "repeat") if heads != groups else ("native",):
        ins = [t.clone().requires_grad_() for t in (q0, k0, v0)]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = _sdpa_cudnn(*ins, scale=scale, gqa=mode)
                sbhd_hand_on(out).backward(grad)
                torch.cuda.synchronize(device)
        except RuntimeError as exc:
            reasons = "; ".join(str(w.message).splitlines()[0] for w in caught if "cuDNN" in str(w.message) or "cudnn" in str(w.message))
            errors.append(f"{mode} GQA: {str(exc).splitlines()[0]}" + (f" ({reasons})" if reasons else ""))
            continue
        worst = max(
            float((a.float() - b).abs().max() / (b.abs().max() + 1e-6))
            for a, b in ((out, ref), (ins[0].grad, ref_in[0].grad), (ins[1].grad, ref_in[1].grad), (ins[2].grad, ref_in[2].grad))
        )
        if worst > 0.05:
            errors.append(f"{mode} GQA: output or gradients off float32 attention by {worst:.3g} of their largest value")
            continue
        _CUDNN_MODE[key] = mode
        return mode
    raise RuntimeError(
        f"parallel.attention: cudnn: torch {torch.__version__}'s cuDNN attention backend does not run "
        f"{heads} query heads over {groups} KV groups, head dim {head_dim}, {dtype} on "
        f"{torch.cuda.get_device_name(device)}: {' | '.join(errors)}; use parallel.attention: sdpa"
    )


def sbhd_hand_on(out: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, d]`` attention output as megatron's core attention hands it to the output
    projection: ``[s, b, heads * d]``. The gradient comes back through it from the projection's
    backward (a contiguous tensor of that shape), so the kernel's backward sees the incoming
    gradient in the layout of this view, not a contiguous ``[b, heads, s, d]`` one."""
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention as the check of another kernel takes it: K/V repeated over their groups
    (no GQA path involved), on torch's flash or memory-efficient backend on CUDA devices (no
    float32 score matrix at the case's sequence length), torch's choice elsewhere."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def attention_fault(
    attend: Any,
    q_like: torch.Tensor,
    k_like: torch.Tensor,
    v_like: torch.Tensor,
    scale: float,
    hand_on: Any = sbhd_hand_on,
    tolerance: float = 0.1,
) -> str | None:
    """What is wrong with ``attend(q, k, v)`` as causal attention for inputs like ``q_like``
    (``[b, heads, s, d]``), ``k_like`` and ``v_like`` (K and V with their own, fewer heads), or None.

    The inputs are seeded random tensors of those shapes, dtype, device and strides (a layer's
    permuted views stay permuted views). Two checks: (1) causality, exactly: with the keys and
    values of the second half of the sequence replaced, the first half of the output stays what
    it was; (2) the output and the gradients of q, k and v agree with
    :func:`reference_attention` within ``tolerance`` of their largest value: wide enough for two
    correct bf16 kernels summing in other orders, narrow against a wrong scale, a lost mask or a
    wrong gradient, which miss by tens of percent. The gradient is the one the layer gives: a
    random contiguous gradient of ``hand_on(output)`` (how the layer hands the output on), so the
    kernel's backward sees the incoming gradient in the layer's own layout. Backward kernels can
    depend on that layout (torch 2.11's cuDNN attention on H200, 2026-11-27: correct for the
    gradient of :func:`sbhd_hand_on`, dq off by more than its largest value for a contiguous
    ``[b, heads, s, d]`` gradient to contiguous inputs), so a check through another layout
    judges a kernel the layer does not run. A kernel can pass on a short problem and fail at the
    case's length, so the case checks at its own (:func:`checked_attention`)."""
    gen = torch.Generator(device=q_like.device).manual_seed(4321)

    def laid_out_as(like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``values`` in a tensor with ``like``'s strides, gaps included (clone would close them:
        V is a slice of the fused QKV output)."""
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device).copy_(values)

    def draw(like: torch.Tensor) -> torch.Tensor:
        return laid_out_as(like, torch.randn(like.shape, dtype=like.dtype, device=like.device, generator=gen))

    q, k, v = draw(q_like), draw(k_like), draw(v_like)
    s = q.shape[2]
    half = s // 2
    with torch.no_grad():
        out = attend(q, k, v)
        k2, v2 = laid_out_as(k, k), laid_out_as(v, v)
        k2[:, :, half:], v2[:, :, half:] = draw(k_like)[:, :, half:], draw(v_like)[:, :, half:]
        moved = float((attend(q, k2, v2)[:, :, :half].float() - out[:, :, :half].float()).abs().max())
    if moved > 1e-3 * float(out.float().abs().max()):
        return (
            f"not causal: the first {half} positions' output changes by {moved:.3g} when only the keys and values "
            f"of positions {half}-{s - 1} change"
        )
    with torch.enable_grad():  # also where the caller runs without a graph
        mine = [laid_out_as(t, t).requires_grad_() for t in (q, k, v)]
        ref = [laid_out_as(t, t).requires_grad_() for t in (q, k, v)]
        a, r = attend(*mine), reference_attention(*ref, scale)
        handed = hand_on(a)
        grad = torch.randn(handed.shape, dtype=handed.dtype, device=handed.device, generator=gen)
        handed.backward(grad)
        hand_on(r).backward(grad.to(r.dtype))
    for name, x, y in (
        ("output", a.detach(), r.detach()),
        ("dq", mine[0].grad, ref[0].grad),
        ("dk", mine[1].grad, ref[1].grad),
        ("dv", mine[2].grad, ref[2].grad),
    ):
        off = float((x.float() - y.float()).abs().max() / (y.float().abs().max() + 1e-6))
        if off > tolerance:
            return f"{name} off the reference attention (flash / memory-efficient, K/V repeated) by {off:.3g} of its largest value"
    return None


_CHECKED: set[tuple] = set()


def checked_attention(
    what: str, attend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, fix: str, hand_on: Any = sbhd_hand_on
) -> torch.Tensor:
    """``attend(q, k, v)``, checked first with :func:`attention_fault` once per process and input
    layout (shapes, strides, dtype, device): the case's micro batch, heads and sequence length,
    as the layer hands them over, the output handed on by ``hand_on`` as the layer does. Raises,
    naming ``parallel.attention: <what>``, the shape, the fault and ``fix``, where the kernel is
    not causal attention there."""
    key = (what, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), q.dtype, q.device, scale, hand_on)
    if key not in _CHECKED:
        fault = attention_fault(attend, q, k, v, scale, hand_on)
        if fault:
            raise RuntimeError(
                f"parallel.attention: {what}: torch {torch.__version__}'s attention at this layer's shape (batch {q.shape[0]}, "
                f"{q.shape[1]} query heads over {k.shape[1]} KV groups, sequence {q.shape[2]}, head dim {q.shape[3]}, "
                f"{q.dtype}) is {fault}; {fix}"
            )
        _CHECKED.add(key)
    return attend(q, k, v)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: str) -> torch.Tensor:
    """:func:`_sdpa_cudnn` through :func:`checked_attention`."""
    return checked_attention(
        f"cudnn (GQA {gqa})", lambda a, b, c: _sdpa_cudnn(a, b, c, scale, gqa), q, k, v, scale, "use parallel.attention: sdpa"
    )


# -- fused RoPE ----------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` channels (megatron's
    non-interleaved rotation), the rest as is."""
    rot = cos.shape[-1]
    r, rest = x[..., :rot], x[..., rot:]
    r1, r2 = torch.chunk(r, 2, dim=-1)
    return torch.cat((r * cos + torch.cat((-r2, r1), dim=-1) * sin, rest), dim=-1)


def _rotate_grad(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_rotate` with respect to ``x``: ``g * cos`` plus the transposed
    half-rotation of ``g * sin`` (``[y1, y2] -> [y2, -y1]``), the rest as is."""
    rot = cos.shape[-1]
    gr, rest = g[..., :rot], g[..., rot:]
    s1, s2 = torch.chunk(gr * sin, 2, dim=-1)
    return torch.cat((gr * cos + torch.cat((s2, -s1), dim=-1), rest), dim=-1)


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """What megatron's unfused ``_apply_rotary_pos_emb_bshd`` computes without interleaving:
    ``t * cos + rotate_half(t) * sin`` on the first ``freqs.shape[-1]`` channels, the rest as is."""
    return _rotate(t, (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype))


def compiled_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    multi_latent_attention: bool | None = None,
) -> torch.Tensor:
    """Stands in for megatron's ``rope_utils._apply_rotary_pos_emb_bshd`` (``parallel.fused_rope:
    compile``): the same function as one torch.compile region (cos, sin, rotation and the
    products in one kernel each way)."""
    if rotary_interleaved or mla_rotary_interleaved or multi_latent_attention:
        raise ValueError("parallel.fused_rope: compile covers the non-interleaved RoPE of Llama only")
    return fused.compiled(rope_bshd)(t, freqs, float(mscale))


# ``fused_rope: qkv``: the QKV split and the RoPE of query and key in one function each way.
# megatron-core (0.16, 0.19) splits its fused QKV output into views, copies the query into its own
# [s, b, heads, d] tensor, rotates query and key with cos and sin worked out per call, and in the
# backward concatenates the three gradients into the QKV gradient. Its ``fused_single_qkv_rope``
# path instead hands the unsplit output to ``apply_fused_qkv_rotary_pos_emb`` (TransformerEngine's
# where that is installed); :func:`qkv_rope` stands in for it: query, key and value come out of one
# compiled function, the backward writes the QKV gradient with one compiled region and one
# concatenation, and cos and sin are worked out once for every layer of a forward (:func:`rope_tables`).

_ROPE_TABLE: dict[str, tuple] = {}


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of megatron's rotary angles ``freqs`` as megatron's unfused RoPE forms
    them (``(cos(freqs) * mscale).to(dtype)``), kept while the same ``freqs`` tensor comes back
    unchanged (megatron builds it once per forward, or once per run from its cache), so the layers
    of a step share one pair."""
    key = (freqs._version, dtype, float(mscale), freqs.shape, freqs.device)
    last = _ROPE_TABLE.get("last")
    if last is not None and last[0]() is freqs and last[1] == key:
        return last[2]
    tables = ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))
    _ROPE_TABLE["last"] = (weakref.ref(freqs), key, tables)
    return tables


def qkv_split_rope(mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_width: int, head_dim: int) -> tuple:
    """Megatron's ``[s, b, groups, (heads per group + 2) * d]`` QKV output to query
    ``[s, b, heads, d]`` and key ``[s, b, groups, d]``, both rotated, and value ``[s, b, groups, d]``,
    each its own tensor."""
    s, b, groups, _ = mixed.shape
    q = mixed[..., :q_width].unflatten(-1, (q_width // head_dim, head_dim))
    q = _rotate(q, cos.unsqueeze(-2), sin.unsqueeze(-2)).reshape(s, b, groups * (q_width // head_dim), head_dim)
    k = _rotate(mixed[..., q_width : q_width + head_dim], cos, sin)
    v = mixed[..., q_width + head_dim :].clone(memory_format=torch.contiguous_format)
    return q, k, v


def _qk_rope_grads(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`qkv_split_rope`'s query part ``[s, b, groups, heads per group * d]``
    and key part ``[s, b, groups, d]``."""
    s, b, groups, head_dim = dk.shape
    gq = _rotate_grad(dq.reshape(s, b, groups, -1, head_dim), cos.unsqueeze(-2), sin.unsqueeze(-2)).flatten(-2)
    return gq, _rotate_grad(dk, cos, sin)


def qkv_split_rope_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of the QKV output from those of query, key and value (:func:`qkv_split_rope`):
    the rotations back as one compiled region, then one concatenation. Inductor's own kernel for
    the whole (rotations inside the concatenation) took 0.235 ms at a TP2 rank's llama3_8b shape
    on one H200 against 0.114 ms for this split (2026-11-28), with the same result bit for bit."""
    gq, gk = fused.compiled(_qk_rope_grads)(dq, dk, cos, sin)
    return torch.cat((gq, gk, dv), dim=-1)


class QKVRoPE(torch.autograd.Function):
    """:func:`qkv_split_rope` forward (one compiled region), :func:`qkv_split_rope_grad`
    backward; only cos and sin are kept for the backward."""

    @staticmethod
    def forward(ctx: Any, mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_width: int, head_dim: int) -> tuple:
        ctx.save_for_backward(cos, sin)
        return fused.compiled(qkv_split_rope)(mixed, cos, sin, q_width, head_dim)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple:
        cos, sin = ctx.saved_tensors
        return qkv_split_rope_grad(dq, dk, dv, cos, sin), None, None, None, None


def qkv_rope(mixed_qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, split: list[int], *args: Any, **kwargs: Any) -> tuple:
    """Stands in for ``apply_fused_qkv_rotary_pos_emb(mixed_qkv, q_pos_emb, k_pos_emb,
    qkv_split_arg_list)`` in megatron's attention (``fused_single_qkv_rope``): the query, key and
    value of self-attention, query and key rotated as megatron's unfused RoPE rotates them (no
    interleaving; megatron passes no scale on this path)."""
    if args or kwargs:
        raise ValueError(f"parallel.fused_rope: qkv takes the QKV output, two rotary tables and the split only; got also {args} {kwargs}")
    q_width, k_width, v_width = split
    if k_width != v_width or q_width % k_width or mixed_qkv.shape[-1] != q_width + k_width + v_width:
        raise ValueError(f"parallel.fused_rope: qkv: a QKV output of shape {tuple(mixed_qkv.shape)} does not split as {split}")
    if q_freqs is not k_freqs and not torch.equal(q_freqs, k_freqs):
        raise ValueError("parallel.fused_rope: qkv rotates query and key alike; megatron handed it two different rotary tables")
    cos, sin = rope_tables(q_freqs, mixed_qkv.dtype)
    return QKVRoPE.apply(mixed_qkv, cos, sin, q_width, k_width)


def install_rope(mode: str, config: Any) -> None:
    """Route megatron's RoPE as ``parallel.fused_rope`` says, and only so (a model built before
    with another mode in this process is routed back): ``compile`` swaps the unfused
    ``rope_utils._apply_rotary_pos_emb_bshd`` (every layer's query and key) for
    :func:`compiled_rope`; ``qkv`` makes :func:`qkv_rope` the attention module's
    ``apply_fused_qkv_rotary_pos_emb``, which megatron calls where ``config.fused_single_qkv_rope``
    is set (modeling.transformer_config sets it for ``qkv``). Megatron looks these names up in its
    modules when it calls them; both replacements go through mcore_patches (its version guard)."""
    if mode == "qkv":
        if getattr(config, "rotary_interleaved", False) or getattr(config, "multi_latent_attention", False):
            raise ValueError("parallel.fused_rope: qkv covers the non-interleaved RoPE of Llama only")
        if not getattr(config, "fused_single_qkv_rope", False):
            raise ValueError("parallel.fused_rope: qkv needs config.fused_single_qkv_rope, which routes megatron's attention through it")
    if mode == "compile":
        mcore_patches.replace("rope_compile", _apply_rotary_pos_emb_bshd=compiled_rope)
    else:
        mcore_patches.restore("rope_compile")
    if mode == "qkv":
        mcore_patches.replace("rope_qkv", HAVE_FUSED_QKV_ROPE=True, apply_fused_qkv_rotary_pos_emb=qkv_rope)
    else:
        mcore_patches.restore("rope_qkv")


# -- fused output layer + cross-entropy ----------------------------------------------------

FUSED_LOSS_CHUNK = 2048  # tokens per chunk: the logits of a chunk are [chunk, vocab / tp] in float32


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None:
        torch.distributed.all_reduce(t, op=op, group=group)


class LinearCrossEntropy(torch.autograd.Function):
    """Output layer and cross-entropy in one, over a vocabulary split across tensor-parallel
    ranks, a chunk of tokens at a time: the logits of all tokens never exist at once.

    Forward: per chunk, ``logits = x W^T`` (this rank's vocabulary slice, in float32 after
    the product), the max, the sum of exponentials and the label's logit reduced over the
    TP group; the loss is ``log(sum exp) + max - logit[label]``, and only the log-sum-exp per
    token is kept. Backward: the chunk's logits are made again, ``softmax - one_hot`` scaled
    by each token's incoming gradient gives ``dx = d W`` (all-reduced over the TP group, as
    megatron's column-parallel output layer does, unless ``reduce_dx`` is false: under sequence
    parallelism the reduce-scatter of the gather in front sums it) and ``dW += d^T x`` (float32
    sum over chunks). Megatron's path keeps the logits ([tokens, vocab / tp]) and its float32 softmax
    for the backward instead; this one recomputes one product per chunk.

    On CUDA the logits come out of their GEMM in float32 and each chunk's ``d^T x`` is added to
    ``dW`` inside its GEMM (training/gemm.py): no bf16 logits cast up in a second kernel, no
    separate float32 addition per chunk; neither product is rounded to bf16 on its way, so the
    loss is at least as exact as megatron's path.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group: Any, chunk: int, reduce_dx: bool
    ) -> torch.Tensor:
        vocab_part = weight.shape[0]
        first = (torch.distributed.get_rank(group) if group is not None else 0) * vocab_part
        n = x.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        for i in range(0, n, chunk):
            logits = gemm.float32_product(x[i : i + chunk], weight.t())
            top = logits.max(dim=-1).values
            _all_reduce(top, torch.distributed.ReduceOp.MAX, group)
            total = torch.exp(logits - top[:, None]).sum(dim=-1)
            _all_reduce(total, torch.distributed.ReduceOp.SUM, group)
            local = labels[i : i + chunk] - first
            inside = (local >= 0) & (local < vocab_part)
            picked = logits.gather(1, local.clamp(0, vocab_part - 1)[:, None]).squeeze(1) * inside
            _all_reduce(picked, torch.distributed.ReduceOp.SUM, group)
            lse[i : i + chunk] = torch.log(total) + top
            loss[i : i + chunk] = lse[i : i + chunk] - picked
        ctx.save_for_backward(x, weight, labels, lse)
        ctx.group, ctx.chunk, ctx.first, ctx.reduce_dx = group, chunk, first, reduce_dx
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, labels, lse = ctx.saved_tensors
        vocab_part, chunk = weight.shape[0], ctx.chunk
        dx = torch.empty_like(x)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        rows = torch.arange(min(chunk, x.shape[0]), device=x.device)
        for i in range(0, x.shape[0], chunk):
            xc = x[i : i + chunk]
            d = torch.exp(gemm.float32_product(xc, weight.t()) - lse[i : i + chunk, None])  # softmax
            local = labels[i : i + chunk] - ctx.first
            inside = (local >= 0) & (local < vocab_part)
            r = rows[: xc.shape[0]]
            d[r[inside], local[inside]] -= 1.0
            d = (d * grad[i : i + chunk, None].float()).to(x.dtype)
            dx[i : i + chunk] = torch.matmul(d, weight)
            gemm.accumulate_product(dw, d.t(), xc)  # dw += d^T xc, summed in float32 inside the GEMM
        if ctx.reduce_dx:
            _all_reduce(dx, torch.distributed.ReduceOp.SUM, ctx.group)
        return dx, dw.to(weight.dtype), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group: Any,
    chunk: int = FUSED_LOSS_CHUNK,
    reduce_dx: bool = True,
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of hidden states ``[s, b, h]`` through the output weight
    ``[vocab / tp, h]`` against labels ``[b, s]``; ``group``: the TP group (None: no TP);
    ``reduce_dx``: sum the hidden states' gradient over the group here (false where the caller's
    own collective sums it)."""
    s, b, h = hidden.shape
    flat_labels = labels.transpose(0, 1).reshape(-1)
    loss = LinearCrossEntropy.apply(hidden.reshape(s * b, h), weight, flat_labels, group, chunk, reduce_dx)
    return loss.view(s, b).transpose(0, 1).contiguous()


# -- the cross-entropy after the output layer ----------------------------------------------


def liger_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Any) -> torch.Tensor:
    """``parallel.cross_entropy: liger``: per-token loss ``[s, b]`` of this rank's vocabulary share
    of the logits ``[s, b, vocab / tp]`` against labels ``[s, b]``, through liger-kernel's
    vocabulary-parallel cross-entropy (``LigerVocabParallelCEFunction``: one Triton kernel writes
    exp(logit - max) in float32 with each token's local sum and target logit, the sums are
    all-reduced over ``group`` (None: no TP), and the backward turns that buffer into the logits'
    gradient in place). Megatron's arithmetic (no label smoothing); ignore_index -100 never
    matches a token id. CUDA only."""
    _check_cuda(logits, "the cross-entropy", "parallel.cross_entropy")
    ce = _liger("vocab_parallel_ce", "parallel.cross_entropy", "megatron or fused")
    return ce.apply(logits, labels, group, -100, 0.0, "megatron", "partition")


# -- weight-gradient accumulation in the GEMM ---------------------------------------------


def wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's ``wgrad_gemm_accum_fp32`` / ``_fp16``: ``main_grad += grad_output^T @ total_input``
    (``[tokens, in]``, ``[tokens, out]``, ``[out, in]``) inside one GEMM
    (:func:`training.gemm.accumulate_product`)."""
    gemm.accumulate_product(main_grad, grad_output.t(), total_input)


class _WgradAccumulation:
    """What megatron-core calls ``fused_weight_gradient_mlp_cuda`` (apex's extension):
    its two entry points, both :func:`wgrad_gemm_accum`."""

    wgrad_gemm_accum_fp32 = staticmethod(wgrad_gemm_accum)
    wgrad_gemm_accum_fp16 = staticmethod(wgrad_gemm_accum)


def install_wgrad_accumulation(device: torch.device, dtype: torch.dtype) -> str:
    """``parallel.gradient_accumulation_fusion``: megatron's linear layers then add each weight
    gradient to the parameter's float32 ``main_grad`` inside its GEMM, through apex's
    ``fused_weight_gradient_mlp_cuda`` where it is installed, else through
    :func:`wgrad_gemm_accum` (torch alone). Megatron's own path without it writes every
    weight gradient in bfloat16 and DDP's hook adds it to ``main_grad``: an extra read and
    write of each gradient per micro batch. Call before the model is built, with the device and
    the parameters' dtype; refuses a CUDA device where neither apex nor torch's out_dtype GEMM is
    there. Returns which implementation runs (run_meta's ``wgrad_accumulation``)."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False) and hasattr(layers, "fused_weight_gradient_mlp_cuda"):
        if layers.fused_weight_gradient_mlp_cuda is not _WgradAccumulation:
            return "apex fused_weight_gradient_mlp_cuda"
    if device.type == "cuda" and dtype != torch.float32 and not gemm.out_dtype_gemm(device, dtype):
        raise RuntimeError(
            f"parallel.gradient_accumulation_fusion: neither apex's fused_weight_gradient_mlp_cuda nor a torch whose "
            f"GEMMs write float32 from {dtype} (torch.addmm with out_dtype, torch >= 2.8; this is {torch.__version__}) "
            "is here; set parallel.gradient_accumulation_fusion: false"
        )
    mcore_patches.replace("wgrad_accumulation", fused_weight_gradient_mlp_cuda=_WgradAccumulation, _grad_accum_fusion_available=True)
    return "torch addmm into main_grad"


# ``parallel.offload_pinned_copy``: megatron-core's host optimizer (``HybridDeviceOptimizer``, 0.16
# and 0.19) makes each parameter it offloads with ``detach().clone().cpu().pin_memory()``: a copy on
# the device, one into pageable host memory, and one more into pinned memory. For llama3_8b on one
# H200 (40 % of the float32 parameters, 12.3 GiB) that took 11.2-12.2 s of the start-up with the
# allocator registering its pinned memory, where one copy into a pinned buffer took 1.5 s
# (docs/results/probes/2026-12-01_h200x1_offload-build). The split itself is megatron's, kept as is.


def offload_param_groups(self: Any, offload_fraction: float) -> tuple:
    """``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` with each offloaded parameter
    copied once, straight into pinned host memory: the same groups, maps and values as
    megatron's. Parameters go to the host in order while fewer than ``offload_fraction`` of the
    device's elements have gone; with ``param_update_in_fp32`` a parameter not in float32 gets a
    float32 copy, which the maps name in its place."""
    on_device = sum(p.numel() for group in self.param_groups for p in group["params"] if p.is_cuda)
    threshold, offloaded = on_device * offload_fraction, 0
    host_groups: list[dict] = []
    device_groups: list[dict] = []
    to_host: dict = {}  # device parameter -> its host copy (megatron's gpu_params_map_cpu_copy)
    to_device: dict = {}  # the other way (cpu_copys_map_gpu_param)
    fp32: dict = {}  # parameter -> its float32 copy (param_to_fp32_param)
    for group in self.param_groups:
        split: dict[bool, list] = {True: [], False: []}  # on the device?
        for param in group["params"]:
            held, host_copy = param, False
            if offloaded < threshold and param.is_cuda:
                held = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
                held.copy_(param.detach())
                offloaded += held.numel()
                host_copy = True
            if self.param_update_in_fp32 and held.dtype != torch.float32:
                held = held.detach().float()
                fp32[param] = held
            if host_copy:
                to_host[param], to_device[held] = held, param
            split[held.is_cuda].append(held)
        for placed, groups in ((True, device_groups), (False, host_groups)):
            if split[placed]:
                groups.append({**group, "params": split[placed]})
    return host_groups, device_groups, to_host, to_device, fp32


def install_offload_copy(on: bool) -> str:
    """``parallel.offload_pinned_copy``: megatron's host optimizer makes its parameter copies with
    :func:`offload_param_groups` (one copy each) or, off, its own three. Call before the optimizer is
    built. Returns how the copies are made (run_meta's ``offload_copy``)."""
    if on:
        mcore_patches.replace("offload_copy", **{"HybridDeviceOptimizer._get_sub_optimizer_param_groups": offload_param_groups})
        return "one copy into pinned memory"
    mcore_patches.restore("offload_copy")
    return "megatron (device clone, host copy, pinned copy)"


# ``parallel.fused_grad_clip``: without apex or TransformerEngine megatron-core (0.16, 0.19) takes
# the gradient norm with one ``torch.norm`` per tensor, gathered through ``torch.tensor`` on the
# host (a device-to-host copy and wait per tensor), and clips with ``dst.copy_(src * scale)`` per
# tensor (a product into a new tensor, then a copy: two passes over every gradient). The switch
# hands megatron's clip module what ``torch.nn.utils.clip_grad_norm_`` runs: one multi-tensor norm
# kept on the device and one multi-tensor in-place product.


def foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """Stands in for ``multi_tensor_l2norm`` (``(norm of all tensors as one vector, None)``),
    as megatron's clip module calls it: the norms of the tensors in ``torch._foreach_norm``'s
    multi-tensor kernels, then the norm of those, on the device."""
    if per_tensor:
        raise ValueError("parallel.fused_grad_clip: the per-tensor norms of multi_tensor_l2norm are not provided")
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1), None
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list, scale: Any) -> None:
    """Stands in for ``multi_tensor_scale`` (``dst = src * scale`` for each pair): in place with
    ``torch._foreach_mul_`` where each destination is its source (megatron's clipping), else a
    product and a copy per tensor as megatron's own fallback does."""
    src, dst = tensor_lists
    if len(src) == len(dst) and all(a is b for a, b in zip(src, dst)):
        if src:
            torch._foreach_mul_(dst, scale)
        return
    for a, b in zip(src, dst, strict=True):
        b.copy_(a * scale)


def install_grad_clip(on: bool) -> str:
    """``parallel.fused_grad_clip``: route megatron's clip module (``optimizer.clip_grads``, which
    looks ``l2_norm_impl`` and ``multi_tensor_scale_impl`` up when it runs) to :func:`foreach_l2_norm`
    and :func:`foreach_scale` where it holds megatron's own per-tensor fallbacks, or back to those
    when ``on`` is false. Where apex or TransformerEngine gave it their fused kernels those stay.
    Returns the implementation in use (run_meta's ``grad_clip_kernel``)."""
    norm = mcore_patches.original("grad_clip", "l2_norm_impl")
    fallback = getattr(norm, "__module__", "") == "megatron.core.utils"
    if on and fallback:
        mcore_patches.replace("grad_clip", l2_norm_impl=foreach_l2_norm, multi_tensor_scale_impl=foreach_scale)
        return "torch foreach (norm on the device, scaling in place)"
    mcore_patches.restore("grad_clip")
    return "megatron per-tensor" if fallback else f"{getattr(norm, '__module__', '?')} multi-tensor"


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers inside megatron's wrappers (a chain of them, each holding ``.optimizer``)."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chain]


def _adam_kernel(opt: torch.optim.Optimizer) -> str:
    """How ``opt`` steps: torch's Adam/AdamW as ``fused`` (one kernel per group of parameters),
    ``foreach`` (a kernel per operation over lists of tensors) or ``for-loop``, by the group
    flags and, where they leave it to torch, torch's own default for these tensors; other
    optimizers (apex's or TransformerEngine's FusedAdam) by their class."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return f"{type(opt).__module__.split('.')[0]} {type(opt).__name__}"
    group = opt.param_groups[0]
    if group.get("fused"):
        mode = "fused"
    elif group.get("foreach") is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for g in opt.param_groups for p in g["params"]]
        mode = "foreach" if _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1] else "for-loop"
    else:
        mode = "foreach" if group["foreach"] else "for-loop"
    return f"torch {type(opt).__name__} {mode}"


def fuse_adam(optimizer: Any, on: bool) -> str:
    """``parallel.fused_adam``: without apex or TransformerEngine megatron-core steps with torch's
    Adam/AdamW, which torch runs as ``foreach`` kernels on GPUs (a kernel per operation of the
    update: several passes over the parameters, moments and gradients); ``on`` switches every
    parameter group of those to torch's fused implementation (one pass; the same update to
    float32 rounding). Set before the first step, so the step counters are made where the fused
    kernel wants them (on the device).
    Returns the kernel each inner optimizer runs (run_meta's ``adam_kernel``), ``; ``-joined."""
    inner = _torch_adams(optimizer)
    if on:
        for opt in inner:
            if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                continue  # apex's / TransformerEngine's FusedAdam: fused already
            if any(opt.state.values()):
                raise RuntimeError("parallel.fused_adam: the optimizer has stepped already; switch it before the first step")
            for group in opt.param_groups:
                group["foreach"], group["fused"] = False, True
            opt.defaults.update(foreach=False, fused=True)
    return "; ".join(dict.fromkeys(_adam_kernel(o) for o in inner))
