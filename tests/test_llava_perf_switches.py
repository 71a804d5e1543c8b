"""llava/deepspeed's speed switches: ``parallel.fused_elementwise`` and ``parallel.recompute_num_layers``
(cases/llava/deepspeed/settings.py reads and checks them, model.py applies them).

Host side: case.yaml's standard has today's path and lets vendors change both keys, for all
phases and for each; every phase reads its own values (the phase overlay); bad values, a layer
count without ``recompute: full`` and ``liger`` on a device other than cuda are refused with
messages that name the key. On the CPU, in the deepspeed environment, the tiny LLaVA built from
the same weights, trained one micro-batch of each of two lengths with the finetune phase's
trainable parameters: with ``fused_elementwise: compile`` every RMSNorm and SwiGLU MLP of the
language model runs the compiled functions (each captured once for both lengths) and the loss
and every gradient equal the plain model's; with ``recompute: full`` and
``recompute_num_layers`` K in {0, 1, 2 (all), null} exactly the first K decoder layers are run
again in the backward (counted) and loss and gradients are the plain model's, bit for bit.
Recompute is turned on the way the DeepSpeed loop does it (``deepspeed_loop._prepare_model``).
The compiled regions run with the ``aot_eager`` backend here (graph capture and the autograd
split without Inductor's code generation); the GPU runs use Inductor.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from cases.llava.deepspeed import settings as llava_settings
from tests.case_helpers import framework_python
from tests.test_llava_case import CASE, CASE_DIR, ROOT, TINY, resolved
from training import settings as common

KEYS = ("recompute_num_layers", "fused_elementwise", "fused_rope")


def test_case_yaml_whitelists_the_switches_and_vendor_configs_hold_valid_values():
    from run_benchmarks.errors import InputError
    from run_benchmarks.planning import registry
    from run_benchmarks.planning.config import CaseConfig, load

    par = CASE["standard"]["parallel"]
    assert (par["recompute_num_layers"], par["fused_elementwise"], par["fused_rope"]) == (None, "none", "none")
    paths = {f"parallel.{k}" for k in KEYS} | {f"parallel.phases.{ph}.{k}" for ph in ("pretrain", "finetune") for k in KEYS}
    assert paths <= set(CASE["vendor_may_change"])

    case = load(CaseConfig, CASE_DIR / "case.yaml")
    std = registry.standard_settings(case, "llava1.5_7b")
    given = {
        "parallel": {"fused_elementwise": "compile", "phases": {"finetune": {"recompute_num_layers": 16, "fused_elementwise": "liger"}}}
    }
    assert {o["param"] for o in registry.fairness_check(given, case, std, "x.yaml")} == {
        "parallel.fused_elementwise",
        "parallel.phases.finetune.recompute_num_layers",
        "parallel.phases.finetune.fused_elementwise",
    }
    with pytest.raises(InputError, match="parameter 'parallel.phases.finetune.attention' may not be changed"):
        registry.fairness_check({"parallel": {"phases": {"finetune": {"attention": "flex"}}}}, case, std, "x.yaml")

    layers = CASE["models"]["llava1.5_7b"]["shape"]["num_layers"]
    files = sorted((ROOT / "vendors").glob("*/cases/llava*/deepspeed/config_*.yaml"))
    assert files, "no llava vendor configs found"
    for f in files:
        vpar = yaml.safe_load(f.read_text()).get("parallel") or {}
        for section in [vpar, *(vpar.get("phases") or {}).values()]:
            assert section.get("fused_elementwise", "none") in llava_settings.FUSED_ELEMENTWISE, f
            assert section.get("fused_rope", "none") in llava_settings.FUSED_ROPE, f
            n = section.get("recompute_num_layers")
            assert n is None or 0 <= n <= layers, f


def _switches(tmp: Path, parallel: dict | None = None, device: str = "cpu") -> dict[str, dict]:
    cfg = resolved(tmp)
    cfg["parallel"] = common.deep_merge(cfg["parallel"], parallel)
    if device != "cpu":
        cfg["vendor"].update(name="nvidia", device=device, dist_backend="nccl")
    num_layers = TINY["shape"]["num_layers"]
    return {ph: llava_settings.speed_switches(common.from_config(cfg, 2, ph), num_layers) for ph in ("pretrain", "finetune")}


def test_switches_are_read_per_phase_and_bad_values_refused(tmp_path):
    plain = {"fused_elementwise": "none", "recompute_num_layers": None, "fused_rope": "none"}
    assert _switches(tmp_path) == {"pretrain": plain, "finetune": plain}
    got = _switches(
        tmp_path,
        {"fused_elementwise": "compile", "phases": {"finetune": {"recompute": "full", "recompute_num_layers": 1, "fused_rope": "compile"}}},
    )
    assert got == {
        "pretrain": {"fused_elementwise": "compile", "recompute_num_layers": None, "fused_rope": "none"},
        "finetune": {"fused_elementwise": "compile", "recompute_num_layers": 1, "fused_rope": "compile"},
    }
    for k in (0, 2, None):
        assert _switches(tmp_path, {"recompute": "full", "recompute_num_layers": k})["finetune"]["recompute_num_layers"] == k
    cuda = _switches(tmp_path, {"phases": {"finetune": {"fused_elementwise": "liger"}}}, device="cuda")
    assert (cuda["pretrain"]["fused_elementwise"], cuda["finetune"]["fused_elementwise"]) == ("none", "liger")

    refused = [
        ("parallel.fused_elementwise must be one of none, compile, liger, got 'triton' (phase pretrain)", {"fused_elementwise": "triton"}),
        (
            "parallel.fused_rope must be one of none, compile, got 'liger' (phase finetune)",
            {"phases": {"finetune": {"fused_rope": "liger"}}},
        ),
        (
            "parallel.fused_elementwise: liger runs liger-kernel's Triton kernels, which need vendor.device: cuda "
            "(this vendor's device is cpu); use none or compile",
            {"phases": {"finetune": {"fused_elementwise": "liger"}}},
        ),
        (
            "parallel.recompute_num_layers (2) needs parallel.recompute: full, but the pretrain phase's recompute is none",
            {"recompute_num_layers": 2},
        ),
    ]
    for k in (3, -1, True, "1", 1.5):
        msg = f"parallel.recompute_num_layers must be null or 0..2 (decoder layers of the language model), got {k!r} (phase pretrain)"
        refused.append((msg, {"recompute": "full", "recompute_num_layers": k}))
    for msg, parallel in refused:
        with pytest.raises(common.SettingsError) as err:
            _switches(tmp_path, parallel)
        assert str(err.value) == msg
    with pytest.raises(common.SettingsError, match="parallel.recompute_num_layers must be null or 0..2 .* got 5 .phase finetune.$"):
        _switches(tmp_path, {"recompute": "full", "phases": {"finetune": {"recompute_num_layers": 5}}})


_CHECK = r"""
import copy, json, sys
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.models.llama import modeling_llama
from cases.llava.deepspeed import model as M
from training import deepspeed_loop as dsl, fused

counter = CompileCounterWithBackend("aot_eager")
fused.COMPILE_BACKEND = counter
shape = json.loads(sys.argv[1])
torch.manual_seed(0)
state = copy.deepcopy(M.build_model(shape, torch.float32, torch.device("cpu")).state_dict())
n_img, image_id = M.num_image_tokens(shape), int(shape["image_token_index"])
gen = torch.Generator().manual_seed(7)


def batch(width, pad):
    # two samples of bos + image tokens + text; the second one padded by `pad` positions
    ids = torch.randint(2, image_id, (2, width), generator=gen)
    ids[:, 0], ids[:, 1 : 1 + n_img] = 1, image_id
    labels, mask = ids.clone(), torch.ones_like(ids)
    labels[:, : 1 + n_img] = -100
    ids[1, width - pad :], labels[1, width - pad :], mask[1, width - pad :] = 0, -100, 0
    pixels = torch.randn(2, 3, shape["image_size"], shape["image_size"], generator=gen)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "pixel_values": pixels}


batches = [batch(48, 5), batch(64, 11)]


def run(fused="none", recompute="none", layers=None, rope="none"):
    model = M.build_model(shape, torch.float32, torch.device("cpu"))
    model.load_state_dict(state)
    changed = M.apply_speed_switches(model, fused, layers, rope)
    dsl._prepare_model(model, recompute, M.trainable("finetune"))  # as DeepSpeedPhase.build does
    model.train()
    calls = [0] * len(M.language_model(model).layers)
    for i, layer in enumerate(M.language_model(model).layers):  # a recomputed layer runs its attention twice
        layer.self_attn.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        losses.append(loss.item())
    lm = M.language_model(model)
    return {
        "losses": losses,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "changed": changed,
        "marked": sorted({getattr(m, "fused_elementwise", "-") for m in lm.modules() if type(m).__name__ in ("LlamaRMSNorm", "LlamaMLP")}),
        "recomputed": M.recomputed_layers(model),
        "layer_calls": calls,
    }


def compare(a, b):
    # per gradient: elements outside pytest.approx(rel=1e-4, abs=1e-7) of the plain model's, and bit-equality
    out = {}
    for name, g in b["grads"].items():
        x = a["grads"][name]
        out[name] = {"outside": int(((x - g).abs() > torch.clamp(1e-4 * g.abs(), min=1e-7)).sum()), "equal": bool(torch.equal(x, g))}
    return out


plain = run()
part = lambda name: M.canonical(name).split("/")[0]
res = {"frozen": sorted({part(n) for n in state} - {part(n) for n in plain["grads"]})}
variants = {"compile": {"fused": "compile"}, "compile_k1": {"fused": "compile", "recompute": "full", "layers": 1}, "rope": {"rope": "compile"}}
for k in (0, 1, 2, None):
    variants[f"k{k}"] = {"recompute": "full", "layers": k}
frames = None
for name, kw in variants.items():
    got = run(**kw)
    if name == "compile":
        frames = counter.frame_count
    if name == "rope":
        res["rope_frames"] = counter.frame_count - frames
        res["rope_is_set"] = modeling_llama.apply_rotary_pos_emb is M._compiled_rope
    res[name] = {k: v for k, v in got.items() if k != "grads"} | {"grads": compare(got, plain)}
res["plain"] = {k: v for k, v in plain.items() if k != "grads"} | {"grad_names": sorted(plain["grads"])}
again = run()  # the eager rotary embedding is back: the plain model's numbers exactly
res["rope_undone"] = again["losses"] == plain["losses"] and all(g["equal"] for g in compare(again, plain).values())
res["frames_compiled"] = frames
try:
    M.apply_speed_switches(M.build_model(shape, torch.float32, torch.device("cpu")), "none", 3)
except ValueError as exc:
    res["apply_refuses"] = str(exc)
print("RESULT " + json.dumps(res))
"""


@pytest.mark.framework("deepspeed")
def test_switched_model_trains_like_the_plain_model():
    py = framework_python("FB_TEST_DEEPSPEED_PYTHON", "no deepspeed environment to run the model in")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([py, "-c", _CHECK, json.dumps(TINY["shape"])], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])

    plain = res["plain"]
    assert res["frozen"] == ["vision"]  # the finetune phase trains projector, language model and head
    assert plain["changed"] == {"norms": 0, "mlps": 0, "ropes": 0} and plain["marked"] == ["-"]
    assert plain["recomputed"] == [False, False] and plain["layer_calls"] == [2, 2]  # two micro-batches, no recompute
    assert len(plain["grad_names"]) == 2 * 9 + 2 + 4 + 1  # a layer: 4 attention + 3 MLP + 2 norms; embedding, final norm; projector; head
    assert res["apply_refuses"] == "parallel.recompute_num_layers must be null or 0..2, got 3"

    # compile: 2 layers x 2 norms + the final norm, 2 MLPs; rms_norm and swiglu captured once each for both lengths
    for name in ("compile", "compile_k1"):
        assert res[name]["changed"] == {"norms": 5, "mlps": 2, "ropes": 0} and res[name]["marked"] == ["compile"], name
    assert res["frames_compiled"] == 2
    # fused_rope: both attentions' rotary embedding, captured once for both lengths; set for the
    # process while asked, transformers' own back after
    assert res["rope"]["changed"] == {"norms": 0, "mlps": 0, "ropes": 2} and res["rope_frames"] == 1
    assert res["rope_is_set"] and res["rope_undone"]
    recomputed = {"compile": [False, False], "compile_k1": [True, False], "rope": [False, False], "k0": [False, False], "k1": [True, False]}
    recomputed["k2"] = [True, True]
    recomputed["kNone"] = [True, True]  # null: every layer, as recompute: full alone
    for name, flags in recomputed.items():
        got = res[name]
        assert got["recomputed"] == flags, name
        assert got["layer_calls"] == [4 if f else 2 for f in flags], name
        assert sorted(got["grads"]) == plain["grad_names"], name
        if name.startswith(("compile", "rope")):
            assert got["losses"] == pytest.approx(plain["losses"], rel=1e-6), name
            assert {n: g["outside"] for n, g in got["grads"].items() if g["outside"]} == {}, name
        else:  # recompute runs the same arithmetic again: bit for bit
            assert got["losses"] == plain["losses"], name
            assert [n for n, g in got["grads"].items() if not g["equal"]] == [], name
