"""Layout-free starting weights of the DeepSpeed cases (training/deepspeed_weights.py).

- The cases' init rules are the models' own initialization (baichuan2's modules,
  transformers' rules for llava's CLIP tower, projector and LLaMA): constants
  exactly, normal draws by their spread.
- The full weights gathered from a ZeRO-3 model (3 gloo processes, so that some
  parameters are padded to split evenly) equal those of the unpartitioned
  model exactly, for both cases' tiny models.

Unit tests need torch: they run here when it is importable, else this file runs
again under the deepspeed environment's Python. Run as a script (under
``torch.distributed.run``), this file is the ZeRO-3 check itself.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training import shapes

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from tests.case_helpers import framework_python, free_port, remove_shm_buffers, torch_unit

try:
    import torch
except ImportError:  # the host's test environment: the unit tests run in the framework env instead
    torch = None

LLAVA_DIR = ROOT / "cases" / "llava" / "deepspeed"
BAICHUAN2_DIR = ROOT / "cases" / "baichuan2" / "deepspeed"
LLAVA = shapes.complete(yaml.safe_load((LLAVA_DIR / "case.yaml").read_text()))["models"]["llava_tiny"]["shape"]
BAICHUAN2 = shapes.complete(yaml.safe_load((BAICHUAN2_DIR / "case.yaml").read_text()))["models"]["baichuan2_tiny"]["shape"]
needs_torch = torch_unit(torch is not None)


def baichuan2_model():
    return importlib.import_module("cases.baichuan2.deepspeed.model")


def llava_model():
    return importlib.import_module("cases.llava.deepspeed.model")


def _check_rule_matches_own_init(model, rule) -> int:
    """Every parameter: a constant rule equals the model's own value; a normal rule's std is
    the sample's within 20 % (the smallest drawn tensors hold 64 values)."""
    from training.deepspeed_weights import Constant, Normal

    normals = 0
    for name, p in model.named_parameters():
        init = rule(name)
        x = p.detach().float()
        if isinstance(init, Constant):
            assert torch.equal(x, torch.full_like(x, init.value)), name
        else:
            assert isinstance(init, Normal) and init.mean == 0.0, name
            assert abs(float(x.std()) / init.std - 1) < 0.2, (name, float(x.std()), init.std)
            normals += 1
    return normals


@needs_torch
def test_baichuan2_rule_is_its_own_init():
    M = baichuan2_model()
    torch.manual_seed(0)
    model = M.build_model(BAICHUAN2, init_std=0.02)
    assert _check_rule_matches_own_init(model, M.init_rule(model)) == 2 + 5 * BAICHUAN2["num_layers"]  # matrices


@needs_torch
def test_llava_rule_is_transformers_init():
    M = llava_model()
    torch.manual_seed(0)
    model = M.build_model(LLAVA, torch.float32, torch.device("cpu"))
    rule = M.init_rule(LLAVA)
    assert _check_rule_matches_own_init(model, rule) > 20
    # the vision tower's widths differ from 0.02: the rule is not one std for all
    stds = {rule(n).std for n, _ in model.named_parameters() if hasattr(rule(n), "std")}
    assert len(stds) >= 4


@needs_torch
def test_values_are_per_name_and_seed_and_shapes_are_checked():
    from training import deepspeed_weights as W

    cpu = torch.device("cpu")
    a = W.initial_value(7, "x.weight", (4, 6), W.Normal(0.5), cpu)
    assert torch.equal(a, W.initial_value(7, "x.weight", (4, 6), W.Normal(0.5), cpu))
    assert not torch.equal(a, W.initial_value(8, "x.weight", (4, 6), W.Normal(0.5), cpu))
    assert not torch.equal(a, W.initial_value(7, "y.weight", (4, 6), W.Normal(0.5), cpu))
    assert torch.equal(W.initial_value(7, "n.weight", (3,), W.ONES, cpu), torch.ones(3))
    model = torch.nn.ModuleDict({"x": torch.nn.Linear(6, 4)}).to(torch.bfloat16)
    info = W.starting_weights(model, 7, lambda n: W.ZEROS if n == "x.bias" else W.Normal(0.5), cpu)
    assert info["parameters"] == 2 and info["seconds"] >= 0
    lin = model["x"]
    assert torch.equal(lin.weight, a.to(torch.bfloat16)) and not lin.bias.any()
    with pytest.raises(ValueError, match="x.weight: value of shape"):
        W.write_full(lin.weight, torch.zeros(6, 4), "x.weight")


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env(deepspeed_units):
    assert deepspeed_units.of(__file__)["passed"] == 3


@pytest.mark.framework("deepspeed")
def test_zero3_gathered_weights_equal_the_unpartitioned_model(tmp_path):
    py = framework_python("FB_TEST_DEEPSPEED_PYTHON", "no deepspeed environment")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FB_TEST_OUT": str(tmp_path)}
    cmd = [
        py,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "3",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port := free_port()),
        str(Path(__file__)),
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "zero3.json").read_text())
    for case in ("baichuan2_tiny", "llava_tiny"):
        r = report[case]
        assert r["mismatched"] == [] and r["compared"] == r["parameters"] > 20, r
        assert r["padded"] > 0 and r["dtype"] == "torch.bfloat16", r  # some partitions end in padding


# --------------------------------------------------------------------------- the ZeRO-3 check (3 processes)


def _zero3_vs_plain(build, rule_of, seed: int, device) -> dict:
    """Build under deepspeed.zero.Init (bf16) and plainly; the same starting weights in both;
    every partitioned parameter gathered and compared with the plain one (cast to bf16)."""
    from training import deepspeed_loop as dsl
    from training import deepspeed_weights as W
    from training import settings

    cfg = {
        "case": {"model": "zero3_check"},
        "model": {"params_nominal": 1.0},
        "train": {"steps": 1, "global_batch": 3, "micro_batch": 1, "precision": "bf16", "lr": 1e-3},
        "parallel": {"zero": {"stage": 3}},
    }
    c = settings.from_config(cfg, torch.distributed.get_world_size())
    zero3 = build(dsl.model_init_context(dsl.build_ds_config(c, 64)))
    plain = build(None)
    info = W.starting_weights(zero3, seed, rule_of(zero3), device)
    W.starting_weights(plain, seed, rule_of(plain), device)
    world = torch.distributed.get_world_size()
    plain_params = dict(plain.named_parameters())
    mismatched, padded, dtypes = [], 0, set()
    for name, p in zero3.named_parameters():
        assert W.is_partitioned(p), name
        padded += int(p.ds_numel % world != 0)
        full = W.read_full(p)
        dtypes.add(str(full.dtype))
        if not torch.equal(full, plain_params[name].detach().to(full.dtype)):
            mismatched.append(name)
    return {
        "parameters": len(plain_params),
        "compared": len(plain_params),
        "mismatched": mismatched,
        "padded": padded,
        "dtype": ",".join(sorted(dtypes)),
        "init_s": info["seconds"],
    }


def _within(context, build):
    if context is None:
        return build()
    with context:
        return build()


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    device = torch.device("cpu")
    B, L = baichuan2_model(), llava_model()
    report = {
        "baichuan2_tiny": _zero3_vs_plain(
            lambda context: _within(context, lambda: B.build_model(BAICHUAN2, init_std=0.02)), B.init_rule, 1234, device
        ),
        "llava_tiny": _zero3_vs_plain(
            lambda context: L.build_model(LLAVA, torch.bfloat16, device, context), lambda m: L.init_rule(LLAVA), 1234, device
        ),
    }
    if torch.distributed.get_rank() == 0:
        Path(os.environ["FB_TEST_OUT"], "zero3.json").write_text(json.dumps(report, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
