"""The elementwise kernels of llama3_8b's TP2 layer at a rank's shape (micro batch 2, sequence
8192: 16,384 tokens, hidden 4096, fc1 output 2 x 7168), each forward alone and forward plus
backward, on one CUDA device:

    PYTHONPATH=$PWD python3 examples/gpu/norm_probe.py [TOKENS]

The residual sum and RMSNorm of ``parallel.fused_add_norm`` as liger-kernel's kernels
(``LigerRMSNorm.add_forward``) and as one compiled region (``CompiledRMSNorm.add_forward``), the
plain norm both ways, and SwiGLU both ways (cases/llama3/megatron/kernels.py). In the profiled TP2
step of 2026-11-28 (docs/results/probes/2026-11-28_h200x2_qkv-rope/kernels.txt) liger's add-norm
backward took 0.25 ms a call against 0.13 ms for its forward, which moves as many bytes: this says
whether the compiled region does better at that shape (on one H200, 2026-11-28, it does not: 0.957
ms forward plus backward against liger's 0.753; docs/results/probes/2026-11-28_h200x2_grad-clip/).
Milliseconds per call, bf16, incoming gradients of ones.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())

import torch

from cases.llama3.megatron import kernels
from examples.gpu.timing import cuda_ms as timed


class _Config:
    normalization, sequence_parallel = "RMSNorm", False


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    hidden, ffn = 4096, 7168
    dev, dt = torch.device("cuda"), torch.bfloat16
    x, r = (torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    y = torch.randn(tokens, 2 * ffn, device=dev, dtype=dt, requires_grad=True)
    rows = []
    for name, cls in (("liger", kernels.LigerRMSNorm), ("compile", kernels.CompiledRMSNorm)):
        norm = cls(_Config(), hidden).to(dev, dt)
        rows.append(
            (
                f"{name} add-norm",
                lambda m=norm: m.add_forward(x, r),
                lambda out: torch.autograd.backward(out, [torch.ones_like(o) for o in out]),
            )
        )
        rows.append((f"{name} norm", lambda m=norm: m(x), lambda out: out.backward(torch.ones_like(out))))
    for name, cls in (("liger", kernels.LigerSwiGLU), ("compile", kernels.CompiledSwiGLU)):
        act = cls()
        rows.append((f"{name} swiglu", lambda m=act: m(y), lambda out: out.backward(torch.ones_like(out))))
    print(f"{torch.cuda.get_device_name()}, {tokens} tokens, bf16")
    for label, forward, backward in rows:
        with torch.no_grad():
            fwd = timed(forward)
        both = timed(lambda f=forward, b=backward: b(f()))
        print(f"{label:18s} forward {fwd:.3f} ms   forward+backward {both:.3f} ms")


if __name__ == "__main__":
    main()
