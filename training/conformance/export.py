"""What a case's conformance probe hands the reference: its tensors in the probe file's form.

A probe (``cases/<family>/<framework>/conformance.py``) builds the case's parts as its run
does, runs forward and backward once on seeded inputs, and fills a :class:`ProbeFile`: the
parameters under the reference's canonical names (training/conformance/reference.py), the
inputs, the outputs at the sampled positions, and for each parameter the projections of its
gradient on two directions, computed on the device in float64. Torch-side helpers here; a
probe of a framework without torch (paddle) hands numpy arrays: :meth:`ProbeFile.parameter_numpy`
makes the same projections in float64 numpy, on the reference's own ``hash_direction`` (imported
from training/conformance/reference.py, which is numpy alone and imports nothing of this side).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

#: relative tolerances by declared precision (docs/metrics.md, the conformance study)
TOLERANCES = {
    "fp32": {"output": 1e-4, "gradient": 1e-3},
    "bf16": {"output": 2.5e-2, "gradient": 5e-2},
    "fp16": {"output": 1e-2, "gradient": 3e-2},
}


_T0 = time.monotonic()


def log(what: str) -> None:
    """Progress on stderr, with seconds since the probe's import (its process's start, nearly)."""
    print(f"probe: {time.monotonic() - _T0:7.2f} s {what}", file=sys.stderr, flush=True)


def sample_positions(seq: int, count: int = 64, seed: int = 1234) -> np.ndarray:
    """Query positions to compare: every position of a short sequence; of a long one, the first
    eight, the last eight, and the rest spread over each quarter (late queries whose keys lie
    far back among them)."""
    if seq <= count:
        return np.arange(seq, dtype=np.int64)
    rng = np.random.default_rng(seed)
    first, last = np.arange(8), np.arange(seq - 8, seq)
    per = (count - 16) // 4
    spread = [rng.choice(np.arange(b * seq // 4, (b + 1) * seq // 4), per, replace=False) for b in range(4)]
    return np.unique(np.concatenate([first, last, *spread])).astype(np.int64)


def hash_direction_torch(n: int, salt: int, device: Any) -> Any:
    """training/conformance/reference.py's ``hash_direction``, computed with torch on ``device``."""
    import torch

    x = (torch.arange(n, dtype=torch.int64, device=device) + salt * 7919) & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return (x & 0xFFFFFF).to(torch.float64) / float(1 << 24) - 0.5


def packbits_torch(mask: Any) -> np.ndarray:
    """``np.packbits`` of a boolean tensor (the first element the high bit of the first byte, the
    last byte padded with zeros), packed where the tensor is: a device sends an eighth of the bytes."""
    import torch

    flat = mask.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=flat.device)
    return (flat.view(-1, 8).to(torch.int32) * bits).sum(dim=1).to(torch.uint8).cpu().numpy()


def to_numpy(t: Any) -> np.ndarray:
    """A tensor as numpy, bfloat16 as its uint16 bits (the reference widens them exactly)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return t.float().cpu().numpy() if t.dtype == torch.float16 else t.cpu().numpy()


class ProbeFile:
    """The arrays of one probe, written as a folder of ``.npy`` files (:meth:`write`)."""

    def __init__(self, spec: dict[str, Any], precision: str):
        if precision not in TOLERANCES:
            raise ValueError(f"no conformance tolerance for precision {precision!r} (have {', '.join(TOLERANCES)})")
        self.spec = {**spec, "precision": precision, "tolerance": TOLERANCES[precision]}
        self.arrays: dict[str, np.ndarray] = {}

    def add_array(self, name: str, value: np.ndarray) -> None:
        self.arrays[name] = value

    def inputs(self, tokens: Any, labels: Any, positions: np.ndarray) -> None:
        self.arrays["tokens"] = np.asarray(to_numpy(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        self.arrays["labels"] = np.asarray(to_numpy(labels) if not isinstance(labels, np.ndarray) else labels, dtype=np.int64)
        self.arrays["positions"] = positions.astype(np.int64)

    def output(self, name: str, value: Any) -> None:
        """``value`` at the sampled positions, first axis the positions."""
        self.arrays[f"out:{name}"] = to_numpy(value) if not isinstance(value, np.ndarray) else value

    def parameter(self, name: str, value: Any, grad: Any, salt: int) -> None:
        """A parameter under its canonical name and its gradient's two projections: on the sign of
        the gradient itself, and on the counter-hash direction of ``salt``."""
        import torch

        self.arrays[f"param:{name}"] = to_numpy(value)
        g = (torch.zeros_like(value) if grad is None else grad).detach().to(torch.float64).reshape(-1)
        sign = torch.sign(g)
        d = hash_direction_torch(g.numel(), salt, g.device)
        self.arrays[f"grad:{name}:sign_pos"] = packbits_torch(sign > 0)
        self.arrays[f"grad:{name}:sign_neg"] = packbits_torch(sign < 0)
        l1 = np.float64(g.abs().sum().item())  # on its own sign the projection has no cancellation: it is its own magnitude
        self.arrays[f"grad:{name}:sign"] = self.arrays[f"grad:{name}:sign_mag"] = l1
        self.arrays[f"grad:{name}:hash"] = np.float64((g * d).sum().item())
        self.arrays[f"grad:{name}:hash_mag"] = np.float64((g.abs() * d.abs()).sum().item())
        self.arrays[f"grad:{name}:salt"] = np.int64(salt)

    def parameter_numpy(self, name: str, value: np.ndarray, grad: np.ndarray | None, salt: int) -> None:
        """:meth:`parameter` for numpy arrays (a framework without torch): ``value`` as the run holds
        it (float32, float16, or bfloat16 as its uint16 bits), ``grad`` of its shape in a float
        type (None: no gradient reached it); the projections in float64 numpy."""
        from training.conformance.reference import hash_direction

        value = np.ascontiguousarray(value)
        self.arrays[f"param:{name}"] = value.astype(np.float32) if value.dtype == np.float16 else value
        g = np.zeros(value.size) if grad is None else np.asarray(grad, dtype=np.float64).reshape(-1)
        if g.size != value.size:
            raise ValueError(f"conformance probe: the gradient of {name} has {g.size} elements, its value {value.size}")
        d = hash_direction(g.size, salt)
        self.arrays[f"grad:{name}:sign_pos"] = np.packbits(g > 0)
        self.arrays[f"grad:{name}:sign_neg"] = np.packbits(g < 0)
        l1 = np.float64(np.abs(g).sum())
        self.arrays[f"grad:{name}:sign"] = self.arrays[f"grad:{name}:sign_mag"] = l1
        self.arrays[f"grad:{name}:hash"] = np.float64((g * d).sum())
        self.arrays[f"grad:{name}:hash_mag"] = np.float64((np.abs(g) * np.abs(d)).sum())
        self.arrays[f"grad:{name}:salt"] = np.int64(salt)

    def embedding_rows(self, weight: Any, grad: Any, rows: Any) -> None:
        """The token embedding's rows the input reads (``rows``, the inputs' ids remapped to them), as
        ``embedding``, and the size of its gradient on every other row, which must be none."""
        import torch

        g = torch.zeros_like(weight) if grad is None else grad
        rows = rows.to(weight.device)
        self.parameter("embedding", weight.detach()[rows], g[rows], salt=1)
        outside = g.float().clone()
        outside[rows] = 0
        self.arrays["grad:embedding:outside"] = np.float64(outside.norm().item())
        self.arrays["grad:embedding:inside"] = np.float64(g[rows].float().norm().item())

    def write(self, path: str) -> None:
        """The probe folder ``path``: one ``.npy`` file an array, named by the array (the reference
        maps them, reading no more than it uses)."""
        log("exported")
        os.makedirs(path)
        for name, value in {"spec": np.array(json.dumps(self.spec)), **self.arrays}.items():
            np.save(os.path.join(path, f"{name}.npy"), value, allow_pickle=False)
        log("written")
