"""DeepSpeed's ``zero_optimization`` section as the DeepSpeed cases build it (training/deepspeed_loop.zero_section).

Null sizes are derived from the hidden size, ZeRO-3-only keys leave the config below stage 3,
``memory_efficient_linear`` must be a boolean, and an unknown key or offload device is refused
with the key named. Unit tests need torch (the module imports it): they run here when it is
importable, else this file runs again under the deepspeed environment's Python.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.case_helpers import torch_unit, units_in_env

try:
    import torch
except ImportError:  # the host's test environment: the unit tests run in the framework env instead
    torch = None

needs_torch = torch_unit(torch is not None)

STANDARD_ZERO3 = {
    "stage": 3,
    "overlap_comm": True,
    "reduce_bucket_size": None,
    "stage3_prefetch_bucket_size": None,
    "stage3_param_persistence_threshold": None,
    "memory_efficient_linear": True,
    "offload_optimizer": "none",
}


def loop():
    return importlib.import_module("training.deepspeed_loop")


@needs_torch
def test_sizes_derived_and_stage3_keys_only_at_stage3():
    z = loop().zero_section(STANDARD_ZERO3, 128)
    assert z == {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": 128 * 128,
        "stage3_prefetch_bucket_size": int(0.9 * 128 * 128),
        "stage3_param_persistence_threshold": 1280,
        "memory_efficient_linear": True,
    }  # offload none: no section
    z2 = loop().zero_section({**STANDARD_ZERO3, "stage": 2, "offload_optimizer": "cpu"}, 128)
    assert z2 == {
        "stage": 2,
        "overlap_comm": True,
        "reduce_bucket_size": 128 * 128,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert loop().zero_section({**STANDARD_ZERO3, "memory_efficient_linear": False}, 128)["memory_efficient_linear"] is False


@needs_torch
def test_bad_values_are_refused_with_the_key():
    zs = loop().zero_section
    for zero, message in (
        ({"stage": 3, "memory_efficient_linear": "no"}, "parallel.zero.memory_efficient_linear must be true or false, got 'no'"),
        ({"stage": 3, "offload_param": "nvme"}, "parallel.zero.offload_param must be none or cpu, got 'nvme'"),
        ({"stage": 4}, "parallel.zero.stage must be 0..3, got 4"),
        ({"stage": 3, "stage3_gather_16bit": True}, "parallel.zero has unknown keys ['stage3_gather_16bit']"),
    ):
        with pytest.raises(ValueError) as err:
            zs(zero, 64)
        assert message in str(err.value)


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env():
    assert "2 passed" in units_in_env("FB_TEST_DEEPSPEED_PYTHON", Path(__file__), timeout=300)
