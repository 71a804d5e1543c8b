"""training/weights.py: the starting-weight draws are one algorithm, the same on every device.

Each element of ``full_normal`` is recomputed here in plain Python integers and floats
(SplitMix64 on (parameter key, index), two 24-bit uniforms, Box-Muller), so the torch
code is held to the written algorithm, not to a particular device's generator: a CPU and a
GPU give the same tensor (checked bit for bit on an H100, docs/cases/llama3.md). The
tensor code runs in the megatron environment's Python (torch is not on the host).
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from training import weights

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def element(seed: int, name: str, i: int, std: float, mean: float = 0.0) -> float:
    """Element ``i`` of parameter ``name``'s full tensor, from the algorithm alone (float64)."""
    base = (i * 2 * GOLDEN + (weights.stream_seed(seed, name) + 1) * GOLDEN) & M64
    u1 = ((_mix(base) >> 40) + 0.5) / 2**24
    u2 = ((_mix((base + GOLDEN) & M64) >> 40) + 0.5) / 2**24
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2) * std + mean


def test_stream_seed_depends_on_the_seed_and_the_name_only():
    a = weights.stream_seed(1234, "decoder.layers.3.mlp.linear_fc1.weight")
    assert a == weights.stream_seed(1234, "decoder.layers.3.mlp.linear_fc1.weight") and 0 <= a < 1 << 63
    assert (
        len(
            {
                a,
                weights.stream_seed(1235, "decoder.layers.3.mlp.linear_fc1.weight"),
                weights.stream_seed(1234, "decoder.layers.2.mlp.linear_fc1.weight"),
            }
        )
        == 3
    )


_DRAW = """
import json, sys, torch
from training import weights as w
spec = json.loads(sys.argv[1])
x = w.full_normal(spec["seed"], spec["name"], spec["shape"], spec["std"], "cpu", mean=spec["mean"])
w.CHUNK = 777  # another chunking: the same values
y = w.full_normal(spec["seed"], spec["name"], spec["shape"], spec["std"], "cpu", mean=spec["mean"])
flat = x.reshape(-1).double()
print(json.dumps({"dtype": str(x.dtype), "shape": list(x.shape), "same_chunked": bool(torch.equal(x, y)),
                  "picked": [float(flat[i]) for i in spec["picked"]], "mean": float(flat.mean()), "std": float(flat.std()),
                  "lag1": float(((flat[:-1] - flat.mean()) * (flat[1:] - flat.mean())).mean() / flat.var())}))
"""


@pytest.mark.framework("megatron")
def test_full_normal_is_the_written_algorithm_whatever_the_chunking(megatron_python):
    from run_benchmarks.planning.registry import ROOT

    spec = {
        "seed": 1234,
        "name": "decoder.layers.0.self_attention.linear_qkv.weight",
        "shape": [384, 1024],
        "std": 0.02,
        "mean": 0.5,
        "picked": [0, 1, 2, 4095, 200_001, 384 * 1024 - 1],
    }
    proc = subprocess.run(
        [megatron_python, "-c", _DRAW, json.dumps(spec)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["dtype"] == "torch.float32" and got["shape"] == spec["shape"] and got["same_chunked"]
    for i, v in zip(spec["picked"], got["picked"]):  # float32 rounding of the float64 value
        want = element(spec["seed"], spec["name"], i, spec["std"], spec["mean"])
        assert abs(v - want) <= 4e-8 * abs(want), (i, v, want)
    n = 384 * 1024
    assert abs(got["mean"] - 0.5) < 5 * 0.02 / math.sqrt(n) and abs(got["std"] / 0.02 - 1) < 0.01
    assert abs(got["lag1"]) < 5 / math.sqrt(n)  # neighbouring elements uncorrelated
