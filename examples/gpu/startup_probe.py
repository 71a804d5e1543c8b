"""Where llama3_8b's ``process_groups`` start-up phase goes on one GPU (#49: 7.9-9.6 s of the
57-67 s to the first step of config_H200x1x1, 2026-12-01): the steps of
cases/llama3/megatron/train.py's ``init_distributed`` in a fresh process, each timed, then
the first collective and the first allocations of the size the build makes.

Run on the GPU machine, one process a try: ``python3 examples/gpu/startup_probe.py``
(megatron-core on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import time

T0 = time.perf_counter()


def mark(name: str, since: list[float]) -> None:
    now = time.perf_counter()
    print(f"{name:44s} {now - since[0]:7.2f} s", flush=True)
    since[0] = now


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    since = [T0]
    import torch
    import torch.distributed as dist

    mark("import torch", since)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    mark("import megatron.core", since)
    torch.cuda.set_device(0)
    mark("torch.cuda.set_device(0)", since)
    torch.empty(1, device="cuda")
    mark("first tensor on the device (the context)", since)
    dist.init_process_group(backend="nccl")
    mark("init_process_group(nccl)", since)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    mark("initialize_model_parallel(1, 1)", since)
    model_parallel_cuda_manual_seed(1234)
    mark("model_parallel_cuda_manual_seed", since)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    mark("first all_reduce (NCCL's communicator)", since)
    dist.barrier()
    torch.cuda.synchronize()
    mark("barrier", since)
    x = torch.empty(16 * 2**30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    mark("16 GiB allocated on the device", since)
    del x
    print(f"{'total':44s} {time.perf_counter() - T0:7.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
