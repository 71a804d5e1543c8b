"""Where the host optimizer's build goes on one GPU (#49: llama3_8b config_H200x1x1 spends 23.6-27.0 s
building its optimizer, 2026-12-01): the first ``FRACTION`` of llama3_8b's fp32 main parameters (TP1,
in megatron's order) copied to the host three ways, and the host Adam states made for them.

- ``megatron``: megatron-core 0.19's HybridDeviceOptimizer, ``p.detach().clone().cpu().pin_memory()``
  (a device clone, a copy into pageable memory, a second copy into pinned memory);
- ``pinned``: one pinned buffer per tensor and one copy into it;
- ``pageable``: ``p.detach().cpu()`` alone.
Then ``torch.zeros_like`` twice per host tensor (Adam's two states, as the first step makes them).

Run on the GPU machine: ``python3 examples/gpu/offload_probe.py FRACTION WAY`` (megatron, pinned or
pageable), one process a way (torch's host allocator keeps freed pinned blocks for the next one).
"""

from __future__ import annotations

import sys
import time

import torch

H, FFN, HEADS, GROUPS, LAYERS, VOCAB = 4096, 14336, 32, 8, 32, 128256
FRACTION = float(sys.argv[1]) if len(sys.argv) > 1 else 0.4
WAY = sys.argv[2] if len(sys.argv) > 2 else "pinned"


def shapes() -> list[tuple[int, ...]]:
    qkv = (HEADS + 2 * GROUPS) * (H // HEADS)
    out = [(VOCAB, H)]
    for _ in range(LAYERS):
        out += [(H,), (qkv, H), (H, H), (H,), (2 * FFN, H), (H, FFN)]
    return out + [(H,), (VOCAB, H)]


def timed(name: str, fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"{name:28s} {seconds:7.2f} s", flush=True)
    return result


def main() -> None:
    every = shapes()
    total = sum(torch.Size(s).numel() for s in every)
    chosen, n = [], 0
    for s in every:
        if n >= FRACTION * total:
            break
        chosen.append(s)
        n += torch.Size(s).numel()
    print(f"{len(chosen)} tensors, {n / 1e9:.2f} G parameters of {total / 1e9:.2f} G, {4 * n / 2**30:.1f} GiB in fp32")
    params = [torch.randn(s, device="cuda", dtype=torch.float32) for s in chosen]
    if WAY == "megatron":
        host = timed("megatron (clone, cpu, pin)", lambda: [p.detach().clone().cpu().pin_memory() for p in params])
    elif WAY == "pinned":
        host = timed("pinned buffer, one copy", lambda: [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p) for p in params])
    else:
        host = timed("pageable, one copy", lambda: [p.detach().cpu() for p in params])
    timed("Adam states (2 x zeros_like)", lambda: [(torch.zeros_like(h), torch.zeros_like(h)) for h in host])


if __name__ == "__main__":
    main()
