"""llama3/megatron's speed switches: ``parallel.attention: cudnn`` and ``parallel.fused_elementwise``.

Settings accept and refuse their values with messages that name the key and the fix. On the
CPU, in the megatron-core environment, the tiny model built with ``fused_elementwise:
compile`` has the compiled norm and SwiGLU modules in every slot (both layers' norms, the
final norm, the MLP activation), each function is captured by torch.compile once for all
its calls (one shape), and its loss and every gradient equal the plain model's from the same
starting weights; the cuDNN and liger paths refuse a CPU with a clear error. The compiled
regions run with the ``aot_eager`` backend here (dynamo's full-graph capture and the
autograd split, without Inductor's code generation, which takes half a minute per graph on
this machine); the GPU runs use Inductor (docs/results/history.md).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.case_helpers import framework_python, free_port, start_task
from tests.test_llama3_megatron_case import CASE_DIR, ROOT, resolved_config
from training import shapes


def _settings():
    return importlib.import_module("cases.llama3.megatron.settings")


def _cuda(cfg: dict) -> dict:
    cfg["vendor"].update(name="nvidia", device="cuda", dist_backend="nccl", adapters={})
    return cfg


def test_switch_values_are_read_and_checked(tmp_path):
    st = _settings()
    s = st.from_config(resolved_config(tmp_path, 1, "x"), world_size=1)
    assert (s.layout.attention, s.layout.fused_elementwise) == ("sdpa", "none")  # defaults: today's path
    for attention in ("sdpa", "cudnn"):
        for fused in ("none", "compile", "liger"):
            cfg = _cuda(resolved_config(tmp_path, 1, "x", parallel={"attention": attention, "fused_elementwise": fused}))
            lay = st.from_config(cfg, world_size=1).layout
            assert (lay.attention, lay.fused_elementwise) == (attention, fused)
    cpu = st.from_config(resolved_config(tmp_path, 1, "x", parallel={"fused_elementwise": "compile"}), world_size=1)
    assert cpu.layout.fused_elementwise == "compile"  # torch.compile runs on CPUs too

    refused = {
        "parallel.fused_elementwise must be one of none, compile, liger, got 'triton'": ({"fused_elementwise": "triton"}, True),
        "parallel.attention must be one of sdpa, cudnn, local, te, got 'flash'": ({"attention": "flash"}, True),
        "parallel.attention: cudnn runs torch's cuDNN attention kernel, which needs vendor.device: cuda "
        "(this vendor's device is cpu); use parallel.attention: sdpa": ({"attention": "cudnn"}, False),
        "parallel.fused_elementwise: liger runs liger-kernel's Triton kernels, which need vendor.device: cuda "
        "(this vendor's device is cpu); use none or compile": ({"fused_elementwise": "liger"}, False),
        "parallel.fused_elementwise: compile replaces megatron's local RMSNorm and SwiGLU; TransformerEngine brings its own": (
            {"fused_elementwise": "compile", "transformer_impl": "transformer_engine"},
            True,
        ),
        "parallel.sequence_parallel needs norms that run on a share of the sequence: megatron's torch RMSNorm wrapper": (
            {"tp": 2, "sequence_parallel": True, "transformer_impl": "local"},
            True,
        ),
        "parallel.sequence_parallel needs parallel.tp > 1": ({"sequence_parallel": True, "fused_elementwise": "compile"}, False),
        "parallel.cross_entropy must be one of megatron, fused, liger, got 'te'": ({"cross_entropy": "te"}, True),
        "parallel.cross_entropy: liger runs liger-kernel's Triton kernels, which need vendor.device: cuda "
        "(this vendor's device is cpu); use megatron or fused": ({"cross_entropy": "liger"}, False),
        "parallel.cross_entropy: fused is megatron's fused cross-entropy, which hands its gradient back in bf16; "
        "train.precision is fp32: use megatron or liger": ({"cross_entropy": "fused"}, True),
        "parallel.cross_entropy: liger replaces the cross-entropy after the output layer; parallel.fused_linear_loss: "
        "chunked computes the output layer and the loss in one: set one of them off": (
            {"cross_entropy": "liger", "fused_linear_loss": "chunked"},
            True,
        ),
        "parallel.fused_add_norm runs in the case's own norms: set parallel.fused_elementwise to compile or liger": (
            {"fused_add_norm": True},
            False,
        ),
        "parallel.fused_add_norm and parallel.tp_comm_overlap: halves each run their own layer: set one of them off": (
            {"tp": 2, "fused_add_norm": True, "fused_elementwise": "compile", "tp_comm_overlap": "halves"},
            False,
        ),
        "parallel.fused_add_norm hands each layer's last sum to the next, which full recompute would replay": (
            {"fused_add_norm": True, "fused_elementwise": "compile", "recompute": "full"},
            False,
        ),
        "parallel.fused_add_norm must be true or false": ({"fused_add_norm": "fast"}, False),
        "parallel.fused_adam must be true or false": ({"fused_adam": "yes"}, False),
        "parallel.gradient_accumulation_fusion must be true or false": ({"gradient_accumulation_fusion": "on"}, False),
        "parallel.fused_adam picks the kernel of the optimizer on the device; with parallel.optimizer_cpu_offload": (
            {"fused_adam": True, "optimizer_cpu_offload": True},
            True,
        ),
        "parallel.overlap_cpu_optimizer_d2h_h2d overlaps the host optimizer's copies: it needs parallel.optimizer_cpu_offload: true": (
            {"overlap_cpu_optimizer_d2h_h2d": True},
            True,
        ),
        "parallel.overlap_cpu_optimizer_d2h_h2d must be true or false": ({"overlap_cpu_optimizer_d2h_h2d": "yes"}, True),
        "parallel.offload_pinned_copy changes how the host optimizer's parameter copies are made: it needs "
        "parallel.optimizer_cpu_offload: true": ({"offload_pinned_copy": True}, True),
    }
    for message, (parallel, on_cuda) in refused.items():
        world = parallel.get("tp", 1)
        cfg = resolved_config(tmp_path, world, "x", parallel=parallel)
        with pytest.raises(st.SettingsError) as err:
            st.from_config(_cuda(cfg) if on_cuda else cfg, world_size=world)
        assert message in str(err.value)
    for ce in ("megatron", "fused", "liger"):
        cfg = _cuda(resolved_config(tmp_path, 1, "x", parallel={"cross_entropy": ce}, precision="bf16"))
        assert st.from_config(cfg, world_size=1).layout.cross_entropy == ce
    for fused in ("compile", "liger"):  # the case's own norms run under sequence parallelism
        cfg = _cuda(resolved_config(tmp_path, 2, "x", parallel={"tp": 2, "sequence_parallel": True, "fused_elementwise": fused}))
        assert st.from_config(cfg, world_size=2).layout.sequence_parallel is True
    shape = {**resolved_config(tmp_path, 2, "x")["model"], "seq_length": 127}
    with pytest.raises(st.SettingsError, match="seq_length over tensor parallelism"):
        st.from_config(
            {
                **resolved_config(tmp_path, 2, "x", parallel={"tp": 2, "sequence_parallel": True, "fused_elementwise": "compile"}),
                "model": shape,
            },
            world_size=2,
        )


def test_case_and_vendor_configs_carry_the_switches():
    case = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))
    assert case["standard"]["parallel"]["fused_elementwise"] == "none"
    assert case["standard"]["parallel"]["attention"] == "sdpa"
    assert "parallel.fused_elementwise" in case["vendor_may_change"] and "parallel.attention" in case["vendor_may_change"]
    st = _settings()
    files = sorted((ROOT / "vendors" / "nvidia" / "cases" / "llama3_8b" / "megatron").glob("config_*.yaml"))
    assert files, "no llama3_8b nvidia configs found"
    for f in files:
        par = yaml.safe_load(f.read_text()).get("parallel", {})
        assert par.get("attention", "sdpa") in st.ATTENTION, f.name
        assert par.get("fused_elementwise", "none") in st.FUSED_ELEMENTWISE, f.name
        assert par.get("fused_rope", "none") in st.FUSED_ROPE and par.get("fused_linear_loss", "none") in st.FUSED_LINEAR_LOSS, f.name
    assert case["standard"]["parallel"]["fused_rope"] == "none" and case["standard"]["parallel"]["fused_linear_loss"] == "none"
    assert case["standard"]["parallel"]["fused_adam"] is False and "parallel.fused_adam" in case["vendor_may_change"]
    assert case["standard"]["parallel"]["gradient_accumulation_fusion"] is False
    assert "parallel.gradient_accumulation_fusion" in case["vendor_may_change"]
    assert {"parallel.fused_rope", "parallel.fused_linear_loss"} <= set(case["vendor_may_change"])
    assert case["standard"]["parallel"]["cross_entropy"] == "megatron" and "parallel.cross_entropy" in case["vendor_may_change"]
    assert case["standard"]["parallel"]["fused_add_norm"] is False and "parallel.fused_add_norm" in case["vendor_may_change"]
    for f in files:
        assert yaml.safe_load(f.read_text()).get("parallel", {}).get("cross_entropy", "megatron") in st.CROSS_ENTROPY, f.name


_MODEL_CHECK = r"""
import dataclasses, json, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])  # the cpu vendor's adapter, seeds
import torch, torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from cases.llama3.megatron import kernels, modeling, settings, startweights
from training import fused

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
model_parallel_cuda_manual_seed(1234)
counter = CompileCounterWithBackend("aot_eager")
fused.COMPILE_BACKEND = counter
gen = torch.Generator().manual_seed(7)
tokens = torch.randint(0, 1024, (2, 128), generator=gen)
labels = torch.randint(0, 1024, (2, 128), generator=gen)
position_ids = torch.arange(128).expand(2, 128)
out = {}
for fused in ("none", "compile"):
    s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], "fused_elementwise": fused}}, 1)
    config = modeling.transformer_config(s)
    model = modeling.build_model(s, config)
    startweights.overwrite(model, s)
    losses = model(tokens, position_ids, None, labels=labels)
    loss = losses.float().mean()
    loss.backward()
    layer = model.decoder.layers[0]
    out[fused] = {
        "loss": loss.item(),
        "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()},
        "modules": [type(m).__name__ for m in (layer.input_layernorm, layer.pre_mlp_layernorm,
                    model.decoder.layers[1].pre_mlp_layernorm, model.decoder.final_layernorm, layer.mlp.activation_func)],
        "use_te_activation_func": config.use_te_activation_func,
        "meta": [modeling.attention_kernel(s), modeling.fused_elementwise_in_use(s)],  # run_meta's
    }
out["frames_compiled"] = counter.frame_count
# the case's norms, built on the host, follow megatron's layers to their device (here: meta)
model = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"), kernels.CompiledRMSNorm(config, 2))
modeling.on_one_device(model)
out["devices"] = sorted({str(p.device) for p in model.parameters()})
errors = {}
try:
    kernels.cudnn_attention_mode(4, 2, 16, torch.float32, torch.device("cpu"))
except RuntimeError as exc:
    errors["cudnn_mode"] = str(exc)
try:  # settings refuse cudnn on a CPU vendor; the model refuses it on its own as well
    s = settings.from_config(cfg, 1)
    s = dataclasses.replace(s, layout=dataclasses.replace(s.layout, attention="cudnn"))
    modeling.build_model(s, modeling.transformer_config(s))
except RuntimeError as exc:
    errors["cudnn_model"] = str(exc)
try:
    kernels.LigerSwiGLU()(torch.ones(4, 8))
except RuntimeError as exc:
    errors["liger"] = str(exc)
out["errors"] = errors
# the check a forced attention kernel passes at the case's own shape: causal GQA attention passes;
# one that sees later tokens, one with the wrong scale and one whose K/V gradient is wrong are named
F = torch.nn.functional
sc = 0.25
def attention(causal=True, scale=sc, grad_k=1.0):
    def run(q, k, v):
        k = k * grad_k + k.detach() * (1 - grad_k)  # the same values, a scaled gradient
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return run
q_like = torch.empty(64, 1, 4, 16).permute(1, 2, 0, 3)  # [b, heads, s, d] views of [s, b, heads, d], as megatron's
k_like = torch.empty(64, 1, 2, 16).permute(1, 2, 0, 3)
out["faults"] = [kernels.attention_fault(f, q_like, k_like, k_like, sc)
                 for f in (attention(), attention(causal=False), attention(scale=2 * sc), attention(grad_k=0.5))]
# a backward that is wrong only for a contiguous [b, heads, s, d] incoming gradient (as torch's cuDNN
# attention was on H200): right for the gradient the layer hands back, named for the other layout
class HalfGradIfContiguous(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        return g * 0.5 if g.is_contiguous() else g
layout_bound = lambda q, k, v: HalfGradIfContiguous.apply(attention()(q, k, v))
out["layout_faults"] = [kernels.attention_fault(layout_bound, q_like, k_like, k_like, sc),
                        kernels.attention_fault(layout_bound, q_like, k_like, k_like, sc, hand_on=lambda o: o)]
try:
    kernels.checked_attention("sdpa", attention(causal=False), q_like, k_like, k_like, sc, "the fix")
except RuntimeError as exc:
    out["refused"] = str(exc)
print("RESULT " + json.dumps(out))
"""


def check_env(**extra: str) -> dict[str, str]:
    """This process's environment for a check script in the megatron-core environment: the
    repository on the path, one thread, no rank variables of its own, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)  # the GPU machine's wheels stay on it
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def one_rank_check(script: str, tmp_path: Path) -> str:
    """Run ``script`` (given resolved.json of config_cpux1x1) as one rank in the megatron-core
    environment; its ``RESULT ...`` line."""
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(resolved_config(tmp_path, 1, "config_cpux1x1")))
    env = check_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([py, "-c", script, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return line


def two_rank_check(script: str, tmp_path: Path, cfg: dict, *args: str) -> list[dict]:
    """Run ``script`` (given resolved.json of ``cfg``, an output path and ``args``) as two ranks
    launched by torch.distributed.run in the megatron-core environment; each rank's JSON, which
    the script writes to ``<output path>.<rank>`` (their stdout lines would interleave)."""
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(cfg))
    file = tmp_path / "check.py"
    file.write_text(script)
    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [str(file), str(path), str(tmp_path / "out"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=check_env(), capture_output=True, text=True, timeout=300)  # the launcher sets each rank's own
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.framework("megatron")
def test_compiled_norm_and_swiglu_match_the_plain_model(tmp_path):
    line = one_rank_check(_MODEL_CHECK, tmp_path)
    res = json.loads(line[len("RESULT ") :])
    plain, fused = res["none"], res["compile"]

    assert plain["modules"] == ["RMSNorm"] * 4 + ["function"]  # torch's RMSNorm, F.silu inside megatron's glu
    assert fused["modules"] == ["CompiledRMSNorm"] * 4 + ["CompiledSwiGLU"]
    assert (plain["use_te_activation_func"], fused["use_te_activation_func"]) == (False, True)
    assert (plain["meta"], fused["meta"]) == (["sdpa", "none"], ["sdpa", "compile"])  # no TransformerEngine here
    assert res["frames_compiled"] == 2  # rms_norm and swiglu, once each for 5 norms and 2 MLPs
    assert res["devices"] == ["meta"]

    assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert plain["grads"].keys() == fused["grads"].keys() and len(plain["grads"]) == 15
    for name, g in plain["grads"].items():
        assert fused["grads"][name] == pytest.approx(g, rel=1e-4, abs=1e-7), name

    errors = res["errors"]
    assert "parallel.attention: cudnn runs torch's cuDNN attention kernel, which needs a CUDA device" in errors["cudnn_mode"]
    assert errors["cudnn_model"].startswith(errors["cudnn_mode"])  # megatron adds where it was building
    assert "parallel.fused_elementwise: liger runs Triton kernels on CUDA devices" in errors["liger"]

    right, leaky, scaled, bad_grad = res["faults"]
    assert right is None
    assert leaky.startswith("not causal: the first 32 positions' output changes by")
    assert scaled.startswith("output off the reference attention")
    assert bad_grad.startswith("dk off the reference attention")
    layer_layout, other_layout = res["layout_faults"]
    assert layer_layout is None and other_layout.startswith(
        "dq off the reference attention (flash / memory-efficient, K/V repeated) by 0.5 of"
    )
    assert res["refused"].startswith("parallel.attention: sdpa: torch ") and res["refused"].endswith(
        "attention at this layer's shape (batch 1, 4 query heads over 2 KV groups, sequence 64, head dim 16, torch.float32) is "
        + leaky
        + "; the fix"
    )


_CHECK_SEES_THE_LAYER = r"""
import json, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])
import torch, torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from cases.llama3.megatron import kernels, modeling, settings, startweights
from training import fused

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
model_parallel_cuda_manual_seed(1234)
fused.COMPILE_BACKEND = CompileCounterWithBackend("aot_eager")
calls, where = [], ["layer"]
plain_sdpa, plain_fault = modeling.sdpa_attention, kernels.attention_fault

def recording_sdpa(q, k, v, scale, dropout=0.0):
    out = plain_sdpa(q, k, v, scale, dropout)
    if out.requires_grad:  # a call whose backward runs: the check's with gradients, or the layer's
        call = {"where": where[0], "strides": [list(t.stride()) for t in (q, k, v)], "grad": None}
        out.register_hook(lambda g: call.update(grad=list(g.stride())))
        calls.append(call)
    return out

def flagged_fault(*args, **kwargs):
    where[0] = "check"
    try:
        return plain_fault(*args, **kwargs)
    finally:
        where[0] = "layer"

modeling.sdpa_attention, kernels.attention_fault = recording_sdpa, flagged_fault
gen = torch.Generator().manual_seed(7)
tokens = torch.randint(0, 1024, (2, 128), generator=gen)
labels = torch.randint(0, 1024, (2, 128), generator=gen)
position_ids = torch.arange(128).expand(2, 128)
out = {}
for rope in ("none", "compile"):  # megatron's RoPE, then the compiled region (its outputs' strides)
    calls.clear(); kernels._CHECKED.clear()
    s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], "fused_rope": rope}}, 1)
    model = modeling.build_model(s, modeling.transformer_config(s))
    startweights.overwrite(model, s)
    model(tokens, position_ids, None, labels=labels).float().mean().backward()
    out[rope] = list(calls)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.framework("megatron")
def test_the_attention_check_runs_the_layers_layouts(tmp_path):
    """The attention check hands the kernel what the layer's training step hands it: q, k and v
    with the layer's strides (each its own; V is a slice of the fused QKV output in megatron) and,
    in the backward, the gradient with the strides the layer's output projection gives it. A
    backward kernel can be right for one gradient layout and wrong for another (torch's cuDNN
    attention on H200, docs/cases/llama3.md), so a check through other layouts judges a kernel the
    layer does not run."""
    res = json.loads(one_rank_check(_CHECK_SEES_THE_LAYER, tmp_path)[len("RESULT ") :])
    for rope, calls in res.items():
        checks = [c for c in calls if c["where"] == "check"]
        layers = [c for c in calls if c["where"] == "layer"]
        assert len(checks) == 1 and len(layers) == 2, (rope, calls)  # checked once, then both layers ran
        for layer in layers:
            assert layer["grad"] is not None, rope  # the layer's backward reached the kernel's output
            assert (checks[0]["strides"], checks[0]["grad"]) == (layer["strides"], layer["grad"]), rope
        assert layers[0]["strides"][2] != layers[0]["strides"][1], rope  # V's own strides, not K's


_LOSS_ROPE_CHECK = r"""
import json, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])
import torch, torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.models.common.embeddings import rope_utils
from cases.llama3.megatron import kernels, modeling, settings, startweights
from training import fused

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
model_parallel_cuda_manual_seed(1234)
fused.COMPILE_BACKEND = "aot_eager"
out = {}
# the loss function alone, several chunks, a per-token incoming gradient that is not uniform
gen = torch.Generator().manual_seed(3)
x = torch.randn(40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
w = torch.randn(96, 16, generator=gen, dtype=torch.float64, requires_grad=True)
y = torch.randint(0, 96, (40,), generator=gen)
g = torch.rand(40, generator=gen, dtype=torch.float64)
ref = F.cross_entropy(x @ w.t(), y, reduction="none")
(ref * g).sum().backward()
rx, rw = x.grad.clone(), w.grad.clone()
x.grad = w.grad = None
got = kernels.LinearCrossEntropy.apply(x, w, y, None, 7, True)
(got * g).sum().backward()
out["fn"] = [float((got - ref).abs().max()), float((x.grad - rx).abs().max()), float((w.grad - rw).abs().max())]
# RoPE: the compiled function against megatron's own
t = torch.randn(12, 2, 4, 16, generator=gen, requires_grad=True)
freqs = torch.randn(12, 1, 1, 16, generator=gen)
mine = kernels.compiled_rope(t, freqs)
theirs = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
out["rope"] = float((mine - theirs).abs().max())
# the QKV split and RoPE in one (fused_rope: qkv) against megatron's split, query copy and unfused
# RoPE, forward and backward, in float64: [s, b, groups, (heads per group + 2) * d], rotary dim < d
bshd = rope_utils._apply_rotary_pos_emb_bshd
mixed = torch.randn(12, 2, 2, 4 * 16, generator=gen, dtype=torch.float64, requires_grad=True)
freqs = torch.randn(12, 1, 1, 12, generator=gen, dtype=torch.float64)
grads = [torch.randn(12, 2, 4, 16, generator=gen, dtype=torch.float64), torch.randn(12, 2, 2, 16, generator=gen, dtype=torch.float64),
         torch.randn(12, 2, 2, 16, generator=gen, dtype=torch.float64)]
qr, kr, vr = torch.split(mixed, [32, 16, 16], dim=3)
ref = [bshd(qr.reshape(12, 2, 4, 16), freqs), bshd(kr, freqs), vr]
sum((t * g).sum() for t, g in zip(ref, grads)).backward()
ref_grad, mixed.grad = mixed.grad.clone(), None
got = kernels.qkv_rope(mixed, freqs, freqs, [32, 16, 16])
sum((t * g).sum() for t, g in zip(got, grads)).backward()
out["qkv_fn"] = {"fwd": max(float((a - b).abs().max()) for a, b in zip(got, ref)), "bwd": float((mixed.grad - ref_grad).abs().max()),
              "shapes": [list(t.shape) for t in got], "contiguous": [t.is_contiguous() for t in got]}
try:
    kernels.qkv_rope(mixed, freqs, freqs + 1, [32, 16, 16])
except ValueError as exc:
    out["qkv_fn"]["refused"] = str(exc)
# the tiny model: plain, then both switches (small chunks), same starting weights
tokens = torch.randint(0, 1024, (2, 128), generator=gen)
labels = torch.randint(0, 1024, (2, 128), generator=gen)
position_ids = torch.arange(128).expand(2, 128)
kernels.FUSED_LOSS_CHUNK = 48
tables, calls = kernels.rope_tables, []
kernels.rope_tables = lambda *a: calls.append(1) or tables(*a)  # counts the layers that took the qkv path
variants = (("plain", {}), ("fused", {"fused_rope": "compile", "fused_linear_loss": "chunked"}), ("qkv", {"fused_rope": "qkv"}),
            ("after", {}))
for name, par in variants:
    calls.clear()
    s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], **par}}, 1)
    model = modeling.build_model(s, modeling.transformer_config(s))
    startweights.overwrite(model, s)
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    out[name] = {"loss": loss.item(), "type": type(model).__name__, "rope": rope_utils._apply_rotary_pos_emb_bshd.__name__,
                 "qkv_calls": len(calls), "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()}}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.framework("megatron")
def test_fused_linear_loss_and_rope_match_the_plain_model(tmp_path):
    line = one_rank_check(_LOSS_ROPE_CHECK, tmp_path)
    res = json.loads(line[len("RESULT ") :])
    # float64 inputs, the softmax in float32 as on the GPU: loss, dx and dW equal logits + cross_entropy to float32's precision
    assert max(res["fn"]) < 1e-5
    assert res["rope"] < 1e-6
    # fused_rope: qkv: the same query, key and value and the same QKV gradient as megatron's path
    qkv = res["qkv_fn"]
    assert qkv["fwd"] < 1e-12 and qkv["bwd"] < 1e-12, qkv
    assert qkv["shapes"] == [[12, 2, 4, 16], [12, 2, 2, 16], [12, 2, 2, 16]] and qkv["contiguous"] == [True] * 3
    assert "two different rotary tables" in qkv["refused"]
    plain = res["plain"]
    for name in ("fused", "qkv", "after"):
        other = res[name]
        assert other["loss"] == pytest.approx(plain["loss"], rel=1e-6), name
        assert plain["grads"].keys() == other["grads"].keys()
        for param, g in plain["grads"].items():
            assert other["grads"][param] == pytest.approx(g, rel=1e-4, abs=1e-7), (name, param)
    assert (plain["type"], res["fused"]["type"]) == ("GPTModel", "FusedLossGPTModel") and res["fused"]["rope"] == "compiled_rope"
    # qkv took megatron's unsplit-QKV path in each of the model's layers; a model built after it without the switch did not
    assert res["qkv"]["qkv_calls"] == 2 and res["qkv"]["rope"] == res["after"]["rope"] == plain["rope"] != "compiled_rope"
    assert plain["qkv_calls"] == res["fused"]["qkv_calls"] == res["after"]["qkv_calls"] == 0


_SEQUENCE_PARALLEL_CHECK = r"""
import json, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])
import torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from cases.llama3.megatron import kernels, modeling, settings, startweights
from training import fused

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
model_parallel_cuda_manual_seed(1234)
fused.COMPILE_BACKEND = "aot_eager"
gen = torch.Generator().manual_seed(11)  # the same tokens on both ranks, as tensor parallelism has them
tokens = torch.randint(0, 1024, (2, 128), generator=gen)
labels = torch.randint(0, 1024, (2, 128), generator=gen)
position_ids = torch.arange(128).expand(2, 128)
out = {"rank": dist.get_rank()}
kernels.FUSED_LOSS_CHUNK = 48  # several chunks, the last one short
variants = {
    "tp": {},
    "sp": {"sequence_parallel": True},
    "sp_loss": {"sequence_parallel": True, "fused_linear_loss": "chunked"},
    "tp_add_norm": {"fused_add_norm": True},
    "sp_add_norm": {"sequence_parallel": True, "fused_add_norm": True},
}
for name, par in variants.items():
    s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], **par}}, 2)
    config = modeling.transformer_config(s)
    model = modeling.build_model(s, config)
    startweights.overwrite(model, s)
    seen = []
    model.decoder.layers[0].input_layernorm.register_forward_hook(lambda m, a, o: seen.append(list(a[0].shape)))
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False), module=model)
    loss = ddp(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    out[name] = {
        "loss": loss.item(),
        "norm_input": seen[0],
        "marked": sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
        "type": type(model).__name__,
        "layers": sorted({type(layer).__name__ for layer in model.decoder.layers}),
        "grads": {n: p.main_grad.flatten().tolist() for n, p in model.named_parameters()},
    }
s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], "fused_add_norm": True}}, 2)
out["own_norms"] = [modeling.fused_add_norm_in_use(s), modeling.fused_elementwise_in_use(s)]
uses_te = modeling.use_transformer_engine
modeling.use_transformer_engine = lambda s: True  # where TransformerEngine imports, under transformer_impl auto
out["te_norms"] = [modeling.fused_add_norm_in_use(s), modeling.fused_elementwise_in_use(s)]
modeling.use_transformer_engine = uses_te
with open(f"{sys.argv[2]}.{dist.get_rank()}", "w") as fh:  # one file a rank: their stdout lines would interleave
    json.dump(out, fh)
"""


@pytest.mark.framework("megatron")
def test_sequence_parallel_with_fused_norms_matches_tensor_parallel(tmp_path):
    """``parallel.sequence_parallel`` without TransformerEngine: with the compiled norms each of two
    tensor-parallel ranks normalizes half of the sequence, and after megatron's gradient
    finalization the loss and every gradient shard equal those of plain tensor parallelism; so
    do they with the chunked fused loss on top (which gathers the sequence shares itself), and with
    each residual sum fused into the norm after it (``fused_add_norm``), with and without sequence
    parallelism."""
    cfg = resolved_config(tmp_path, 2, "config_cpux1x2_TP2", parallel={"tp": 2, "fused_elementwise": "compile"})
    results = two_rank_check(_SEQUENCE_PARALLEL_CHECK, tmp_path, cfg)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for res in results:
        tp, sp, sp_loss = res["tp"], res["sp"], res["sp_loss"]
        assert tp["norm_input"] == [128, 2, 64] and sp["norm_input"] == sp_loss["norm_input"] == [64, 2, 64]  # [s, b, h]
        assert (tp["type"], sp["type"], sp_loss["type"]) == ("GPTModel", "GPTModel", "FusedLossGPTModel")
        assert sp_loss["marked"] == sp["marked"]
        assert tp["marked"] == [] and sp["marked"] == [
            "decoder.final_layernorm.weight",
            "decoder.layers.0.input_layernorm.weight",
            "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.1.input_layernorm.weight",
            "decoder.layers.1.pre_mlp_layernorm.weight",
        ]
        assert res["tp_add_norm"]["layers"] == res["sp_add_norm"]["layers"] == ["AddNormLayer"] and tp["layers"] == ["TransformerLayer"]
        assert res["own_norms"] == [True, "compile"] and res["te_norms"] == [False, "none"]  # TE's norms serve: the switch steps aside
        assert res["sp_add_norm"]["norm_input"] == [64, 2, 64] and res["sp_add_norm"]["marked"] == sp["marked"]
        for other in (sp, sp_loss, res["tp_add_norm"], res["sp_add_norm"]):
            assert other["loss"] == pytest.approx(tp["loss"], rel=1e-6)
            assert other["grads"].keys() == tp["grads"].keys()
            for name, g in tp["grads"].items():
                assert other["grads"][name] == pytest.approx(g, rel=1e-4, abs=1e-7), name


_CROSS_ENTROPY_CHECK = r"""
import json, os, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])
import torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
import megatron.core.fusions.fused_cross_entropy as fce
import megatron.core.models.common.language_module.language_module as lm
from cases.llama3.megatron import kernels, modeling, settings, startweights

device_type = cfg["vendor"]["device"]
if device_type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(cfg["vendor"]["dist_backend"])
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
model_parallel_cuda_manual_seed(1234)
if device_type == "cpu":  # the case's compiled norms, as megatron's fused cross-entropy below, run through aot_eager on the CPU
    from training import fused

    fused.COMPILE_BACKEND = "aot_eager"
if device_type == "cpu":  # megatron compiles its fused cross-entropy with Inductor; on the CPU the same graphs run through aot_eager
    for name in ("calculate_logits_max", "calculate_predicted_logits", "calculate_cross_entropy_loss", "calculate_gradients"):
        fn = getattr(fce, name)
        setattr(fce, name, torch.compile(getattr(fn, "_torchdynamo_orig_callable", fn), backend="aot_eager"))
calls = []
fused_ce = lm.fused_vocab_parallel_cross_entropy
lm.fused_vocab_parallel_cross_entropy = lambda *a: calls.append(1) or fused_ce(*a)
dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
gen = torch.Generator().manual_seed(11)  # the same tokens on both ranks, as tensor parallelism has them
tokens = torch.randint(0, 1024, (2, 128), generator=gen).to(dev)
labels = torch.randint(0, 1024, (2, 128), generator=gen).to(dev)
position_ids = torch.arange(128).expand(2, 128).to(dev)
out = {"rank": dist.get_rank()}
for name, par in json.loads(sys.argv[3]).items():
    s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], **par}}, 2)
    if s.layout.gradient_accumulation_fusion:
        kernels.install_wgrad_accumulation(dev, torch.bfloat16)
    config = modeling.transformer_config(s)
    model = modeling.build_model(s, config)
    startweights.overwrite(model, s)
    inner = model
    first = inner.decoder.layers[0]
    linears = [first.self_attention.linear_qkv, first.self_attention.linear_proj, first.mlp.linear_fc1, first.mlp.linear_fc2]
    model = Float16Module(config, model)  # as the trainer wraps a bf16 model: every parameter bf16, the loss float32
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    before = len(calls)
    loss = ddp(tokens, position_ids, None, labels=labels)
    (loss.float() * torch.linspace(0.5, 1.5, loss.numel(), device=dev).view(loss.shape)).mean().backward()
    finalize_model_grads([ddp])
    out[name] = {
        "loss": loss.float().mean().item(),
        "dtype": str(loss.dtype),
        "type": type(inner).__name__,
        "layers": sorted({type(layer).__name__ for layer in inner.decoder.layers}),
        "fused_calls": len(calls) - before,
        "linears": [type(lin).__name__ for lin in linears],
        "grads": {n: p.main_grad.float().flatten().tolist() for n, p in model.named_parameters()},
    }
with open(f"{sys.argv[2]}.{dist.get_rank()}", "w") as fh:
    json.dump(out, fh)
"""


def _two_rank_loss_check(tmp_path: Path, cfg: dict, variants: dict) -> list[dict]:
    """:data:`_CROSS_ENTROPY_CHECK` on two tensor-parallel processes of ``cfg``'s device, one
    forward and backward of the tiny model per variant (``parallel`` keys); each rank's results."""
    return two_rank_check(_CROSS_ENTROPY_CHECK, tmp_path, cfg, json.dumps(variants))


def _same_loss_and_grads(plain: dict, other: dict, rel: float) -> None:
    """The same loss, and each gradient the same within ``rel``: its distance from the plain
    one at most ``rel / 5`` of the plain one's norm, and no element further off than ``rel`` of
    the largest (bf16 paths that round in another order differ by a few units of the last place
    in single elements; a wrong gradient differs by the order of the gradient itself)."""
    assert other["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert plain["grads"].keys() == other["grads"].keys() and len(plain["grads"]) >= 10
    for name, g in plain["grads"].items():
        diff = [a - b for a, b in zip(other["grads"][name], g, strict=True)]
        distance, size = math.hypot(*diff), math.hypot(*g)
        assert distance <= rel / 5 * size, (name, distance / size)
        assert max(map(abs, diff)) <= rel * max(map(abs, g)), name


@pytest.mark.framework("megatron")
def test_megatrons_fused_cross_entropy_matches_its_own_under_tensor_parallelism(tmp_path):
    """``parallel.cross_entropy: fused`` (megatron's fused vocabulary-parallel cross-entropy) on two
    tensor-parallel ranks of the tiny model in bf16: the fused function runs once per forward, and
    the loss and every gradient equal those of megatron's own cross-entropy from the same
    starting weights (the logits' gradient is bf16 on both paths)."""
    cfg = resolved_config(tmp_path, 2, "config_cpux1x2_TP2", parallel={"tp": 2}, precision="bf16")
    for res in _two_rank_loss_check(tmp_path, cfg, {"megatron": {"cross_entropy": "megatron"}, "fused": {"cross_entropy": "fused"}}):
        plain, fused = res["megatron"], res["fused"]
        assert (plain["fused_calls"], fused["fused_calls"]) == (0, 1)
        assert plain["dtype"] == fused["dtype"] == "torch.float32"
        _same_loss_and_grads(plain, fused, 2e-2)


def _cuda_devices() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


_SYMM_MEM_VARIANTS = {
    "tp": {},
    "sp": {"sequence_parallel": True},
    "symm": {"sequence_parallel": True, "tp_comm_overlap": "symm_mem"},
    "sp_wgrad": {"sequence_parallel": True, "gradient_accumulation_fusion": True},
    "symm_wgrad": {"sequence_parallel": True, "tp_comm_overlap": "symm_mem", "gradient_accumulation_fusion": True},
    "symm_add_norm": {"sequence_parallel": True, "tp_comm_overlap": "symm_mem", "fused_add_norm": True},
}
_SYMM_MEM_LINEARS = ["GatherColumnParallelLinear", "ReduceScatterRowParallelLinear"] * 2
_MEGATRON_LINEARS = ["ColumnParallelLinear", "RowParallelLinear"] * 2


@pytest.mark.framework("megatron")
@pytest.mark.skipif(
    _cuda_devices() > 0,
    reason="the CPU check (on the GPU machine, torch 2.11, its compiled norms on gloo failed inside dynamo: "
    "'list indices must be integers or slices, not torch.device'); the two-GPU test checks the switch there",
)
def test_symm_mem_overlap_computes_what_sequence_parallelism_does(tmp_path):
    """``parallel.tp_comm_overlap: symm_mem`` on two tensor-parallel gloo ranks of the tiny model
    (bf16, compiled norms): qkv and fc1 are the case's gathering linears, proj and fc2 its
    reduce-scattering ones, and the loss and every gradient shard are exactly megatron's
    sequence-parallel ones (on the CPU the same collectives and GEMMs run in the same order), with
    the weight gradients summed into main_grad inside their GEMMs as well; with the residual sums in
    the norms, and against plain tensor parallelism, equal within bf16 rounding."""
    cfg = resolved_config(tmp_path, 2, "config_cpux1x2_TP2", parallel={"tp": 2, "fused_elementwise": "compile"}, precision="bf16")
    for res in _two_rank_loss_check(tmp_path, cfg, _SYMM_MEM_VARIANTS):
        assert res["tp"]["linears"] == res["sp"]["linears"] == res["sp_wgrad"]["linears"] == _MEGATRON_LINEARS
        for name in ("symm", "symm_wgrad", "symm_add_norm"):
            assert res[name]["linears"] == _SYMM_MEM_LINEARS, name
        assert res["symm_add_norm"]["layers"] == ["AddNormLayer"]
        assert res["symm"]["loss"] == res["sp"]["loss"] and res["symm"]["grads"] == res["sp"]["grads"]
        assert res["symm_wgrad"]["loss"] == res["sp_wgrad"]["loss"] and res["symm_wgrad"]["grads"] == res["sp_wgrad"]["grads"]
        for name in ("sp", "symm", "symm_wgrad", "symm_add_norm"):
            _same_loss_and_grads(res["tp"], res[name], 2e-2)


@pytest.mark.framework("megatron")
def test_symm_mem_overlap_through_start_task(tmp_path, megatron_python):
    """The tiny model's TP2 variant with sequence parallelism and ``tp_comm_overlap: symm_mem``, 30
    steps through start_task.py on two CPU processes: aligned with the committed TP2 curve, and
    run_meta names the switch and what carries its communication on this device."""
    sets = ["parallel.sequence_parallel=true", "parallel.tp_comm_overlap=symm_mem", "parallel.fused_elementwise=compile"]
    args = ["--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--variant", "TP2", "--log-dir", str(tmp_path)]
    proc = start_task(*args, *[a for v in sets for a in ("--set", v)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    (phase,) = json.loads((run_dir / "results.json").read_text())["rounds"][0]["phases"]
    assert phase["gate"]["verdict"] == "aligned" and phase["gate"]["mre"] < 0.005, phase["gate"]
    assert phase["reference"]["path"].endswith("llama3_tiny/standard.json")
    par = phase["meta"]["parallel"]
    assert (par["tp"], par["sequence_parallel"], par["tp_comm_overlap"]) == (2, True, "symm_mem")
    assert par["tp_comm_path"] == "plain collectives: all_gather_into_tensor, reduce_scatter_tensor"


def test_symm_mem_overlap_settings(tmp_path):
    st = _settings()
    par = {"tp": 2, "sequence_parallel": True, "fused_elementwise": "compile", "tp_comm_overlap": "symm_mem"}
    ok = st.from_config(resolved_config(tmp_path, 2, "x", parallel={**par, "fused_add_norm": True}), world_size=2)
    assert (ok.layout.tp_comm_overlap, ok.layout.fused_add_norm) == ("symm_mem", True)
    refused = {
        "parallel.tp_comm_overlap: symm_mem overlaps the tensor-parallel communication; with parallel.tp 1 there is none": (
            {"tp_comm_overlap": "symm_mem"}
        ),
        "parallel.tp_comm_overlap: symm_mem runs the gathers and reduce-scatters of sequence parallelism: set parallel.sequence_parallel: true": (
            {"tp": 2, "tp_comm_overlap": "symm_mem"}
        ),
        "parallel.tp_comm_overlap: symm_mem replaces megatron's local linear layers; TransformerEngine brings its own overlap": (
            {**par, "fused_elementwise": "none", "transformer_impl": "transformer_engine"}
        ),
    }
    for message, parallel in refused.items():
        with pytest.raises(st.SettingsError, match=re.escape(message)):
            st.from_config(resolved_config(tmp_path, 2, "x", parallel=parallel), world_size=2)


@pytest.mark.framework("megatron")
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices: runs on the GPU machine")
def test_the_liger_switches_match_megatrons_path_on_two_gpus(tmp_path):
    """On two CUDA devices (TP2, NCCL, bf16, the tiny model): ``cross_entropy: liger`` (liger's
    vocabulary-parallel kernels, the sums all-reduced over the tensor-parallel group),
    ``cross_entropy: fused`` (megatron's, compiled by Inductor) and ``fused_add_norm`` with liger's
    norms give the loss and every gradient shard of megatron's own path with liger's norms, from
    the same starting weights, within bf16 rounding; so does ``fused_rope: qkv`` on top of those
    (Inductor's kernels for the QKV split and RoPE)."""
    par = {"tp": 2, "fused_elementwise": "liger"}
    cfg = _cuda(resolved_config(tmp_path, 2, "config_cpux1x2_TP2", parallel=par, precision="bf16"))
    variants = {
        "megatron": {},
        "liger": {"cross_entropy": "liger"},
        "fused": {"cross_entropy": "fused"},
        "add_norm": {"cross_entropy": "liger", "fused_add_norm": True},
        "qkv_rope": {"cross_entropy": "liger", "fused_add_norm": True, "fused_rope": "qkv"},
    }
    for res in _two_rank_loss_check(tmp_path, cfg, variants):
        plain = res["megatron"]
        assert (res["liger"]["type"], res["add_norm"]["type"], plain["type"]) == ("LigerLossGPTModel", "LigerLossGPTModel", "GPTModel")
        assert res["add_norm"]["layers"] == res["qkv_rope"]["layers"] == ["AddNormLayer"] and res["fused"]["fused_calls"] == 1
        for name in ("liger", "fused", "add_norm", "qkv_rope"):
            _same_loss_and_grads(plain, res[name], 5e-2)


@pytest.mark.framework("megatron")
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices: runs on the GPU machine")
def test_symm_mem_overlap_matches_sequence_parallelism_on_two_gpus(tmp_path):
    """On two CUDA devices (TP2, bf16, liger's norms, the tiny model) ``tp_comm_overlap: symm_mem``
    runs torch's symmetric-memory GEMMs (each split by rank, the peer's share copied beside it):
    the loss and every gradient shard are those of megatron's sequence parallelism (NCCL's gathers
    and reduce-scatters) and of plain tensor parallelism within bf16 rounding, with the weight
    gradients summed into main_grad in their GEMMs and with the residual sums in the norms."""
    cfg = _cuda(resolved_config(tmp_path, 2, "config_cpux1x2_TP2", parallel={"tp": 2, "fused_elementwise": "liger"}, precision="bf16"))
    for res in _two_rank_loss_check(tmp_path, cfg, _SYMM_MEM_VARIANTS):
        for name in ("symm", "symm_wgrad", "symm_add_norm"):
            assert res[name]["linears"] == _SYMM_MEM_LINEARS, name
        _same_loss_and_grads(res["sp"], res["symm"], 5e-2)
        _same_loss_and_grads(res["sp_wgrad"], res["symm_wgrad"], 5e-2)
        for name in ("sp", "symm", "symm_wgrad", "symm_add_norm"):
            _same_loss_and_grads(res["tp"], res[name], 5e-2)


def _cuda_with(*modules: str) -> bool:
    """Whether torch sees a CUDA device here and ``modules`` import."""
    try:
        import torch

        for module in modules:
            importlib.import_module(module)
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_with("liger_kernel"), reason="needs a CUDA device with torch and liger-kernel: runs on the GPU machine")
def test_liger_cross_entropy_equals_torchs_on_a_gpu():
    """``parallel.cross_entropy: liger`` on one CUDA device (no TP): the per-token loss of bf16
    logits and their gradient under a non-uniform incoming gradient equal torch's cross-entropy
    of the same logits in float32."""
    import torch
    import torch.nn.functional as F

    from cases.llama3.megatron import kernels

    gen = torch.Generator(device="cuda").manual_seed(5)
    s, b, v = 512, 2, 32000
    logits = (torch.randn(s, b, v, device="cuda", generator=gen) * 4).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (s, b), device="cuda", generator=gen)
    weight = torch.rand(s, b, device="cuda", generator=gen)
    loss = kernels.liger_cross_entropy(logits, labels, None)
    (loss * weight).sum().backward()
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, v), labels.view(-1), reduction="none").view(s, b)
    (ref * weight).sum().backward()
    assert loss.shape == (s, b) and loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert float((loss - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    assert float((logits.grad.float() - ref_logits.grad).abs().max()) < 1e-2 * float(ref_logits.grad.abs().max())
    with pytest.raises(RuntimeError, match="parallel.cross_entropy: liger runs Triton kernels on CUDA devices"):
        kernels.liger_cross_entropy(logits.detach().cpu(), labels.cpu(), None)


@pytest.mark.skipif(not _cuda_with("liger_kernel"), reason="needs a CUDA device with torch and liger-kernel: runs on the GPU machine")
def test_liger_add_norm_equals_the_sum_then_the_norm_on_a_gpu():
    """``parallel.fused_add_norm`` with liger's norms on one CUDA device: ``add_forward`` gives the
    residual sum and its norm as megatron's add followed by the liger norm does, and the same
    gradients for both inputs and the weight under non-uniform incoming gradients of both outputs."""
    import torch

    from cases.llama3.megatron import kernels

    class Config:
        normalization, sequence_parallel = "RMSNorm", False

    torch.manual_seed(7)
    norm = kernels.LigerRMSNorm(Config(), 4096, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, r = (torch.randn(1024, 2, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    gy, gs = (torch.randn(1024, 2, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y, total = norm.add_forward(x, r)
    torch.autograd.backward([y, total], [gy, gs])
    fused = [t.grad.clone() for t in (x, r)] + [norm.weight.grad.clone()]
    x.grad = r.grad = norm.weight.grad = None
    total_ref = r + x
    y_ref = norm(total_ref)
    torch.autograd.backward([y_ref, total_ref], [gy, gs])
    assert torch.equal(total, total_ref)
    assert float((y.float() - y_ref.float()).abs().max()) <= 2e-2 * float(y_ref.float().abs().max())
    for got, want in zip(fused, [x.grad, r.grad, norm.weight.grad]):
        assert float((got.float() - want.float()).abs().max()) <= 2e-2 * float(want.float().abs().max())


@pytest.mark.skipif(not _cuda_with("megatron.core"), reason="needs a CUDA device with torch and megatron-core: runs on the GPU machine")
def test_fused_grad_clip_stays_on_the_device_on_a_gpu():
    """``parallel.fused_grad_clip`` on one CUDA device, float32 gradients of llama3_8b's TP2 shapes
    (a layer's QKV, fc1 and norm weight, and the vocabulary shard): the norm equals the norm of all
    of them as one vector to float32 rounding and the in-place scaling equals megatron's product,
    and neither waits for the host (torch's sync debug mode set to raise), while megatron's own
    per-tensor fallback does wait: what the switch removes from each step."""
    import torch
    from megatron.core import utils as mutils

    from cases.llama3.megatron import kernels

    gen = torch.Generator(device="cuda").manual_seed(11)
    shapes = [(3072, 4096), (14336, 4096), (4096,), (64128, 4096)]
    grads = [torch.randn(*shape, device="cuda", generator=gen) for shape in shapes]
    want = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in grads]))
    scaled = [g * 0.37 for g in grads]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, none = kernels.foreach_l2_norm(2048 * 32, None, [grads], False)
        kernels.foreach_scale(2048 * 32, None, [grads, grads], 0.37)
        with pytest.raises(RuntimeError, match="synchroniz"):
            mutils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert none is None and norm.shape == (1,) and norm.device.type == "cuda" and norm.dtype == torch.float32
    assert float(norm) == pytest.approx(float(want), rel=1e-5)
    assert all(torch.equal(g, s) for g, s in zip(grads, scaled))


@pytest.mark.skipif(not _cuda_with(), reason="needs a CUDA device: runs on the GPU machine")
def test_qkv_rope_equals_the_split_then_the_rotation_on_a_gpu():
    """``parallel.fused_rope: qkv`` on one CUDA device (Inductor's kernels), bf16 at a rank's
    share of llama3_8b under TP2 (4 KV groups of 4 query heads, head dim 128): query, key and value
    and the QKV gradient equal megatron's split followed by its rotation, worked in float32 from
    the same bf16 inputs, within bf16 rounding; the query's gradient arrives in the layout
    attention's backward gives it (``[b, h, s, d]`` permuted)."""
    import torch

    from cases.llama3.megatron import kernels

    gen = torch.Generator(device="cuda").manual_seed(9)
    s, b, groups, per_group, d = 1024, 2, 4, 4, 128
    mixed = torch.randn(s, b, groups, (per_group + 2) * d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, d], halves repeated
    dq = torch.randn(b, groups * per_group, s, d, device="cuda", generator=gen).to(torch.bfloat16).permute(2, 0, 1, 3)
    dk, dv = (torch.randn(s, b, groups, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    q, k, v = kernels.qkv_rope(mixed, freqs, freqs, [per_group * d, d, d])
    torch.autograd.backward([q, k, v], [dq, dk, dv])
    ref_mixed = mixed.detach().float().requires_grad_()
    rq, rk, rv = torch.split(ref_mixed, [per_group * d, d, d], dim=3)
    ref = [kernels.rope_bshd(rq.reshape(s, b, -1, d), freqs, 1.0), kernels.rope_bshd(rk, freqs, 1.0), rv]
    torch.autograd.backward(ref, [dq.float(), dk.float(), dv.float()])
    assert [t.shape for t in (q, k, v)] == [(s, b, groups * per_group, d), (s, b, groups, d), (s, b, groups, d)]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (q, k, v))
    for got, want in zip([q, k, v, mixed.grad], [t.detach() for t in ref] + [ref_mixed.grad]):
        assert float((got.float() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    assert torch.equal(v, mixed.detach()[..., (per_group + 1) * d :])  # value passes through as it is


_ADAM_CHECK = r"""
import io, json, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])
import torch
from megatron.core import parallel_state
from cases.llama3.megatron import kernels
from cases.llama3.megatron.train import Trainer
from training.metriclog import MetricLogger, parse_lines

out = {}
variants = {
    "default": {},
    "fused": {"fused_adam": True},
    "fused_plain_optimizer": {"fused_adam": True, "distributed_optimizer": False},
    "wgrad_fused": {"gradient_accumulation_fusion": True},
    # the tiny model's gradient norms stay under the case's clip_grad (1.0): these clip at 0.5
    "clip_default": {"clip_grad": 0.5},
    "clip_fused": {"fused_grad_clip": True, "clip_grad": 0.5},
    "clip_fused_plain_optimizer": {"fused_grad_clip": True, "distributed_optimizer": False, "clip_grad": 0.5},
    "after_clip": {"clip_grad": 0.5},
}
from megatron.core.optimizer import clip_grads
clip_calls = []
for fn in ("foreach_l2_norm", "foreach_scale"):  # counts the calls megatron's clip module makes to the switch's functions
    setattr(kernels, fn, (lambda f, n: lambda *a: clip_calls.append(n) or f(*a))(getattr(kernels, fn), fn))
for name, par in variants.items():
    clip_calls.clear()
    stream = io.StringIO()
    train = {**cfg["train"], "clip_grad": par.pop("clip_grad", cfg["train"]["clip_grad"])}
    t = Trainer({**cfg, "train": train, "parallel": {**cfg["parallel"], **par}}, MetricLogger(stream=stream), "train")
    t.build()
    inner = kernels._torch_adams(t.optimizer)
    for step in (1, 2, 3):
        t.step(step)
    records = parse_lines(stream.getvalue().splitlines()).records
    meta = [r.value for r in records if r.key == "run_meta"][0]["parallel"]
    out[name] = {
        "losses": [r.value["loss"] for r in records if r.key == "train_step"],
        "kernel": meta["adam_kernel"],
        "switch": meta["fused_adam"],
        "clip": [meta["fused_grad_clip"], meta["grad_clip_kernel"], sorted(set(clip_calls)), len(clip_calls)],
        "grad_norms": [r.value["grad_norm"] for r in records if r.key == "train_step"],
        "wgrad": meta["wgrad_accumulation"],
        "accumulated": t.s.layout.grad_accum,
        "flags": sorted({(g["foreach"], g["fused"]) for o in inner for g in o.param_groups}, key=str),
        "step_device": sorted({str(s["step"].device) for o in inner for s in o.state.values()}),
        "params": [p.detach().flatten()[:64].tolist() for p in t.model.parameters()],
    }
    parallel_state.destroy_model_parallel()
try:
    kernels.fuse_adam(t.optimizer, True)
except RuntimeError as exc:
    out["after_step"] = str(exc)
# the switch's two functions against megatron's own fallbacks on the same tensors
from megatron.core import utils as mcore_utils
gen = torch.Generator().manual_seed(4)
grads = [torch.randn(*shape, generator=gen) for shape in ((7, 5), (130,), (3, 4, 9))]
theirs, mine, into = [g.clone() for g in grads], [g.clone() for g in grads], [torch.zeros_like(g) for g in grads]
mcore_utils.local_multi_tensor_scale(0, None, [theirs, theirs], 0.37)
kernels.foreach_scale(0, None, [mine, mine], 0.37)
kernels.foreach_scale(0, None, [grads, into], 0.37)  # a destination that is not its source
norm_theirs = mcore_utils.local_multi_tensor_l2_norm(0, None, [grads], False)[0]
norm_mine = kernels.foreach_l2_norm(0, None, [grads], False)[0]
out["clip_fns"] = {
    "scale": max(float((a - b).abs().max()) for a, b in zip(theirs, mine)),
    "into": max(float((a - b).abs().max()) for a, b in zip(theirs, into)),
    "scaled": float(mine[0][0, 0] / grads[0][0, 0]),
    "norm": [float(norm_theirs[0]), float(norm_mine[0]), list(norm_mine.shape)],
}
# bfloat16 products into a float32 buffer: on a CPU the product in bf16, then added (on CUDA
# with torch >= 2.8 one out_dtype GEMM); an older CUDA torch without apex is refused up front
gen = torch.Generator().manual_seed(5)
x, dy, buf = torch.randn(6, 3, generator=gen).bfloat16(), torch.randn(6, 4, generator=gen).bfloat16(), torch.ones(4, 3)
kernels.wgrad_gemm_accum(x, dy, buf)
out["mixed"] = float((buf - (1 + (dy.t() @ x).float())).abs().max())
from training import gemm
gemm._PROBED[("cuda", torch.bfloat16)] = False  # as a torch without out_dtype GEMMs would answer
try:
    kernels.install_wgrad_accumulation(torch.device("cuda"), torch.bfloat16)
except RuntimeError as exc:
    out["old_torch"] = str(exc)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.framework("megatron")
def test_fused_adam_and_wgrad_accumulation_step_as_the_default_path_does(tmp_path):
    """``parallel.fused_adam``: the case's own trainer (megatron's optimizer without apex or
    TransformerEngine, i.e. torch's AdamW, behind the distributed optimizer and behind the plain
    one) switched to torch's fused kernel: run_meta names the kernel, the step counters live on
    the parameters' device, and three steps give the default kernel's losses and weights to
    float32 rounding; switching after a step is refused. ``parallel.gradient_accumulation_fusion``:
    megatron's linear layers add each micro batch's weight gradient to main_grad through the
    case's stand-in for apex's kernel; three steps of several micro batches each give the
    default path's losses and weights, and a bfloat16 product lands in a float32 buffer exactly.
    ``parallel.fused_grad_clip``: megatron's clipping through torch's multi-tensor kernels gives
    the default path's gradient norms, losses and weights."""
    line = one_rank_check(_ADAM_CHECK, tmp_path)
    res = json.loads(line[len("RESULT ") :])
    default, fused, plain = res["default"], res["fused"], res["fused_plain_optimizer"]
    assert default["switch"] is False and fused["switch"] is plain["switch"] is True
    # torch's default on this CPU: neither flag set, the for-loop (foreach runs on CUDA devices)
    assert default["kernel"] == "torch AdamW for-loop" and default["flags"] == [[None, None]]
    assert fused["kernel"] == plain["kernel"] == "torch AdamW fused"
    assert fused["flags"] == plain["flags"] == [[False, True]]
    assert fused["step_device"] == plain["step_device"] == ["cpu"]  # made by the fused path: a tensor on the params' device
    assert len(default["losses"]) == 3 and default["losses"][2] < default["losses"][0]
    for other in (fused, plain):
        assert other["losses"] == pytest.approx(default["losses"], rel=1e-6)
        for a, b in zip(default["params"], other["params"], strict=True):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    assert "has stepped already" in res["after_step"]
    wgrad = res["wgrad_fused"]
    assert (default["wgrad"], wgrad["wgrad"]) == ("off", "torch addmm into main_grad") and wgrad["accumulated"] > 1
    assert wgrad["losses"] == pytest.approx(default["losses"], rel=1e-6)
    for a, b in zip(default["params"], wgrad["params"], strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    # parallel.fused_grad_clip: megatron's clip module norms and scales through torch's multi-tensor
    # kernels, with either optimizer; clipping took place (the norms above clip_grad 1.0), and the
    # norms, losses and weights are the default path's to float32 rounding; a trainer built without
    # the switch afterwards is back on megatron's per-tensor loops
    clip_default = res["clip_default"]
    assert min(clip_default["grad_norms"]) > 0.5 and clip_default["losses"] != pytest.approx(default["losses"], rel=1e-6)
    for name in ("clip_fused", "clip_fused_plain_optimizer"):
        clip = res[name]
        assert clip["clip"][:3] == [True, "torch foreach (norm on the device, scaling in place)", ["foreach_l2_norm", "foreach_scale"]], (
            name
        )
        assert clip["clip"][3] == 6  # a norm and a scaling each step
        assert clip["grad_norms"] == pytest.approx(clip_default["grad_norms"], rel=1e-5)
        assert clip["losses"] == pytest.approx(clip_default["losses"], rel=1e-6)
        for a, b in zip(clip_default["params"], clip["params"], strict=True):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    assert default["clip"] == clip_default["clip"] == res["after_clip"]["clip"] == [False, "megatron per-tensor", [], 0]
    fns = res["clip_fns"]  # the scaling exactly megatron's, the norm to float32 rounding
    assert fns["scale"] == fns["into"] == 0.0 and fns["scaled"] == pytest.approx(0.37, rel=1e-6)
    assert fns["norm"][1] == pytest.approx(fns["norm"][0], rel=1e-6) and fns["norm"][2] == [1] and fns["norm"][0] > 10
    assert res["mixed"] < 1e-5
    assert res["old_torch"].startswith("parallel.gradient_accumulation_fusion: neither apex's fused_weight_gradient_mlp_cuda nor a torch")


def test_halves_overlap_settings(tmp_path):
    st = _settings()
    ok = st.from_config(resolved_config(tmp_path, 2, "x", parallel={"tp": 2, "tp_comm_overlap": "halves"}, micro_batch=2), world_size=2)
    assert ok.layout.tp_comm_overlap == "halves"
    assert st.from_config(resolved_config(tmp_path, 1, "x"), world_size=1).layout.tp_comm_overlap == "none"  # today's path
    refused = {
        "parallel.tp_comm_overlap must be one of none, halves, symm_mem, got 'userbuffers'": (
            {"tp": 2, "tp_comm_overlap": "userbuffers"},
            2,
        ),
        "parallel.tp_comm_overlap: halves overlaps the tensor-parallel all-reduces; with parallel.tp 1 there are none": (
            {"tp_comm_overlap": "halves"},
            2,
        ),
        "parallel.tp_comm_overlap: halves splits each micro batch in two; train.micro_batch is 1, set an even one": (
            {"tp": 2, "tp_comm_overlap": "halves"},
            1,
        ),
        "without parallel.sequence_parallel; set one of them off": (
            {"tp": 2, "tp_comm_overlap": "halves", "sequence_parallel": True, "fused_elementwise": "compile"},
            2,
        ),
        "which full recompute would replay; use recompute none or selective": (
            {"tp": 2, "tp_comm_overlap": "halves", "recompute": "full"},
            2,
        ),
        "runs megatron's local layers; TransformerEngine brings its own overlap": (
            {"tp": 2, "tp_comm_overlap": "halves", "transformer_impl": "transformer_engine"},
            2,
        ),
    }
    for message, (parallel, micro) in refused.items():
        world = parallel.get("tp", 1)
        with pytest.raises(st.SettingsError) as err:
            st.from_config(resolved_config(tmp_path, world, "x", parallel=parallel, micro_batch=micro), world_size=world)
        assert message in str(err.value)
    case = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))
    assert case["standard"]["parallel"]["tp_comm_overlap"] == "none" and "parallel.tp_comm_overlap" in case["vendor_may_change"]


_HALVES_CHECK = r"""
import json, sys
from training import runtime
cfg = runtime.setup(["--config", sys.argv[1]])
import torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from cases.llama3.megatron import kernels, modeling, settings, startweights

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
model_parallel_cuda_manual_seed(1234)
gen = torch.Generator().manual_seed(13)  # the same tokens on both ranks, as tensor parallelism has them
tokens = torch.randint(0, 1024, (2, 128), generator=gen)
labels = torch.randint(0, 1024, (2, 128), generator=gen)
position_ids = torch.arange(128).expand(2, 128)
kernels.FUSED_LOSS_CHUNK = 48
events, recording = [], [False]
start = dist.all_reduce


class Logged:  # the async all-reduce's handle, its wait said
    def __init__(self, work):
        self.work = work

    def wait(self):
        events.append("wait")
        return self.work.wait()


def all_reduce(tensor, *args, **kwargs):
    work = start(tensor, *args, **kwargs)
    if recording[0] and kwargs.get("async_op"):
        events.append("start")
        return Logged(work)
    return work


dist.all_reduce = all_reduce
out = {"rank": dist.get_rank()}
variants = {
    "tp": {},
    "halves": {"tp_comm_overlap": "halves"},
    "halves_loss": {"tp_comm_overlap": "halves", "fused_linear_loss": "chunked"},
    "halves_wgrad": {"tp_comm_overlap": "halves", "gradient_accumulation_fusion": True},  # as the 2 x H200 config runs
}
for name, par in variants.items():
    s = settings.from_config({**cfg, "parallel": {**cfg["parallel"], **par}}, 2)
    if s.layout.gradient_accumulation_fusion:
        kernels.install_wgrad_accumulation(torch.device("cpu"), torch.float32)
    config = modeling.transformer_config(s)
    model = modeling.build_model(s, config)
    startweights.overwrite(model, s)
    layer = model.decoder.layers[0]
    shapes = []
    layer.input_layernorm.register_forward_hook(lambda m, a, o: shapes.append(list(a[0].shape)))
    final_in = []  # what the last layer hands the final norm
    model.decoder.final_layernorm.register_forward_hook(lambda m, a, o: final_in.append(a[0].is_contiguous()))
    for each in model.decoder.layers:
        for module, what in ((each.self_attention, "attention"), (each.mlp, "mlp")):
            module.register_forward_pre_hook(lambda m, a, what=what: recording[0] and events.append(what))
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False), module=model)
    events.clear()
    recording[0] = True
    loss = ddp(tokens, position_ids, None, labels=labels).float().mean()
    recording[0] = False
    schedule = list(events)
    loss.backward()
    finalize_model_grads([ddp])
    out[name] = {
        "loss": loss.item(),
        "layer": type(layer).__name__,
        "norm_input": shapes,
        "final_norm_contiguous": final_in,
        "schedule": schedule,
        "own_reduce": [layer.self_attention.linear_proj.explicit_expert_comm, layer.mlp.linear_fc2.explicit_expert_comm],
        "grads": {n: p.main_grad.flatten().tolist() for n, p in model.named_parameters()},
    }
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
with open(f"{sys.argv[2]}.{dist.get_rank()}", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.framework("megatron")
def test_halves_overlap_matches_tensor_parallel(tmp_path):
    """``parallel.tp_comm_overlap: halves`` on two tensor-parallel gloo ranks: each layer runs the
    micro batch of 2 as two halves of 1 in the overlapping order (one half's all-reduce starts
    before the other half's work and is waited for only after it; the first layer's last sum is
    waited for in the second layer, after its attention of the first half), the row-parallel
    layers hand on their partial sums, and the loss and every gradient shard equal those of
    megatron's own layer; so do they with the chunked fused loss after the layers, and with the
    weight gradients added to main_grad inside their GEMMs."""
    cfg = resolved_config(tmp_path, 2, "config_cpux1x2_TP2", parallel={"tp": 2}, micro_batch=2)
    results = two_rank_check(_HALVES_CHECK, tmp_path, cfg)
    # layer 1 hands B's last MLP sum on to layer 2, which waits for it after its attention(A)
    first = ["attention", "start", "attention", "start", "wait", "mlp", "start", "wait", "mlp", "start", "wait"]
    last = ["attention", "start", "wait", "attention", "start", "wait", "mlp", "start", "wait", "mlp", "start", "wait", "wait"]
    for res in results:
        tp = res["tp"]
        assert tp["layer"] == "TransformerLayer" and tp["own_reduce"] == [False, False]
        assert tp["norm_input"] == [[128, 2, 64]] and tp["schedule"] == ["attention", "mlp"] * 2  # megatron's: synchronous
        for name in ("halves", "halves_loss", "halves_wgrad"):
            other = res[name]
            assert other["layer"] == "HalvesOverlapLayer" and other["own_reduce"] == [True, True]
            assert other["norm_input"] == [[128, 1, 64], [128, 1, 64]] and other["final_norm_contiguous"] == [True]
            assert other["schedule"] == first + last, other["schedule"]
            assert other["loss"] == pytest.approx(tp["loss"], rel=1e-6)
            assert other["grads"].keys() == tp["grads"].keys()
            for n, g in tp["grads"].items():
                assert other["grads"][n] == pytest.approx(g, rel=1e-4, abs=1e-7), (name, n)


# ``parallel.offload_pinned_copy``: megatron's split of the parameters between the host and the
# device optimizer, and the patched one, on the same parameters. On the CPU no parameter is on a
# device, so only the float32 copies and the grouping are compared there; the host copies are
# compared on a GPU.
_OFFLOAD_SPLIT = r"""
import json, sys, types
import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from cases.llama3.megatron import kernels, mcore_patches

device = sys.argv[1]
gen = torch.Generator().manual_seed(5)
def param(shape, dtype):
    return torch.nn.Parameter(torch.randn(*shape, generator=gen).to(device=device, dtype=dtype))
groups = [
    {"params": [param((64, 32), torch.bfloat16), param((32,), torch.float32), param((48, 16), torch.bfloat16)], "wd_mult": 1.0},
    {"params": [param((16,), torch.bfloat16), param((8, 8), torch.float32)], "wd_mult": 0.0},
]
megatrons = HybridDeviceOptimizer._get_sub_optimizer_param_groups

def described(out, params):
    host_groups, device_groups, to_host, to_device, fp32 = out
    index = {id(p): i for i, p in enumerate(params)}
    def tensor(t):
        return [str(t.device.type), str(t.dtype), list(t.shape), t.is_pinned() if t.device.type == "cpu" else None,
                t.detach().double().cpu().flatten().tolist(), index.get(id(t))]
    return {
        "host": [[{k: v for k, v in g.items() if k != "params"}, [tensor(t) for t in g["params"]]] for g in host_groups],
        "device": [[{k: v for k, v in g.items() if k != "params"}, [tensor(t) for t in g["params"]]] for g in device_groups],
        "to_host": [[index[id(k)], tensor(v)] for k, v in to_host.items()],
        "to_device": [[tensor(k), index[id(v)]] for k, v in to_device.items()],
        "fp32": [[index[id(k)], tensor(v)] for k, v in fp32.items()],
    }

params = [p for g in groups for p in g["params"]]
found = {}
for fp32 in (False, True):
    for fraction in (0.0, 0.4, 1.0):
        me = types.SimpleNamespace(param_groups=groups, param_update_in_fp32=fp32)
        theirs, ours = described(megatrons(me, fraction), params), described(kernels.offload_param_groups(me, fraction), params)
        found[f"{fp32}-{fraction}"] = {"same": theirs == ours, "host_copies": len(theirs["to_host"]), "fp32": len(theirs["fp32"])}
kernels.install_offload_copy(True)
patched = HybridDeviceOptimizer._get_sub_optimizer_param_groups is kernels.offload_param_groups
applied = mcore_patches.applied()["applied"]
kernels.install_offload_copy(False)
print("RESULT " + json.dumps({"found": found, "patched": patched, "applied": applied,
      "restored": HybridDeviceOptimizer._get_sub_optimizer_param_groups is megatrons and not mcore_patches.applied()["applied"]}))
"""


def _offload_split(py: str, device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([py, "-c", _OFFLOAD_SPLIT, device], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def _check_offload_split(res: dict, on_device: bool) -> None:
    assert all(case["same"] for case in res["found"].values()), res["found"]
    # the float32 copies of the bfloat16 parameters are made in every case; host copies only of device parameters
    assert {k: v["fp32"] for k, v in res["found"].items()} == {
        f"{fp32}-{f}": 3 if fp32 == "True" else 0 for fp32 in ("False", "True") for f in (0.0, 0.4, 1.0)
    }
    copies = {k: v["host_copies"] for k, v in res["found"].items()}
    assert copies == (
        {f"{b}-{f}": n for b in ("False", "True") for f, n in ((0.0, 0), (0.4, 1), (1.0, 5))} if on_device else dict.fromkeys(copies, 0)
    )
    assert res["patched"] and res["applied"] == {"offload_copy": "parallel.offload_pinned_copy"} and res["restored"], res


@pytest.mark.framework("megatron")
def test_offload_pinned_copy_splits_as_megatron_does_on_the_cpu(tmp_path):
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    _check_offload_split(_offload_split(py, "cpu"), on_device=False)


@pytest.mark.skipif(not _cuda_with("megatron.core"), reason="needs a CUDA device with torch and megatron-core: runs on the GPU machine")
def test_offload_pinned_copy_makes_megatrons_host_copies_on_a_gpu():
    """On a GPU: the same parameters go to the host, as the same pinned values, in the same groups
    and maps, at offload fractions 0, 0.4 and 1, with and without float32 updates."""
    import sys

    _check_offload_split(_offload_split(sys.executable, "cuda"), on_device=True)
