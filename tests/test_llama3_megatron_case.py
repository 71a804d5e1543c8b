"""The llama3/megatron case: settings, shapes, vendor configs, and real CPU runs.

One process, DP2, TP2 and PP2 run once each through start_task.py as a user runs them
(30 steps, judged against the committed curves), and give one loss curve. The other
runs start ``cases/llama3/megatron/train.py`` exactly as the harness does
(``python -m torch.distributed.run ... train.py --config resolved.json`` from
the repository root with it on PYTHONPATH), with a resolved.json written by
this test, in the framework environment named by FB_TEST_MEGATRON_PYTHON.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.case_helpers import framework_python, free_port
from training import flops, shapes
from training.metriclog import REQUIRED_META, ParsedLog, parse_file, parse_lines

ROOT = Path(__file__).resolve().parent.parent
CASE_DIR = ROOT / "cases" / "llama3" / "megatron"
REFERENCE = CASE_DIR / "reference" / "llama3_tiny"
START = str(ROOT / "run_benchmarks" / "start_task.py")

TINY_SHAPE = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 224,
    "num_heads": 4,
    "num_kv_groups": 2,
    "seq_length": 128,
    "vocab_size": 1024,
    "norm_eps": 1e-5,
    "rope_base": 500000,
}


def _settings_module():
    return importlib.import_module("cases.llama3.megatron.settings")


def resolved_config(tmp_path: Path, nprocs: int, config_name: str, parallel: dict | None = None, **train) -> dict:
    """A resolved.json as the harness writes it (docs/architecture.md) for llama3_tiny on the cpu vendor."""
    return {
        "run_id": f"test-{config_name}",
        "round": 1,
        "case": {"model": "llama3_tiny", "framework": "megatron", "hardware": "cpu", "nnodes": 1, "nprocs": nprocs},
        "config_name": config_name,
        "model": {"name": "llama3_tiny", "params_nominal": 2.4e5, **TINY_SHAPE},
        "train": {
            "steps": 30,
            "warmup_steps": 5,
            "global_batch": 8,
            "micro_batch": 1,
            "precision": "fp32",
            "lr": 3.0e-3,
            "min_lr": 3.0e-4,
            "lr_warmup_steps": 0,
            "weight_decay": 0.1,
            "clip_grad": 1.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "init_std": 0.02,
            "seed": 1234,
            **train,
        },
        "parallel": {"tp": 1, "pp": 1, "recompute": "none", "attention": "sdpa", "distributed_optimizer": True, **(parallel or {})},
        "data": {"data_dir": None, "cache_dir": str(tmp_path / "cache")},
        "vendor": {
            "name": "cpu",
            "device": "cpu",
            "dist_backend": "gloo",
            "adapters": {"megatron": "vendors.cpu.adapters.megatron:install"},
        },
        "output_dir": str(tmp_path / "output"),
    }


# ---------------------------------------------------------------- settings (no framework)


def test_layout_is_derived_and_checked():
    st = _settings_module()
    lay = st.derive_layout({"tp": 2, "pp": 2}, micro_batch=1, global_batch=512, world_size=8)
    assert (lay.dp, lay.grad_accum) == (2, 256)
    lay = st.derive_layout({"tp": 1, "pp": 2}, micro_batch=2, global_batch=512, world_size=8)
    assert (lay.dp, lay.grad_accum) == (4, 64)
    with pytest.raises(st.SettingsError, match="global batch 8 is not a multiple of micro batch 3 x data-parallel size 2"):
        st.derive_layout({"tp": 1, "pp": 1}, micro_batch=3, global_batch=8, world_size=2)
    with pytest.raises(st.SettingsError, match="tp=4 x pp=1 does not divide the world size 6"):
        st.derive_layout({"tp": 4, "pp": 1}, micro_batch=1, global_batch=8, world_size=6)
    with pytest.raises(st.SettingsError, match="parallel.dp = 3"):
        st.derive_layout({"tp": 2, "dp": 3}, micro_batch=1, global_batch=8, world_size=4)


def test_settings_from_resolved_config(tmp_path):
    st = _settings_module()
    cfg = resolved_config(tmp_path, 2, "config_cpux1x2", parallel={"tp": 2})
    s = st.from_config(cfg, world_size=2)
    assert (s.layout.tp, s.layout.dp, s.layout.grad_accum) == (2, 1, 8)
    assert s.shape.num_kv_groups == 2 and s.common.train.lr_decay_steps == 30 and s.common.device == "cpu"
    bad = resolved_config(tmp_path, 2, "x", parallel={"tp": 8})
    with pytest.raises(st.SettingsError, match="tp"):
        st.from_config(bad, world_size=8)
    bad = resolved_config(tmp_path, 2, "x", parallel={"recompute": "sometimes"})
    with pytest.raises(st.SettingsError, match="parallel.recompute must be one of"):
        st.from_config(bad, world_size=2)
    bad = resolved_config(tmp_path, 2, "x")
    bad["train"]["profile_step"] = 31
    with pytest.raises(st.SettingsError, match="train.profile_step = 31 is beyond the run's 30 steps"):
        st.from_config(bad, world_size=2)


def test_case_yaml_models():
    yaml = pytest.importorskip("yaml")
    raw = yaml.safe_load((CASE_DIR / "case.yaml").read_text())
    # the family's flag stated once; each model block its sizes only
    assert raw["shape_defaults"] == {"rope_base": 500000}
    sizes = {"num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_groups", "seq_length", "vocab_size"}
    assert {m: set(e["shape"]) for m, e in raw["models"].items()} == {"llama3_8b": sizes, "llama3_tiny": sizes}
    case = shapes.complete(raw)
    assert (case["family"], case["framework"], case["launcher"], case["entry"]) == ("llama3", "megatron", "torchrun", "train.py")
    big = case["models"]["llama3_8b"]
    whole = shapes.ModelShape(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_heads=32,
        num_kv_groups=8,
        seq_length=8192,
        vocab_size=128256,
        rope_base=500000,
    ).as_dict()
    assert big["shape"] == whole
    assert (whole["norm_eps"], whole["norm"], whole["hidden_act"], whole["gated_mlp"], whole["bias"]) == (
        1e-5,
        "rmsnorm",
        "silu",
        True,
        False,
    )
    assert big["params_nominal"] == 8.0e9 and big["train"]["global_batch"] == 512
    assert big["train"]["lr_decay_steps"] == 300  # FlagPerf decays the cosine over 300 steps
    std = case["standard"]["train"]
    assert (std["lr"], std["min_lr"], std["weight_decay"], std["clip_grad"]) == (1e-5, 1e-6, 0.1, 1.0)
    assert (std["adam_beta1"], std["adam_beta2"], std["init_std"], std["precision"]) == (0.9, 0.95, 0.008, "bf16")
    counts = flops.decoder_flops(big)
    assert counts["params_exact"] == 8_030_261_248
    assert flops.decoder_flops(case["models"]["llama3_tiny"])["params_exact"] == 241_984
    tiny = case["models"]["llama3_tiny"]["shape"]
    assert {k: tiny[k] for k in TINY_SHAPE} == TINY_SHAPE


def test_vendor_configs_change_only_allowed_keys():
    yaml = pytest.importorskip("yaml")
    allowed = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))["vendor_may_change"]
    files = sorted((ROOT / "vendors" / "nvidia" / "cases" / "llama3_8b" / "megatron").glob("config_*.yaml"))
    files += sorted((ROOT / "vendors" / "cpu" / "cases" / "llama3_tiny" / "megatron").glob("config_*.yaml"))
    names = {f.stem for f in files}
    for n in (
        "config_A100x1x8",
        "config_A100x1x8_PP4DP2TP1",
        "config_A100x1x8_PP1DP8TP1",
        "config_A100x1x8_PP2DP2TP2",
        "config_A100x1x8_PP2DP1TP4",
        "config_A100x1x8_PP8DP1TP1",
        "config_A100x1x8_PP1DP1TP8",
        "config_A100x1x8_PP4DP1TP2",
        "config_H100x1x8",
        "config_H100x2x8",
        "config_cpux1x1",
        "config_cpux1x2",
        "config_cpux1x2_TP2",
        "config_cpux1x2_PP2",
        "config_H200x1x2",
        "config_H200x1x4",
        "config_H200x1x4_PP1DP1TP4",
        "config_H200x1x4_PP2DP2TP1",
    ):
        assert n in names
    for f in files:
        cfg = yaml.safe_load(f.read_text())
        for section in ("train", "parallel"):
            for key in cfg.get(section, {}):
                assert f"{section}.{key}" in allowed, f"{f.name}: {section}.{key} may not be changed by a vendor"
        assert set(cfg) <= {"description", "validated", "validated_by", "hook", "train", "parallel"}, f.name
        size, _, variant = f.stem[len("config_") :].partition("_")
        gpus = int(size.split("x")[-2]) * int(size.split("x")[-1])
        if m := re.fullmatch(r"PP(\d+)DP(\d+)TP(\d+)", variant):  # the variant names its layout
            pp, dp, tp = (int(x) for x in m.groups())
            assert (cfg["parallel"]["tp"], cfg["parallel"]["pp"], pp * dp * tp) == (tp, pp, gpus), f.name
        elif m := re.fullmatch(r"(TP|PP)(\d+)", variant):  # or its one parallel degree
            assert cfg["parallel"][m.group(1).lower()] == int(m.group(2)), f.name


# ---------------------------------------------------------------- real runs


def run_case_script(tmp_path: Path, cfg: dict, nprocs: int, script: str = "train.py", *args: str) -> subprocess.CompletedProcess:
    """``script`` of the case on ``nprocs`` local ranks, as the harness starts train.py."""
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    path = tmp_path / "resolved.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", FB_RUN_ID=cfg["run_id"])
    cmd = [
        py,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nprocs),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        f"cases/llama3/megatron/{script}",
        "--config",
        str(path),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


#: the CPU layouts, each run once through start_task.py: (processes, --variant); one reference
#: (the standard recipe's, made by one process) judges them all
LAYOUTS = {
    "1": (1, None),
    "DP2": (2, None),
    "TP2": (2, "TP2"),
    "PP2": (2, "PP2"),
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, megatron_python, llama3_dp2_run) -> dict[str, tuple[dict, ParsedLog]]:
    """Each of LAYOUTS through start_task.py (30 steps, judged): its results.json and rank logs.
    DP2, the size's committed config as it is, is the session's run (conftest.llama3_dp2_run)."""
    runs = {}
    for name, (nprocs, variant) in LAYOUTS.items():
        if name == "DP2":
            proc, run_dir = llama3_dp2_run
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        else:
            log_dir = tmp_path_factory.mktemp(f"llama3_{name}")
            proc = subprocess.run(
                [
                    sys.executable,
                    START,
                    "--vendor",
                    "cpu",
                    "--case_name",
                    f"llama3_tiny:megatron:cpu:1:{nprocs}",
                    "--log-dir",
                    str(log_dir),
                    *(["--variant", variant] if variant else []),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
            (run_dir,) = [d for d in log_dir.iterdir() if d.is_dir()]
        parsed = ParsedLog([], [])
        for f in sorted((run_dir / "round1" / "node0" / "ranks").rglob("stdout.log")):
            parsed.extend(parse_file(f))
        runs[name] = (json.loads((run_dir / "results.json").read_text()), parsed)
    return runs


@pytest.mark.framework("megatron")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cpu_layout_through_start_task(layout_runs, name):
    nprocs, _ = LAYOUTS[name]
    res, log = layout_runs[name]
    assert not log.errors, log.errors[:3]
    (rnd,) = res["rounds"]
    (phase,) = rnd["phases"]
    assert rnd["status"] == "ok", rnd["error"]
    assert phase["reference"]["path"] == "cases/llama3/megatron/reference/llama3_tiny/standard.json"
    assert phase["gate"]["verdict"] == "aligned" and res["recipe"] == "standard"
    # every layout starts from the same weights (startweights.py): the curves agree closely
    assert phase["gate"]["verdict"] == "aligned" and phase["gate"]["mre"] < 0.005, phase["gate"]

    (meta,) = log.of("meta", "run_meta")
    m = meta.value
    assert all(k in m for k in REQUIRED_META)
    tp, pp = (2 if name == "TP2" else 1), (2 if name == "PP2" else 1)
    dp = nprocs // (tp * pp)
    assert (m["parallel"]["tp"], m["parallel"]["pp"], m["parallel"]["dp"]) == (tp, pp, dp)
    assert m["parallel"]["grad_accum"] == 8 // dp and m["parallel"]["micro_batch"] == 1
    shape = shapes.ModelShape(**TINY_SHAPE)
    assert m["params_exact"] == flops.param_counts(shape)["total"] == 241_984
    assert m["params_nominal"] == 2.4e5 and m["framework"] == "megatron" and m["framework_version"]
    assert m["world_size"] == nprocs and m["global_batch"] == 8 and m["precision"] == "fp32"
    assert meta.rank == (1 if pp == 2 else 0)  # the reporting rank: last stage, first tensor and data rank
    # one start_weights record per pipeline stage; every weight but the 5 norms' 320 drawn whole, once
    starts = log.of("info", "start_weights")
    assert sorted(r.value["pp_rank"] for r in starts) == list(range(pp))
    assert sum(r.value["drawn"] for r in starts) == 241_984 - 320

    steps = log.of("step", "train_step")
    assert [r.value["step"] for r in steps] == list(range(1, 31))
    assert {r.rank for r in steps} == {meta.rank}
    loss = [r.value["loss"] for r in steps]
    assert abs(loss[0] - 6.93) < 0.1  # ln(1024): an untrained model
    assert sum(loss[-5:]) / 5 < loss[0] - 2.0, loss  # the loss falls clearly
    assert all(r.value["tokens"] == 8 * 128 for r in steps)
    assert all(0 < r.value["data_s"] <= r.value["step_time_s"] for r in steps)  # training/steptimer.py
    lrs = [r.value["lr"] for r in steps]
    assert lrs[0] == pytest.approx(3e-3) and all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 3e-4

    mem = log.of("memory", "peak_memory")
    assert sorted(r.rank for r in mem) == list(range(nprocs))
    assert all(r.value["peak_bytes"] > 0 and r.value["total_bytes"] is None for r in mem)
    (end,) = log.of("end", "run_end")
    assert end.value == {"status": "ok", "steps": 30}


@pytest.mark.framework("megatron")
def test_cpu_layouts_train_alike(layout_runs):
    """One process, DP2, TP2 and PP2: the same loss at every step, within 0.5 % (measured: 1e-6)."""
    curves = {name: [r.value["loss"] for r in log.of("step", "train_step")] for name, (_, log) in layout_runs.items()}
    base = curves["1"]
    for name, loss in curves.items():
        assert max(abs(a - b) / b for a, b in zip(loss, base)) < 0.005, (name, loss, base)


def test_one_reference_for_every_layout():
    """llama3_tiny has one reference per recipe (the attention recipe's named by its corpus too);
    no file per config."""
    names = sorted(p.name for p in REFERENCE.iterdir())
    assert names == ["attention.data-synthetic-v2-030cd93abbad.json", "standard.json"], names
    for name in names:
        ref = json.loads((REFERENCE / name).read_text())
        assert ref["recipe"] == name.split(".")[0] and ref["loss"][-1] < ref["loss"][0] - 2.0


@pytest.mark.framework("megatron")
def test_bad_layout_fails_with_error_record(tmp_path):
    cfg = resolved_config(tmp_path, 2, "bad", global_batch=6, micro_batch=4)
    proc = run_case_script(tmp_path, cfg, 2)
    assert proc.returncode != 0
    log = parse_lines((proc.stdout + proc.stderr).splitlines())
    errors = log.of("error", "run_error")
    assert errors and "global batch 6 is not a multiple of micro batch 4 x data-parallel size 2" in errors[0].value["message"]
    assert {r.value["status"] for r in log.of("end", "run_end")} == {"failed"}


@pytest.mark.framework("megatron")
def test_one_process_reads_data_dir_corpus(tmp_path):
    """data.data_dir + data.prefix: the case trains on a Megatron indexed dataset it did not write."""
    pytest.importorskip("numpy")
    from training.data import synthetic

    data_dir = tmp_path / "data"
    synthetic.write_corpus(str(data_dir / "tiny_corpus"), vocab_size=1024, num_tokens=40_000, seed=99)
    cfg = resolved_config(tmp_path, 1, "config_cpux1x1", steps=6)
    cfg["data"].update(data_dir=str(data_dir), prefix="tiny_corpus")
    proc = run_case_script(tmp_path, cfg, 1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    log = parse_lines(out.splitlines())
    (meta,) = log.of("meta", "run_meta")
    assert meta.value["data"] == f"indexed:{data_dir / 'tiny_corpus'}"
    assert meta.value["parallel"]["dp"] == 1 and meta.value["parallel"]["grad_accum"] == 8
    assert [r.value["step"] for r in log.of("step")] == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "cache").exists()  # no synthetic corpus written


@pytest.mark.framework("megatron")
def test_the_cpu_adapter_imports_megatron_with_its_jit_fuser_off(megatron_python):
    """The cpu vendor's adapter imports megatron-core with ``torch.compile`` standing in as the
    plain function: megatron's fused helpers are the functions themselves, torch.compile is
    torch's again afterwards, and neither dynamo nor inductor was imported for them."""
    snippet = """
import json, sys, torch
compile_ = torch.compile
from vendors.cpu.adapters import megatron as adapter
adapter.install({"vendor": {"device": "cpu"}})
import megatron.core.models.gpt
import megatron.core.jit as mjit
from megatron.core.fusions import fused_bias_swiglu, fused_cross_entropy
print(json.dumps({
    "compile_restored": torch.compile is compile_,
    "fuser": mjit.jit_fuser.__name__,
    "helpers": [type(f).__name__ for f in (fused_cross_entropy.calculate_logits_max, fused_bias_swiglu.swiglu)],
    "dynamo": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
}))
"""
    proc = subprocess.run(
        [megatron_python, "-c", snippet], capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"compile_restored": True, "fuser": "noop_decorator", "helpers": ["function", "function"], "dynamo": []}, got
