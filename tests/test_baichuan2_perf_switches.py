"""baichuan2/deepspeed's speed switches: ``parallel.fused_elementwise``, ``parallel.attention``,
``parallel.recompute_num_layers`` and ``parallel.fused_linear_loss`` (cases/baichuan2/deepspeed/model.py).

The switches are read and checked with messages that name the key; case.yaml's standard has
the plain path and lets vendors change them. On the CPU, in the deepspeed environment, the
tiny model built with ``fused_elementwise: compile`` has both norms of every layer, the final
norm and the SwiGLU as compiled regions (each function captured once for all its calls), and
its loss and every gradient equal the plain model's from the same weights; with
``recompute_num_layers: 2`` only the first two layers are recomputed and loss and gradients are
the plain model's; ``fused_linear_loss: chunked`` (here 5 tokens a chunk, with and without the
z-loss) gives the plain model's loss and gradients to float32 rounding; ``attention: flex`` gives the plain model's logits (FlexAttention has no
backward on CPUs, so its gradients are checked by the GPU runs, docs/results/history.md). The
compiled regions run with the ``aot_eager`` backend here (graph capture and the autograd split
without Inductor's code generation); the GPU runs use Inductor.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import yaml

from tests.case_helpers import framework_python
from tests.test_baichuan2_model import CASE, ROOT


def test_case_yaml_and_vendor_configs_carry_the_switches():
    par = CASE["standard"]["parallel"]
    assert (par["fused_elementwise"], par["attention"], par["recompute_num_layers"], par["fused_linear_loss"]) == (
        "none",
        "sdpa",
        None,
        "none",
    )
    switches = {"parallel.fused_elementwise", "parallel.attention", "parallel.recompute_num_layers", "parallel.fused_linear_loss"}
    assert switches <= set(CASE["vendor_may_change"])
    files = sorted((ROOT / "vendors").glob("*/cases/baichuan2_*/deepspeed/config_*.yaml"))
    assert files, "no baichuan2 vendor configs found"
    for f in files:
        vpar = yaml.safe_load(f.read_text()).get("parallel") or {}
        assert vpar.get("fused_elementwise", "none") in ("none", "compile"), f
        assert vpar.get("attention", "sdpa") in ("sdpa", "flex"), f
        assert vpar.get("fused_linear_loss", "none") in ("none", "chunked"), f
        n = vpar.get("recompute_num_layers")
        assert n is None or 0 <= n <= CASE["models"]["baichuan2_13b"]["shape"]["num_layers"], f


_CHECK = r"""
import copy, json, sys
import numpy as np
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from cases.baichuan2.deepspeed import model as M
from training import fused

out = {"switches": {}, "errors": []}
out["switches"]["default"] = M.speed_switches({}, 4)
out["switches"]["set"] = M.speed_switches(
    {"attention": "flex", "fused_elementwise": "compile", "recompute_num_layers": 3, "fused_linear_loss": "chunked"}, 4)
for bad in ({"attention": "flash"}, {"fused_elementwise": "liger"}, {"recompute_num_layers": 5},
            {"recompute_num_layers": -1}, {"recompute_num_layers": True}, {"recompute_num_layers": "2"},
            {"fused_linear_loss": "liger"}):
    try:
        M.speed_switches(bad, 4)
        out["errors"].append(None)
    except ValueError as exc:
        out["errors"].append(str(exc))
try:
    M.Baichuan2Config.from_shape(json.loads(sys.argv[1]), recompute_num_layers=9)
except ValueError as exc:
    out["from_shape"] = str(exc)

counter = CompileCounterWithBackend("aot_eager")
fused.COMPILE_BACKEND = counter
shape = json.loads(sys.argv[1])
torch.manual_seed(0)
plain = M.build_model(shape)
state = copy.deepcopy(plain.state_dict())
gen = torch.Generator().manual_seed(7)
ids = torch.randint(0, shape["vocab_size"], (2, shape["seq_length"]), generator=gen)
labels = torch.randint(0, shape["vocab_size"], (2, shape["seq_length"]), generator=gen)


grads = {}  # "<run>/<parameter>" -> its gradient, written to the .npz file sys.argv[2]


def run(tag, **switches):
    model = M.build_model(shape, **switches)
    model.load_state_dict(state)
    model.train()
    if switches.get("recompute_num_layers") is not None:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    loss = model(ids, labels)
    loss.backward()
    for n, p in model.named_parameters():
        grads[f"{tag}/{n}"] = p.grad.detach().flatten().float().numpy()
    return model, {"loss": loss.item(), "grads": [n for n, _ in model.named_parameters()],
                   "recomputed": [model.recomputed(i) for i in range(len(model.layers))]}


_, out["none"] = run("none")
m, out["compile"] = run("compile", fused_elementwise="compile")
out["compile"]["modules"] = [m.layers[0].input_layernorm.fused, m.layers[1].post_attention_layernorm.fused, m.norm.fused,
                             m.layers[0].mlp.fused]
out["frames_compiled"] = counter.frame_count
_, out["recompute"] = run("recompute", recompute_num_layers=2)
M.LOSS_CHUNK = 5  # several chunks, the last one short
_, out["chunked"] = run("chunked", fused_linear_loss="chunked")
_, out["z_plain"] = run("z_plain", z_loss_weight=1e-2)
_, out["z_chunked"] = run("z_chunked", fused_linear_loss="chunked", z_loss_weight=1e-2)
flex = M.build_model(shape, attention="flex")
flex.load_state_dict(state)
plain.load_state_dict(state)
with torch.no_grad():
    a, b = plain(ids), flex(ids)
out["flex"] = {"max_abs": float((a - b).abs().max()), "scale": float(a.abs().max()),
               "mask": type(flex.alibi_mask(shape["seq_length"], torch.float32, torch.device("cpu"))).__name__}
np.savez(sys.argv[2], **grads)
print("RESULT " + json.dumps(out))
"""


def assert_approx(actual: np.ndarray, expected: np.ndarray, rel: float, abs_: float, what: str) -> None:
    """``actual == pytest.approx(expected, rel=rel, abs=abs_)`` on whole arrays: the same
    shape, and every element within max(rel * |expected|, abs_) of its expected value."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    off = np.abs(a - e) > np.maximum(rel * np.abs(e), abs_)
    off |= np.isnan(a) | np.isnan(e)
    if off.any():
        k = int(np.argmax(off))
        raise AssertionError(f"{what}: {int(off.sum())} of {off.size} elements differ, first at {k}: {a[k]!r} vs {e[k]!r}")


@pytest.mark.framework("deepspeed")
def test_switches_match_the_plain_model(tmp_path):
    py = framework_python("FB_TEST_DEEPSPEED_PYTHON", "no deepspeed environment to run the model in")
    shape = dict(CASE["models"]["baichuan2_tiny"]["shape"])
    shape = {k: v for k, v in shape.items() if not isinstance(v, str)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    npz = tmp_path / "grads.npz"  # every run's gradients (as JSON they took half a minute to write and read)
    proc = subprocess.run([py, "-c", _CHECK, json.dumps(shape), str(npz)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    grads = np.load(npz)

    assert res["switches"]["default"] == {
        "attention": "sdpa",
        "fused_elementwise": "none",
        "recompute_num_layers": None,
        "fused_linear_loss": "none",
    }
    assert res["switches"]["set"] == {
        "attention": "flex",
        "fused_elementwise": "compile",
        "recompute_num_layers": 3,
        "fused_linear_loss": "chunked",
    }
    assert res["errors"] == [
        "parallel.attention must be one of sdpa, flex, got 'flash'",
        "parallel.fused_elementwise must be one of none, compile, got 'liger'",
        "parallel.recompute_num_layers must be null or 0..4, got 5",
        "parallel.recompute_num_layers must be null or 0..4, got -1",
        "parallel.recompute_num_layers must be null or 0..4, got True",
        "parallel.recompute_num_layers must be null or 0..4, got '2'",
        "parallel.fused_linear_loss must be one of none, chunked, got 'liger'",
    ]
    assert res["from_shape"] == "parallel.recompute_num_layers must be null or 0..4, got 9"

    plain, fused, partial = res["none"], res["compile"], res["recompute"]
    assert fused["modules"] == ["compile"] * 4
    assert res["frames_compiled"] == 2  # rms_norm and swiglu, once each for 9 norms and 4 MLPs
    assert plain["recomputed"] == [False] * 4 and partial["recomputed"] == [True, True, False, False]
    assert len(plain["grads"]) == 4 * 7 + 3  # 7 per layer, embedding, final norm, head
    assert res["z_plain"]["loss"] > plain["loss"]  # the z-loss is on
    for ref, other in (("none", "compile"), ("none", "recompute"), ("none", "chunked"), ("z_plain", "z_chunked")):
        assert res[other]["loss"] == pytest.approx(res[ref]["loss"], rel=1e-6)
        assert set(res[other]["grads"]) == set(res[ref]["grads"])
        for name in res[ref]["grads"]:
            assert_approx(grads[f"{other}/{name}"], grads[f"{ref}/{name}"], rel=1e-4, abs_=1e-7, what=f"{other} vs {ref}: {name}")

    assert res["flex"]["mask"] == "FlexAlibi"
    assert res["flex"]["max_abs"] <= 1e-5 * max(1.0, res["flex"]["scale"])
