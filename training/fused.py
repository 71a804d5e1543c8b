"""Elementwise functions of the decoder layers and their ``torch.compile`` regions, shared by the
cases' ``fused_elementwise: compile`` switches.

The functions are the plain arithmetic, run eagerly by the plain models; :func:`compiled` gives
the same function as one full-graph ``torch.compile`` region (Inductor fuses each into one
kernel per direction, and SwiGLU keeps only its inputs for the backward):

- :func:`rms_norm`: normalize in float32, round to the input's dtype, then scale by the weight
  (transformers' ``LlamaRMSNorm``, Baichuan2's RMSNorm);
- :func:`torch_rms_norm`: ``F.rms_norm`` over the last dimension, what ``torch.nn.RMSNorm``
  computes (megatron's local norm). Torch 2.13 scales in float32 and rounds once, after the
  weight, so in bf16 the two norms differ by a rounding step: each case keeps the one its
  plain model runs;
- :func:`swiglu`: ``silu(gate) * up``; :func:`swiglu_packed` the same on one ``[..., gate; up]``
  tensor (megatron's fused fc1 output);
- :func:`rope`: rotary position embedding of queries and keys ``[batch, heads, seq, head_dim]``
  by ``cos`` and ``sin`` ``[batch, seq, head_dim]`` (transformers' ``apply_rotary_pos_emb``:
  ``x * cos + rotate_half(x) * sin``); :func:`seq_rows` marks its varying dimensions.

Shapes: ``compiled(fn)`` is static (each new input shape compiles anew, as suits a fixed
sequence length); ``compiled(fn, dynamic=True)`` takes torch's automatic dynamic shapes, and
with inputs made by :func:`token_rows` (the token count marked dynamic) one graph serves every
token count from the first capture on (micro-batches padded to their own length).

Torch only; nothing of a framework.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: torch.compile backend of every compiled region. Inductor generates the fused kernels; the
#: CPU tests set "aot_eager" (the same graph capture and autograd split without code
#: generation, which takes about half a minute per graph on a small CPU), or a counting
#: backend. Read at each :func:`compiled` call.
COMPILE_BACKEND: Any = "inductor"

_COMPILED: dict[tuple[Callable[..., Any], Any, bool], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any], dynamic: bool = False) -> Callable[..., Any]:
    """``fn`` as one ``torch.compile`` region (full graph) with :data:`COMPILE_BACKEND`, made
    once per function, backend and ``dynamic``.

    ``dynamic=False``: static shapes, a new input shape compiles anew. ``dynamic=True``:
    torch's automatic dynamic shapes (``torch.compile(dynamic=None)``): a dimension that
    changes between calls is symbolic from its second capture on. Either way a dimension
    marked with ``torch._dynamo.maybe_mark_dynamic`` (:func:`token_rows`) is symbolic from the
    first capture; the cases mark only where they ask for ``dynamic=True``.
    """
    key = (fn, COMPILE_BACKEND, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND, fullgraph=True, dynamic=None if dynamic else False)
    return _COMPILED[key]


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[tokens, features]`` (a view where ``x`` allows it), the token count marked
    dynamic for :func:`compiled` ``(fn, dynamic=True)``: one graph for every length."""
    rows = x.reshape(-1, x.shape[-1])
    torch._dynamo.maybe_mark_dynamic(rows, 0)
    return rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: normalize in float32, round to ``x``'s dtype, then
    scale by ``weight``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What ``torch.nn.RMSNorm`` computes over the last dimension (``F.rms_norm``)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


def swiglu_packed(y: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu` of one ``[..., gate; up]`` tensor: its first half of the last dimension
    is the gate, the second half ``up``."""
    gate, up = torch.chunk(y, 2, dim=-1)
    return swiglu(gate, up)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``q`` and ``k`` (``[batch, heads, seq, head_dim]``) by ``cos``
    and ``sin`` (``[batch, seq, head_dim]``): ``x * cos + rotate_half(x) * sin``, where
    ``rotate_half`` of ``[x1; x2]`` (the halves of the last dimension) is ``[-x2; x1]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def seq_rows(*tensors: torch.Tensor, seq_dim: int) -> tuple[torch.Tensor, ...]:
    """The tensors as they are, their batch (0) and sequence (``seq_dim``) dimensions marked
    dynamic for :func:`compiled` ``(fn, dynamic=True)``: one graph for every micro-batch length."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, seq_dim)
    return tensors
