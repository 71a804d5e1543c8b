"""gpt3/paddle's starting weights (cases/gpt3/paddle/weights.py) do not depend on the layout.

The name mapping, init rules and TP slices are checked here directly; the
built models in the paddle environment (``FB_TEST_PADDLE_PYTHON``; skipped
without it): one process builds the unsharded model under different global
seeds and with fused QKV; two 2-process launches build the TP2 and the PP2
models (layouts paddle's CPU build can construct but not train: see
docs/cases/gpt3.md) and save every rank's parameters under their layout-free
names, which must put together exactly the single-process model. The loss
curves of the layouts that do train on the CPU are compared in test_gpt3_run.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from cases.gpt3.paddle import weights as W
from tests.case_helpers import framework_python
from training import shapes

ROOT = Path(__file__).resolve().parent.parent
CASE_DIR = ROOT / "cases" / "gpt3" / "paddle"
CASE = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))
TINY = CASE["models"]["gpt3_tiny"]

SHAPE = shapes.read(TINY["shape"])
#: GPTForCausalLMPipe.get_sequential_name_prefixes() of the 4-layer model
PIPE_PREFIXES = {
    "0": "gpt.embeddings",
    **{str(i + 1): f"gpt.decoder.layers.{i}" for i in range(4)},
    "5": "gpt.decoder.norm",
    "6": "gpt.embeddings.word_embeddings",
}


def test_pipeline_names_are_single_model_names_with_global_layer_index():
    f = W.layout_free_name
    assert f("gpt.decoder.layers.3.linear1.weight", None) == "gpt.decoder.layers.3.linear1.weight"
    # a second stage's first decoder layer is sublayer "3" of the pipeline: global layer 2
    assert f("3.linear1.weight", PIPE_PREFIXES) == "gpt.decoder.layers.2.linear1.weight"
    assert f("5.weight", PIPE_PREFIXES) == "gpt.decoder.norm.weight"
    assert f("shared_layers.gpt_shared_weight.position_embeddings.weight", PIPE_PREFIXES) == "gpt.embeddings.position_embeddings.weight"
    # the LM head of a last stage without the embedding is the tied token table
    for name in ("shared_layers.gpt_shared_weight.weight", "shared_layers.gpt_shared_weight.word_embeddings.weight"):
        assert f(name, PIPE_PREFIXES) == "gpt.embeddings.word_embeddings.weight"
    with pytest.raises(RuntimeError, match="pipeline parameter '9.linear1.weight': no single-model name"):
        f("9.linear1.weight", PIPE_PREFIXES)


def test_init_rules():
    std = 0.02
    scaled = std / math.sqrt(2 * 4)
    assert W.rule("gpt.embeddings.word_embeddings.weight", SHAPE, std) == ("normal", (1024, 64), std)
    assert W.rule("gpt.embeddings.position_embeddings.weight", SHAPE, std) == ("normal", (128, 64), std)
    assert W.rule("gpt.decoder.layers.3.self_attn.out_proj.weight", SHAPE, std) == ("normal", (64, 64), scaled)
    assert W.rule("gpt.decoder.layers.0.linear2.weight", SHAPE, std) == ("normal", (256, 64), scaled)
    assert W.rule("gpt.decoder.layers.0.linear1.weight", SHAPE, std) == ("normal", (64, 256), std)
    assert W.rule("gpt.decoder.layers.1.self_attn.qkv_proj.weight", SHAPE, std) == ("qkv", (64, 192), std)
    assert W.rule("gpt.decoder.layers.1.linear1.bias", SHAPE, std) == ("const", (256,), 0.0)
    assert W.rule("gpt.decoder.layers.1.norm2.weight", SHAPE, std) == ("const", (64,), 1.0)
    assert W.rule("gpt.decoder.norm.bias", SHAPE, std) == ("const", (64,), 0.0)
    with pytest.raises(RuntimeError, match=r"'gpt.decoder.layers.4.linear1.weight': no initialisation rule .* \(4 layers\)"):
        W.rule("gpt.decoder.layers.4.linear1.weight", SHAPE, std)
    with pytest.raises(RuntimeError, match="'gpt.decoder.layers.0.mlp.gate.weight': no initialisation rule"):
        W.rule("gpt.decoder.layers.0.mlp.gate.weight", SHAPE, std)


def test_tp_slices():
    n = "x"
    assert W.shard_slice(n, (64, 64), (64, 64), 1, 2) is None  # replicated (row-parallel bias, norms)
    assert W.shard_slice(n, (64, 192), (64, 96), 1, 2) == (1, 96, 192)  # column-parallel
    assert W.shard_slice(n, (256, 64), (128, 64), 0, 2) == (0, 0, 128)  # row-parallel
    assert W.shard_slice(n, (1024, 64), (256, 64), 3, 4) == (0, 768, 1024)  # vocabulary-parallel
    with pytest.raises(RuntimeError, match=r"parameter 'x' has shape \[64, 32\]: not the full shape \[64, 128\] nor a 1/2 TP shard"):
        W.shard_slice(n, (64, 128), (64, 32), 0, 2)
    with pytest.raises(RuntimeError, match="nor a 1/2 TP shard"):
        W.shard_slice(n, (64, 64), (32, 32), 0, 2)


# ------------------------------------------------------------------ built models (paddle)

SETTINGS = f"""
import json, os, sys, time
sys.path[:0] = [{str(ROOT)!r}]
import numpy as np, paddle, yaml
from training import shapes
from cases.gpt3.paddle import model as gpt3_model, weights as gpt3_weights
from cases.gpt3.paddle.settings import from_config
case = shapes.complete(yaml.safe_load(open({str(CASE_DIR / "case.yaml")!r})))
m = case["models"]["gpt3_tiny"]

def settings(world=1, seed=42, **par):
    train = {{**case["standard"]["train"], **m["train"], "micro_batch": 1, "seed": seed}}
    return from_config({{"case": {{"model": "gpt3_tiny"}}, "model": {{"params_nominal": m["params_nominal"], **m["shape"]}}, "train": train,
                         "parallel": {{**case["standard"]["parallel"], **par}}, "vendor": {{"device": "cpu"}}}}, world)

def build(s, tp_rank=0, build_seed=0):
    paddle.seed(build_seed)  # what the model draws while it is built, overwritten below
    model = gpt3_model.build_model(s, gpt3_model.gpt_config(s, s.layout.tp, tp_rank, False))
    n = gpt3_weights.init_weights(model, s, tp_rank)
    return model, n

def weights(model, s):
    prefixes = model.get_sequential_name_prefixes() if s.layout.pp > 1 else None
    return {{gpt3_weights.layout_free_name(k, prefixes): p.numpy() for k, p in model.named_parameters()}}
"""


def _paddle_python() -> str:
    return framework_python("FB_TEST_PADDLE_PYTHON", "no paddle environment to build the model in")


def _run_script(py: str, body: str, *args: str) -> dict:
    res = subprocess.run([py, "-c", SETTINGS + textwrap.dedent(body), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.framework("paddle")
def test_one_process_weights():
    """Whatever the construction-time seed: the same weights; the rules hold; the fused QKV
    model is the unfused one; the generator's state is left as it was; another seed differs."""
    got = _run_script(
        _paddle_python(),
        """
        s = settings()
        a, n = build(s, build_seed=1)
        b, _ = build(s, build_seed=2)
        wa, wb = weights(a, s), weights(b, s)
        out = {"tensors": n, "same": all(np.array_equal(wa[k], wb[k]) for k in wa)}
        paddle.seed(5); before = paddle.rand([8]).numpy()
        paddle.seed(5); t0 = time.perf_counter(); gpt3_weights.init_weights(a, s, 0); out["init_s"] = time.perf_counter() - t0
        out["state_kept"] = bool(np.array_equal(before, paddle.rand([8]).numpy()))
        out["other_seed_differs"] = not np.array_equal(weights(build(settings(seed=43))[0], s)["gpt.decoder.layers.0.linear1.weight"],
                                                       wa["gpt.decoder.layers.0.linear1.weight"])
        out["std"] = {k: float(v.std()) for k, v in wa.items()}
        out["mean"] = {k: float(v.mean()) for k, v in wa.items()}
        sf = settings(fuse_attention_qkv=True)
        f, nf = build(sf, build_seed=3)
        wf = weights(f, sf)
        qkv = np.stack([wa[f"gpt.decoder.layers.2.self_attn.{p}_proj.weight"].reshape(64, 4, 16) for p in "qkv"], axis=2)
        out["fused_tensors"] = nf
        out["fused_is_interleaved"] = bool(np.array_equal(qkv.reshape(64, 192), wf["gpt.decoder.layers.2.self_attn.qkv_proj.weight"]))
        x = paddle.to_tensor(np.arange(256).reshape(2, 128) * 7 % 1024)
        out["loss"] = float(a(x, labels=x)[0]); out["loss_fused"] = float(f(x, labels=x)[0])
        print("RESULT", json.dumps(out))
        """,
    )
    assert got["tensors"] == 68 and got["fused_tensors"] == 52  # 16 per layer (fused: 12), 2 tables, final norm
    assert got["same"] and got["state_kept"] and got["other_seed_differs"]
    std, mean = got["std"], got["mean"]
    scaled = 0.02 / math.sqrt(8)
    for name, sd in std.items():
        if name.endswith(("out_proj.weight", "linear2.weight")):
            assert sd == pytest.approx(scaled, rel=0.05), name
        elif name.endswith("weight") and "norm" not in name:
            assert sd == pytest.approx(0.02, rel=0.05), name
        else:  # biases zero, LayerNorm weight one and bias zero
            assert sd == 0 and mean[name] == (1.0 if name.endswith("weight") else 0.0), name
    assert got["fused_is_interleaved"]
    assert got["loss_fused"] == pytest.approx(got["loss"], rel=1e-6)
    print(f"init_weights of gpt3_tiny, one CPU process: {got['init_s'] * 1e3:.1f} ms")


PROBE = """
import paddle.distributed as dist
from paddle.distributed import fleet

out_dir, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.ParallelEnv._device_id = 0  # paddle's CPU build never sets it and PipelineLayer reads it
strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": tp, "pp_degree": pp, "sharding_degree": 1}
strategy.pipeline_configs = {"accumulate_steps": 16, "micro_batch_size": 1}
fleet.init(is_collective=True, strategy=strategy)
hcg = fleet.get_hybrid_communicate_group()
tp_rank, stage, rank = hcg.get_model_parallel_rank(), hcg.get_stage_id(), dist.get_rank()
layouts = {f"tp{tp}pp{pp}": settings(tp * pp, tp=tp, pp=pp)}
if tp > 1:
    layouts[f"tp{tp}pp{pp}_fused_qkv"] = settings(tp * pp, tp=tp, pp=pp, fuse_attention_qkv=True)
for name, s in layouts.items():
    model, _ = build(s, tp_rank, build_seed=1000 + rank)  # each rank builds from another seed
    np.savez(os.path.join(out_dir, f"{name}.tp{tp_rank}.pp{stage}.npz"), **weights(model, s))
if rank == 0:
    s = settings()
    np.savez(os.path.join(out_dir, "single.npz"), **weights(build(s)[0], s))
    s = settings(fuse_attention_qkv=True)
    np.savez(os.path.join(out_dir, "single_fused_qkv.npz"), **weights(build(s)[0], s))
dist.barrier()
sys.stdout.flush()
os._exit(0)  # past paddle's teardown, which can abort on the CPU (cases/gpt3/paddle/train.py)
"""


@pytest.fixture(scope="module")
def sharded_weights(tmp_path_factory):
    """Every rank's weights of the TP2 and of the PP2 model (two 2-process launches)."""
    py = _paddle_python()
    out = tmp_path_factory.mktemp("gpt3_layouts")
    probe = out / "probe.py"
    probe.write_text(SETTINGS + PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for tp, pp in ((2, 1), (1, 2)):
        logs = out / f"logs_tp{tp}pp{pp}"
        argv = [
            py,
            "-m",
            "paddle.distributed.launch",
            "--log_dir",
            str(logs),
            "--nproc_per_node",
            "2",
            str(probe),
            str(out),
            str(tp),
            str(pp),
        ]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        ranks = "".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("workerlog.*")))
        assert proc.returncode == 0, ranks
    return out


def _assemble(out: Path, layout: str) -> dict[str, np.ndarray]:
    """The full tensors of one layout: each stage's copy checked equal, TP shards concatenated
    along the one axis where they differ from the full shape."""
    single = dict(np.load(out / ("single_fused_qkv.npz" if "fused" in layout else "single.npz")))
    by_stage: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    for f in sorted(out.glob(f"{layout}.tp*.pp*.npz")):
        tp_rank, stage = (int(x[2:]) for x in f.name[len(layout) + 1 : -4].split("."))
        for name, value in np.load(f).items():
            by_stage.setdefault((name, stage), {})[tp_rank] = value
    full: dict[str, np.ndarray] = {}
    for (name, _stage), shards in sorted(by_stage.items()):
        parts = [shards[r] for r in sorted(shards)]
        axes = [a for a in range(parts[0].ndim) if parts[0].shape[a] != single[name].shape[a]]
        if axes:
            assert len(axes) == 1, f"{name}: shards {parts[0].shape} of {single[name].shape}"
            value = np.concatenate(parts, axis=axes[0])
        else:
            value = parts[0]
            assert all(np.array_equal(p, value) for p in parts), f"{name}: TP ranks hold different copies"
        assert name not in full or np.array_equal(full[name], value), f"{name}: stages hold different values"
        full[name] = value
    return full


@pytest.mark.framework("paddle")
@pytest.mark.parametrize("layout", ["tp2pp1", "tp2pp1_fused_qkv", "tp1pp2"])
def test_sharded_layouts_hold_the_single_process_model(sharded_weights, layout):
    single = dict(np.load(sharded_weights / ("single_fused_qkv.npz" if "fused" in layout else "single.npz")))
    full = _assemble(sharded_weights, layout)
    assert sorted(full) == sorted(single)
    for name, value in single.items():
        assert np.array_equal(full[name], value), name
    # the layouts really are sharded or staged
    files = sorted(p.name for p in sharded_weights.glob(f"{layout}.tp*.pp*.npz"))
    assert len(files) == 2, files
    if layout.startswith("tp2"):
        shard = np.load(sharded_weights / f"{layout}.tp1.pp0.npz")
        assert shard["gpt.embeddings.word_embeddings.weight"].shape == (512, 64)
    else:
        last = np.load(sharded_weights / f"{layout}.tp0.pp1.npz")
        assert "gpt.decoder.layers.3.linear1.weight" in last and "gpt.decoder.layers.0.linear1.weight" not in last
