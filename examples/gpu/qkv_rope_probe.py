"""Times ``parallel.fused_rope: qkv`` (cases/llama3/megatron/kernels.py) at a TP2 rank's share of
llama3_8b (sequence 8192, micro batch 2, 4 KV groups of 4 query heads, head dim 128, bf16) on one
CUDA device, forward and backward, and the backward's alternatives:

    PYTHONPATH=$PWD python3 examples/gpu/qkv_rope_probe.py

``bwd permuted dq``: the rotations and the concatenation as one Inductor kernel, the query's
gradient in the layout attention's backward gives it ([b, h, s, d] permuted); ``bwd contiguous
dq`` the same from a contiguous gradient; ``pieces then cat``: the rotations as one compiled
region and the concatenation after it (what the switch runs since 2026-11-28); ``same``: whether
the alternatives give the same bits. Output of 2026-11-28 on H200:
docs/results/probes/2026-11-28_h200x2_qkv-rope/qkv_rope_probe.txt.
"""

import sys

import torch

sys.path.insert(0, ".")
from cases.llama3.megatron import kernels
from examples.gpu.timing import cuda_ms
from training import fused

s, b, g, qpg, d = 8192, 2, 4, 4, 128
dev = "cuda"
mixed = torch.randn(s, b, g, (qpg + 2) * d, device=dev, dtype=torch.bfloat16)
inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
ang = torch.outer(torch.arange(s, device=dev, dtype=torch.float32), inv)
freqs = torch.cat((ang, ang), -1)[:, None, None, :]
cos, sin = kernels.rope_tables(freqs, torch.bfloat16)
dq = torch.randn(b, g * qpg, s, d, device=dev, dtype=torch.bfloat16).permute(2, 0, 1, 3)
dk = torch.randn(s, b, g, d, device=dev, dtype=torch.bfloat16)
dv = torch.randn_like(dk)


def t(fn):
    return cuda_ms(fn, 50)


def one_kernel(dq, dk, dv, cos, sin):
    return torch.cat((*kernels._qk_rope_grads(dq, dk, cos, sin), dv), -1)


bwd = fused.compiled(one_kernel)
fwd = fused.compiled(kernels.qkv_split_rope)
pw = fused.compiled(lambda dq, dk, dv, cos, sin: kernels._qk_rope_grads(dq, dk, cos, sin))
print(f"fwd {t(lambda: fwd(mixed, cos, sin, qpg * d, d)):.3f} ms")
print(f"bwd permuted dq {t(lambda: bwd(dq, dk, dv, cos, sin)):.3f} ms")
dqc = dq.contiguous()
print(f"bwd contiguous dq {t(lambda: bwd(dqc, dk, dv, cos, sin)):.3f} ms")
print(f"copy dq {t(lambda: dq.contiguous()):.3f} ms")
print(f"bwd copy+contig {t(lambda: bwd(dq.contiguous(), dk, dv, cos, sin)):.3f} ms")
print(f"pieces then cat {t(lambda: torch.cat((*pw(dq, dk, dv, cos, sin), dv), -1)):.3f} ms")
ref = bwd(dq, dk, dv, cos, sin)
alt = torch.cat((*pw(dq, dk, dv, cos, sin), dv), -1)
print("same", torch.equal(ref, alt), torch.equal(ref, bwd(dqc, dk, dv, cos, sin)))
print(f"memcpy 96MiB-equivalent {t(lambda: mixed.clone()):.3f} ms")
