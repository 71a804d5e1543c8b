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
backward on CPUs, so its gradients are checked by the GPU runs, docs/results/README.md). The
compiled regions run with the ``aot_eager`` backend here (graph capture and the autograd split
without Inductor's code generation); the GPU runs use Inductor.
"""

from __future__ import annotations

import json
import os
import subprocess

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


def run(**switches):
    model = M.build_model(shape, **switches)
    model.load_state_dict(state)
    model.train()
    if switches.get("recompute_num_layers") is not None:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    loss = model(ids, labels)
    loss.backward()
    return model, {"loss": loss.item(), "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()},
                   "recomputed": [model.recomputed(i) for i in range(len(model.layers))]}


_, out["none"] = run()
m, out["compile"] = run(fused_elementwise="compile")
out["compile"]["modules"] = [m.layers[0].input_layernorm.fused, m.layers[1].post_attention_layernorm.fused, m.norm.fused,
                             m.layers[0].mlp.fused]
out["frames_compiled"] = counter.frame_count
_, out["recompute"] = run(recompute_num_layers=2)
M.LOSS_CHUNK = 5  # several chunks, the last one short
_, out["chunked"] = run(fused_linear_loss="chunked")
_, out["z_plain"] = run(z_loss_weight=1e-2)
_, out["z_chunked"] = run(fused_linear_loss="chunked", z_loss_weight=1e-2)
flex = M.build_model(shape, attention="flex")
flex.load_state_dict(state)
plain.load_state_dict(state)
with torch.no_grad():
    a, b = plain(ids), flex(ids)
out["flex"] = {"max_abs": float((a - b).abs().max()), "scale": float(a.abs().max()),
               "mask": type(flex.alibi_mask(shape["seq_length"], torch.float32, torch.device("cpu"))).__name__}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.framework("deepspeed")
def test_switches_match_the_plain_model():
    py = framework_python("FB_TEST_DEEPSPEED_PYTHON", "no deepspeed environment to run the model in")
    shape = dict(CASE["models"]["baichuan2_tiny"]["shape"])
    shape = {k: v for k, v in shape.items() if not isinstance(v, str)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([py, "-c", _CHECK, json.dumps(shape)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])

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
    for ref, other in ((plain, fused), (plain, partial), (plain, res["chunked"]), (res["z_plain"], res["z_chunked"])):
        assert other["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert other["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            assert other["grads"][name] == pytest.approx(g, rel=1e-4, abs=1e-7), name

    assert res["flex"]["mask"] == "FlexAlibi"
    assert res["flex"]["max_abs"] <= 1e-5 * max(1.0, res["flex"]["scale"])
