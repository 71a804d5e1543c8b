"""Matrix products whose result is wanted in float32 from bfloat16 / float16 inputs, without the
kernels that usually surround them.

A GEMM sums in float32 whatever its inputs; written the plain way, ``(a @ b).float()`` rounds
that sum to the inputs' dtype, then a second kernel widens it again, and ``buf += a @ b`` writes
the rounded product and adds it to the float32 buffer in a third. On CUDA torch's ``out_dtype``
GEMMs (``mm.dtype_out`` / ``addmm.dtype_out``, torch >= 2.8, registered for CUDA alone) write
float32 directly, and with ``out=buf`` add into the buffer inside the GEMM (cuBLAS with beta 1):

- :func:`float32_product`: ``a @ b`` in float32 (a loss's logits);
- :func:`accumulate_product`: ``buf += a @ b`` (a weight gradient summed over chunks or micro
  batches: the chunked losses' output layer, megatron's ``gradient_accumulation_fusion``).

Where the device or the torch has no such GEMM (:func:`out_dtype_gemm`: a CPU, an older torch
such as a container's) both run the plain arithmetic, as the code did before them; a caller that
asked for the fused path by a switch checks :func:`out_dtype_gemm` itself and refuses. The fused
path does not round to the inputs' dtype on the way, so its results are as exact as the plain
path's or more, not bit-equal to them.

Torch only; nothing of a framework.
"""

from __future__ import annotations

import torch

_NARROW = (torch.bfloat16, torch.float16)
_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def out_dtype_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs a ``dtype`` GEMM with a float32 output (and an in-place float32
    sum) on ``device``: tried once per device type and dtype on a 2 x 2 problem."""
    if device.type != "cuda" or dtype not in _NARROW:
        return False
    key = (device.type, dtype)
    if key not in _PROBED:
        a = torch.ones(2, 2, device=device, dtype=dtype)
        buf = torch.ones(2, 2, device=device, dtype=torch.float32)
        try:
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
            torch.addmm(buf, a, a, out_dtype=torch.float32, out=buf)
            ok = ok and bool((buf == 3).all())
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _PROBED[key] = ok
    return _PROBED[key]


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D) in float32: one GEMM writing float32 where :func:`out_dtype_gemm`, else the
    product in the inputs' dtype, widened."""
    if out_dtype_gemm(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.matmul(a, b).float()


def accumulate_product(buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``buf += a @ b`` (2-D): ``addmm_`` where the inputs have the buffer's dtype, a bf16 / fp16
    product summed into a float32 buffer inside its GEMM where :func:`out_dtype_gemm`, else the
    product in the inputs' dtype added to the buffer."""
    if a.dtype == buf.dtype:
        buf.addmm_(a, b)
    elif buf.dtype == torch.float32 and out_dtype_gemm(buf.device, a.dtype):
        torch.addmm(buf, a, b, out_dtype=torch.float32, out=buf)
    else:
        buf.add_(torch.matmul(a, b))
