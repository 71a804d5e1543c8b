"""Which SDPA backends give llama3_8b's core attention the right gradients, per input and
gradient layout (docs/cases/llama3.md, ``parallel.attention``). Needs one CUDA GPU:

    python3 examples/gpu/attention_layouts.py [SEQ]      # default 8192

For each head layout of the case's configs (micro batch, query heads, KV groups of one
tensor-parallel rank) the inputs are laid out as megatron hands them (query and key new
``[s, b, heads, d]`` tensors, value a slice of the fused QKV projection), and each backend runs
forward and backward twice: ``model``, the output handed on as the layer does
(``[s, b, heads * d]``, a contiguous gradient of that view); ``check``, a gradient with the
query's strides through a float32 product (how the attention check fed it before 2026-11-27).
Each line: the largest difference from float32 attention (K/V repeated) of output, dq, dk and
dv, relative to the largest value, and the milliseconds of forward + backward.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEV = torch.device("cuda", 0)
DTYPE = torch.bfloat16
D = 128
SEQ = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
SCALE = 1 / math.sqrt(D)
KINDS = (
    "default-gqa",  # torch picks the backend, inputs as the layer hands them
    "contig-gqa",  # torch picks, inputs made contiguous [b, heads, s, d]
    "CUDNN_ATTENTION-gqa",
    "CUDNN_ATTENTION-rep",
    "FLASH_ATTENTION-gqa",
    "FLASH_ATTENTION-rep",
    "EFFICIENT_ATTENTION-rep",
)


def inputs(b: int, h: int, g: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rep = h // g
    q = torch.randn(SEQ, b, h, D, device=DEV, dtype=DTYPE, generator=gen)  # RoPE's output: a new tensor
    k = torch.randn(SEQ, b, g, D, device=DEV, dtype=DTYPE, generator=gen)
    mixed = torch.randn(SEQ, b, g, (rep + 2) * D, device=DEV, dtype=DTYPE, generator=gen)
    v = mixed[..., (rep + 1) * D :]  # megatron's split of the fused QKV output: a view
    grad = torch.randn(SEQ, b, h * D, device=DEV, dtype=DTYPE, generator=gen)  # into [s, b, heads * d]
    return q, k, v, grad


def run(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, gmode: str) -> tuple[list, tuple]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))  # clone keeps the strides
    rep = q.shape[2] // k.shape[2]
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if kind == "truth":
        qq, kk, vv = qq.float(), kk.float().repeat_interleave(rep, 1), vv.float().repeat_interleave(rep, 1)
        with sdpa_kernel([SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=SCALE)
    else:
        backend, gqa = kind.split("-")
        if gqa == "rep":
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        if backend == "contig":
            qq, kk, vv = qq.contiguous(), kk.contiguous(), vv.contiguous()
        ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend not in ("default", "contig") else torch.enable_grad()
        with ctx:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=SCALE, enable_gqa=kk.shape[1] != qq.shape[1])
    if gmode == "model":
        y = o.permute(2, 0, 1, 3).reshape(SEQ, o.shape[0], -1)
        y.backward(grad.to(y.dtype))
    else:
        g = torch.empty_strided(qq.shape, qq.stride(), dtype=DTYPE, device=DEV)
        g.copy_(grad.view(SEQ, qq.shape[0], qq.shape[1], D).permute(1, 2, 0, 3))
        (o.float() * g.float()).sum().backward()
    return [o.detach().permute(2, 0, 1, 3).float(), q.grad.float(), k.grad.float(), v.grad.float()], tuple(o.stride())


def choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    c = torch._fused_sdp_choice(qq, kk, vv, None, 0.0, True, scale=SCALE, enable_gqa=True)
    return f"{c} ({SDPBackend(c).name})"


def main() -> None:
    print(torch.__version__, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name(0), flush=True)
    for b, h, g in ((2, 16, 4), (1, 16, 4), (1, 32, 8), (1, 8, 2), (2, 32, 8)):
        q, k, v, grad = inputs(b, h, g)
        print(f"== b {b} heads {h} groups {g} seq {SEQ}: torch picks {choice(q, k, v)}", flush=True)
        for gmode in ("model", "check"):
            truth, _ = run("truth", q, k, v, grad, gmode)
            for kind in KINDS:
                try:
                    got, ostr = run(kind, q, k, v, grad, gmode)
                    torch.cuda.synchronize()
                    t0 = time.time()
                    for _ in range(3):
                        run(kind, q, k, v, grad, gmode)
                    torch.cuda.synchronize()
                    ms = (time.time() - t0) / 3 * 1e3
                    errs = " ".join(f"{float((a - t).abs().max() / t.abs().max()):.3g}" for a, t in zip(got, truth))
                    print(f"  {gmode:5s} {kind:24s} out/dq/dk/dv off {errs}  {ms:7.1f} ms  out strides {ostr}", flush=True)
                except RuntimeError as exc:
                    print(f"  {gmode:5s} {kind:24s} {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
            del truth
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
