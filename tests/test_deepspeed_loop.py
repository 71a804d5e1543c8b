"""DeepSpeed's ``zero_optimization`` section as the DeepSpeed cases build it (training/deepspeed_loop.zero_section).

Null sizes are derived from the hidden size, ZeRO-3-only keys leave the config below stage 3,
``memory_efficient_linear`` must be a boolean, ``leaf_modules`` a list of class names that each
match a module of the model, and an unknown key or offload device is refused with the key named. Unit tests need torch (the module imports it): they run here when it is
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
@pytest.mark.parametrize("precision, bf16, fp16", [("bf16", True, False), ("fp16", False, True), ("fp32", False, False)])
def test_the_precision_reaches_deepspeeds_config(precision, bf16, fp16):
    """The tiny cases train in fp32 on the CPU; the full-size ones in bf16: both reach DeepSpeed."""
    from training import settings

    cfg = {
        "case": {"model": "m"},
        "model": {"params_nominal": 1.0},
        "train": {"steps": 1, "global_batch": 2, "micro_batch": 1, "precision": precision, "lr": 1e-3},
        "parallel": {"zero": {"stage": 2}},
    }
    ds = loop().build_ds_config(settings.from_config(cfg, 2), 64)
    assert (ds["bf16"]["enabled"], ds["fp16"]["enabled"]) == (bf16, fp16)


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
    # module classes hooked as one unit: DeepSpeed's leaf_module section, at stage 3 alone; none given, none written
    leaf = {**STANDARD_ZERO3, "leaf_modules": ["LlamaDecoderLayer", "CLIPEncoderLayer"]}
    assert loop().zero_section(leaf, 128)["leaf_module"] == {"classes": ["LlamaDecoderLayer", "CLIPEncoderLayer"]}
    assert "leaf_module" not in loop().zero_section({**leaf, "leaf_modules": []}, 128)
    assert "leaf_module" not in loop().zero_section({**leaf, "stage": 2}, 128)


@needs_torch
def test_bad_values_are_refused_with_the_key():
    zs = loop().zero_section
    for zero, message in (
        ({"stage": 3, "memory_efficient_linear": "no"}, "parallel.zero.memory_efficient_linear must be true or false, got 'no'"),
        ({"stage": 3, "offload_param": "nvme"}, "parallel.zero.offload_param must be none or cpu, got 'nvme'"),
        ({"stage": 4}, "parallel.zero.stage must be 0..3, got 4"),
        ({"stage": 3, "stage3_gather_16bit": True}, "parallel.zero has unknown keys ['stage3_gather_16bit']"),
        ({"stage": 3, "leaf_modules": "LlamaDecoderLayer"}, "parallel.zero.leaf_modules must be a list of module class names, got 'Llama"),
        ({"stage": 3, "leaf_modules": ["Block", ""]}, "parallel.zero.leaf_modules must be a list of module class names, got ['Block', '']"),
    ):
        with pytest.raises(ValueError) as err:
            zs(zero, 64)
        assert message in str(err.value)


@needs_torch
def test_leaf_modules_counted_and_a_class_that_matches_nothing_refused():
    """A class that names no module of the model is refused before the engine starts (DeepSpeed only
    warns of it); after DeepSpeed flags the modules of the named classes (what its engine does with
    ``leaf_module.classes``), the loop counts them for run_meta."""
    from deepspeed.utils import set_z3_leaf_modules

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block(), Block()])
            self.head = torch.nn.Linear(4, 2)

    net = Net()
    asked = {"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Block", "Decoder"]}}}
    with pytest.raises(ValueError) as err:
        loop().check_leaf_modules(asked, net, "finetune")
    assert str(err.value) == (
        "parallel.zero.leaf_modules: no module of class Decoder in the finetune phase's model (its classes: Block, Linear, ModuleList, Net)"
    )
    # DeepSpeed's two spellings of a class: its name, or its module and qualified name; no section: nothing to check
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    asked["zero_optimization"]["leaf_module"]["classes"] = ["Block", qualified, "torch.nn.modules.linear.Linear"]
    loop().check_leaf_modules(asked, net, "finetune")
    loop().check_leaf_modules({"zero_optimization": {"stage": 2}}, net, "pretrain")
    assert loop().leaf_modules(net) == {}
    set_z3_leaf_modules(net, [qualified])
    assert loop().leaf_modules(net) == {"Block": 3}


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env():
    assert "6 passed" in units_in_env("FB_TEST_DEEPSPEED_PYTHON", Path(__file__), timeout=300)
