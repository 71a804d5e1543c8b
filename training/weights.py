"""Layout-invariant, device-independent starting weights.

Every parameter's full (unsharded) value is a function of the run's seed and the
parameter's layout-free name alone: :func:`full_normal` draws the whole tensor on
the device, and each rank keeps its own shard of it. So TP / PP / DP / ZeRO /
sharding layouts of one case start from the same model, which the loss gate
needs: vendors on different layouts are held to one reference curve.

The draw does not use the framework's generator. torch's CUDA generator lays its
Philox streams out by the card's multiprocessor count (an A100 and an H100 would
start from different models) and its CPU generator is another algorithm. Here the
value of element ``i`` is a counter-based hash of (parameter key, ``i``): a
SplitMix64 finalizer in 64-bit integer arithmetic (wrapping, the same on every
device), two 24-bit uniforms, and a Box-Muller transform in float64 rounded to
float32. Integer steps are exact everywhere; the float64 transform can differ
between devices' math libraries in its last bits, which the rounding to float32
hides for all but a few elements. So a CPU, an H100 and another vendor's chip
start from the same weights, and the draw is chunked without changing a value.

A layout-free name is the parameter's name in the unsharded, single-stage
model (pipeline stages use the global layer index, never a stage-local one).

:func:`stream_seed` is plain Python so that every framework can use it; the
tensor helpers need torch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

CHUNK = 1 << 24  # elements drawn at a time: bounds the transient memory (about 0.5 GiB)

# SplitMix64's constants as signed 64-bit integers (torch has no uint64 arithmetic)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def stream_seed(seed: int, name: str) -> int:
    """A 63-bit key for parameter ``name`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _i64(v: int) -> int:
    """A Python integer wrapped to a signed 64-bit one (as the tensors' arithmetic wraps)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: Any, k: int) -> Any:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: Any) -> Any:
    """SplitMix64's finalizer on int64 tensors, in wrapping arithmetic."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _standard_normal(key: int, start: int, count: int, device: Any) -> Any:
    """Elements ``start .. start+count-1`` of the standard-normal stream of ``key``, float64."""
    import torch

    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    base = i * _i64(2 * _GOLDEN) + _i64((key + 1) * _GOLDEN)  # two counters per element
    scale = 1.0 / (1 << 24)
    u1 = (_shr(_mix(base), 40).to(torch.float64) + 0.5) * scale  # in (0, 1): log(u1) is finite
    u2 = (_shr(_mix(base + _GOLDEN), 40).to(torch.float64) + 0.5) * scale
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


#: devices this process has drawn one element on (full_normal)
_FIRST_DRAWN: set[str] = set()


def full_normal(seed: int, name: str, shape: Sequence[int], std: float, device: Any, mean: float = 0.0) -> Any:
    """The full float32 tensor of ``name``: normal(mean, std), drawn on ``device``."""
    import torch

    dims = tuple(int(d) for d in shape)
    n = math.prod(dims)
    key = stream_seed(seed, name)
    if str(device) not in _FIRST_DRAWN:
        # one element first, on one thread. In the llama3 case on the CPU (torch 2.13, 2 threads)
        # the first multi-threaded draw of a process came out up to 1.2e-10 off (relative) in one
        # thread's half of the elements in 7 of 14 processes, the later draws exact: enough to move
        # an element across a float32 rounding boundary (one of the embedding's 65,536 differed from
        # the two-process layouts'). With this draw first: 0 of 14. Why the first one is off is not
        # known.
        _standard_normal(key, 0, 1, device)
        _FIRST_DRAWN.add(str(device))
    out = torch.empty(n, dtype=torch.float32, device=device)
    for start in range(0, n, CHUNK):
        count = min(CHUNK, n - start)
        out[start : start + count] = _standard_normal(key, start, count, device) * std + mean
    return out.view(dims)


def shard(full: Any, dim: int, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous 1/``world`` slice of ``full`` along ``dim``."""
    size = full.shape[dim]
    if size % world:
        raise ValueError(f"dimension {dim} of size {size} does not split into {world} equal shards")
    step = size // world
    return full.narrow(dim, rank * step, step)
