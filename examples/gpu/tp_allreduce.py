"""The tensor-parallel all-reduce of llama3_8b's TP2 layout alone, beside GEMMs, and in a
layer's backward (docs/results/history.md, 2026-11-28). Needs two CUDA GPUs of one host:

    torchrun --nproc_per_node 2 examples/gpu/tp_allreduce.py LABEL forward|backward

with NCCL variables (``NCCL_MIN_NCHANNELS``, ``NCCL_MAX_NCHANNELS``, ``NCCL_PROTO``) set for the
variant named by LABEL, and the vendor's (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) kept.

``forward``: a bf16 ``[16384, 4096]`` all-reduce (a layer's row-parallel output at micro batch 2,
sequence 8192) alone; an fc1-shaped GEMM alone; three such GEMMs with the all-reduce on another
stream beside them; with LABEL ``default`` also torch's symmetric-memory one-shot and two-shot
all-reduces (no multicast), the latter with and without the copy into its buffer.

``backward``: the backward of a layer's two column-parallel linears (fc1 then qkv): the input
gradient's GEMM, its all-reduce beside the weight gradient's GEMM (megatron's order:
``async_op=True`` before the weight gradient, waited after it), or before it (``serial``), or no
all-reduce; each measured twice, in the order printed. Milliseconds per call, from rank 0.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())

import torch
import torch.distributed as dist

from examples.gpu.timing import cuda_ms
from training import gemm

TOKENS, HIDDEN = 16384, 4096


def timed(fn, n: int) -> float:
    return cuda_ms(fn, n, ready=dist.barrier)


def forward(dev: torch.device) -> dict:
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    a = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, 7168, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(x)
        for _ in range(3):
            a @ w
        torch.cuda.current_stream().wait_stream(side)

    res = {"nccl": timed(lambda: dist.all_reduce(x), 40), "gemm": timed(lambda: a @ w, 40), "gemm3+nccl": timed(both, 40)}
    if sys.argv[1] == "default":
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=dev)
        symm_mem.rendezvous(buf, name)
        buf.copy_(x)
        res["symm one_shot"] = timed(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name), 40)
        res["symm two_shot_"] = timed(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name), 40)
        res["copy+two_shot_"] = timed(lambda: (buf.copy_(x), torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)), 40)
    return res


def backward(dev: torch.device) -> dict:
    outs = {"qkv": 3072, "fc1": 14336}  # a TP2 rank's output features
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    dy = {k: torch.randn(TOKENS, n, device=dev, dtype=torch.bfloat16) for k, n in outs.items()}
    w = {k: torch.randn(n, HIDDEN, device=dev, dtype=torch.bfloat16) for k, n in outs.items()}
    main_grad = {k: torch.zeros(n, HIDDEN, device=dev, dtype=torch.float32) for k, n in outs.items()}

    def layer(mode: str) -> None:
        for k in ("fc1", "qkv"):
            dx = dy[k] @ w[k]
            if mode == "serial":
                dist.all_reduce(dx)
            handle = dist.all_reduce(dx, async_op=True) if mode == "overlap" else None
            gemm.accumulate_product(main_grad[k], dy[k].t(), x)
            if handle is not None:
                handle.wait()

    order = ("gemms only", "none"), ("overlap", "overlap"), ("serial", "serial"), ("overlap again", "overlap"), ("serial again", "serial")
    return {label: timed(lambda m=mode: layer(m), 30) for label, mode in order}


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    res = (backward if sys.argv[2] == "backward" else forward)(torch.device("cuda", rank))
    if rank == 0:
        line = " ".join(f"{k}={v:.3f}ms" for k, v in res.items())
        if "nccl" in res:
            line += f" nccl_busbw={TOKENS * HIDDEN * 2 / res['nccl'] / 1e6:.0f}GB/s"
        print(sys.argv[1], line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
