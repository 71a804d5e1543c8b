"""Layout-invariant starting weights.

Every parameter's full (unsharded) value is a function of the run's seed and the
parameter's layout-free name alone: a generator seeded with :func:`stream_seed`
draws the whole tensor on the device, and each rank keeps its own shard of it.
So TP / PP / DP / ZeRO / sharding layouts of one case start from the same model,
which the loss gate needs: vendors on different layouts are held to one
reference curve.

A layout-free name is the parameter's name in the unsharded, single-stage
model (pipeline stages use the global layer index, never a stage-local one).
Values drawn on different device types differ (the CPU and CUDA generators are
different algorithms); within one device type they depend on nothing else.

:func:`stream_seed` is plain Python so that every framework can use it (the
paddle case draws with its own generator); the tensor helpers need torch.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence


def stream_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for parameter ``name`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def full_normal(seed: int, name: str, shape: Sequence[int], std: float, device: Any, mean: float = 0.0) -> Any:
    """The full float32 tensor of ``name``: normal(mean, std), drawn on ``device``."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(stream_seed(seed, name))
    out = torch.empty(tuple(int(d) for d in shape), dtype=torch.float32, device=device)
    return out.normal_(mean, std, generator=gen)


def shard(full: Any, dim: int, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous 1/``world`` slice of ``full`` along ``dim``."""
    size = full.shape[dim]
    if size % world:
        raise ValueError(f"dimension {dim} of size {size} does not split into {world} equal shards")
    step = size // world
    return full.narrow(dim, rank * step, step)
