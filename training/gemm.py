"""Matrix products whose result is wanted in float32 from bfloat16 / float16 inputs, without the
kernels that usually surround them.

A GEMM sums in float32 whatever its inputs; written the plain way, ``(a @ b).float()`` rounds
that sum to the inputs' dtype, then a second kernel widens it again, and ``buf += a @ b`` writes
the rounded product and adds it to the float32 buffer in a third. On CUDA torch's ``out_dtype``
GEMMs (torch >= 2.8; ``mm.dtype_out`` / ``addmm.dtype_out``, registered for CUDA alone) write
float32 directly, and with ``out=buf`` add into the buffer inside the GEMM (cuBLAS with beta 1):

- :func:`float32_product`: ``a @ b`` in float32 (a loss's logits);
- :func:`accumulate_product`: ``buf += a @ b`` (a weight gradient summed over chunks or micro
  batches: megatron's ``gradient_accumulation_fusion``, the chunked losses' output layer).

Neither rounds to the inputs' dtype on the way, so results are as exact as the plain path's or
more, not bit-equal to it. Elsewhere (a CPU, float32 inputs) the plain arithmetic runs.

Torch only; nothing of a framework.
"""

from __future__ import annotations

import torch

_NARROW = (torch.bfloat16, torch.float16)


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D) in float32: one GEMM writing float32 on CUDA with bf16 / fp16 inputs,
    else the product in the inputs' dtype, widened."""
    if a.device.type == "cuda" and a.dtype in _NARROW:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.matmul(a, b).float()


def accumulate_product(buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``buf += a @ b`` (2-D), the product summed into ``buf`` inside its GEMM: ``addmm_`` where
    the inputs have the buffer's dtype, torch's ``out_dtype`` GEMM for bf16 / fp16 inputs into a
    float32 buffer on CUDA; elsewhere (mixed dtypes on a CPU) the inputs cast up first."""
    if a.dtype == buf.dtype:
        buf.addmm_(a, b)
    elif buf.device.type == "cuda" and a.dtype in _NARROW:
        try:
            torch.addmm(buf, a, b, out_dtype=buf.dtype, out=buf)
        except (TypeError, RuntimeError) as exc:
            raise RuntimeError(
                f"torch {torch.__version__} cannot add a {a.dtype} product into a {buf.dtype} buffer in one GEMM "
                f"(torch.addmm with out_dtype, torch >= 2.8): {exc}"
            ) from exc
    else:
        buf.addmm_(a.to(buf.dtype), b.to(buf.dtype))
