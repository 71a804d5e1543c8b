"""Starting weights of a DeepSpeed model that do not depend on its layout.

A model built by a case (under ``deepspeed.zero.Init`` for ZeRO-3, else whole)
has its parameters overwritten here, one at a time: each parameter's full value
is drawn on the rank's device from the stream of (run seed, parameter name)
(``training.weights``), by the case's rule for that parameter (the model's own
initialization: normal with some std, or a constant). A ZeRO-3 partitioned
parameter keeps only this rank's partition, written straight into
``p.ds_tensor``; nothing is gathered. So ZeRO stages 0-3 and every
data-parallel size start from the same model, on every device (the draws of ``training.weights``
do not depend on the device)::

    with deepspeed_loop.model_init_context(ds_config):
        model = build()
    info = deepspeed_weights.starting_weights(model, seed, rule, device)  # before deepspeed.initialize

``rule(name)`` is a :class:`Normal` or a :class:`Constant` for every parameter
name of the model (a case writes it next to its model).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from training.accelerator import Accelerator
from training.weights import full_normal


@dataclasses.dataclass(frozen=True)
class Normal:
    std: float
    mean: float = 0.0


@dataclasses.dataclass(frozen=True)
class Constant:
    value: float


Init = Normal | Constant
Rule = Callable[[str], Init]
ZEROS, ONES = Constant(0.0), Constant(1.0)


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's unpartitioned shape (a ZeRO-3 parameter's own ``shape`` is empty)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def initial_value(seed: int, name: str, shape: tuple[int, ...], init: Init, device: torch.device) -> torch.Tensor:
    """The full float32 starting value of parameter ``name``, on ``device``."""
    if isinstance(init, Normal):
        return full_normal(seed, name, shape, init.std, device, mean=init.mean)
    if isinstance(init, Constant):
        return torch.full(shape, float(init.value), dtype=torch.float32, device=device)
    raise TypeError(f"{name}: initialization rule {init!r} is neither Normal nor Constant")


def write_full(p: torch.Tensor, full: torch.Tensor, name: str = "parameter") -> None:
    """Give ``p`` the value ``full`` (its full shape; any dtype and device).

    A ZeRO-3 partitioned parameter gets only this rank's partition in ``p.ds_tensor``.
    DeepSpeed's rule (``_partition_param`` in deepspeed/runtime/zero/partition_parameters.py):
    the flattened parameter, padded at its end to a multiple of the partition count, is
    cut into equal pieces in rank order. The padding is written as zeros.
    """
    if tuple(full.shape) != full_shape(p):
        raise ValueError(f"{name}: value of shape {tuple(full.shape)} for a parameter of shape {full_shape(p)}")
    with torch.no_grad():
        if not is_partitioned(p):
            p.data.copy_(full)
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(
                f"{name}: a ZeRO-3 parameter is written while gathered ({p.ds_status.name}); "
                "write starting weights before deepspeed.initialize"
            )
        part = p.ds_tensor
        size = int(part.ds_numel)
        start = size * _partition_rank(p)
        flat = full.reshape(-1)
        n = max(0, min(size, flat.numel() - start))  # the last ranks hold the padding
        part.narrow(0, 0, n).copy_(flat.narrow(0, start, n))
        part.narrow(0, n, size - n).zero_()


def _partition_rank(p: torch.Tensor) -> int:
    rank = getattr(p, "ds_zero_partition_rank", None)  # set by DeepSpeed >= 0.16; else ask its group
    if rank is None:
        import deepspeed.comm as dist

        rank = dist.get_rank(group=p.ds_process_group)
    return int(rank)


def read_full(p: torch.Tensor) -> torch.Tensor:
    """The full value of ``p`` (a copy). A ZeRO-3 parameter is gathered: a collective, so every
    rank of its group must read the same parameters in the same order."""
    if not is_partitioned(p):
        return p.detach().clone()
    import deepspeed

    with deepspeed.zero.GatheredParameters([p]):
        return p.data.detach().clone()


def starting_weights(model: torch.nn.Module, seed: int, rule: Rule, device: torch.device) -> dict:
    """Overwrite every parameter of ``model`` with its starting value (see the module docstring).

    One full parameter at a time exists in float32 on ``device``. Returns what the run
    records: ``{"seed", "parameters", "device", "seconds"}``.
    """
    device = torch.device(device)
    acc = Accelerator.of(device)
    acc.synchronize(device)
    t0 = time.perf_counter()
    count = 0
    for name, p in model.named_parameters():
        write_full(p, initial_value(seed, name, full_shape(p), rule(name), device), name)
        count += 1
    acc.synchronize(device)
    return {"seed": int(seed), "parameters": count, "device": device.type, "seconds": round(time.perf_counter() - t0, 6)}
