"""gpt3_tiny on paddle, 1 and 2 CPU processes.

The layouts paddle's CPU build trains run through ``start_task.py`` as a user
runs them, once each (module fixtures): one process (config_cpux1x1), sharding
stage 1 over 2 ranks (config_cpux1x2, CI's case), plain data parallel over 2
ranks with full recompute (the DP2 variant). From the same starting weights
(cases/gpt3/paddle/weights.py) and the same sequences per step, their loss
curves agree within 0.5 % at every step, and with the committed reference.
Their rank logs are read with ``training.metriclog.parse_lines`` only. The
layouts the CPU build cannot run are started with ``paddle.distributed.launch``
and a hand-written ``resolved.json`` (docs/architecture.md), and pinned to the
errors docs/cases/gpt3.md quotes. The framework Python comes from
``FB_TEST_PADDLE_PYTHON`` (the conftest sets it when the cpu vendor's paddle
environment is built); without it the tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.case_helpers import framework_python
from training import shapes
from training.flops import decoder_flops
from training.metriclog import REQUIRED_META, ParsedLog, parse_lines

ROOT = Path(__file__).resolve().parent.parent
START = str(ROOT / "run_benchmarks" / "start_task.py")
CASE_DIR = ROOT / "cases" / "gpt3" / "paddle"
CASE = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))
TINY = CASE["models"]["gpt3_tiny"]
REFERENCE = json.loads((CASE_DIR / "reference" / "gpt3_tiny" / "standard.json").read_text())

pytestmark = pytest.mark.framework("paddle")


def _python() -> str:
    return framework_python("FB_TEST_PADDLE_PYTHON", "no paddle environment to run the case in")


def _rank_logs(directory: Path) -> ParsedLog:
    text = []
    for f in sorted(directory.rglob("workerlog.*")):
        text += f.read_text(errors="replace").splitlines()
    parsed = parse_lines(text, source=str(directory))
    assert not parsed.errors, parsed.errors[:3]
    return parsed


def start_task(log_dir: Path, nprocs: int, *extra: str) -> tuple[dict, ParsedLog, float]:
    """Run gpt3_tiny:paddle:cpu:1:<nprocs> through start_task.py; (its one round, rank logs, seconds)."""
    argv = [
        sys.executable,
        START,
        "--vendor",
        "cpu",
        "--case_name",
        f"gpt3_tiny:paddle:cpu:1:{nprocs}",
        "--python",
        _python(),
        "--log-dir",
        str(log_dir),
        *extra,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    (rnd,) = json.loads((run_dir / "results.json").read_text())["rounds"]
    # 30 steps, the reference's length: judged, and aligned with it
    assert rnd["status"] == "ok", rnd.get("error")
    return rnd, _rank_logs(run_dir / "round1"), seconds


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return start_task(tmp_path_factory.mktemp("gpt3_1"), 1)


@pytest.fixture(scope="module")
def sharding_stage1(tmp_path_factory):
    return start_task(tmp_path_factory.mktemp("gpt3_sh1"), 2)


@pytest.fixture(scope="module")
def data_parallel_recompute(tmp_path_factory):
    return start_task(tmp_path_factory.mktemp("gpt3_dp2"), 2, "--variant", "DP2", "--set", "parallel.recompute=full")


def _check_run(parsed: ParsedLog, nprocs: int, steps: int, layout: dict) -> list[float]:
    metas = parsed.of("meta", "run_meta")
    assert len(metas) == 1, "one reporting rank writes run_meta"
    meta = metas[0].value
    for key in REQUIRED_META:
        assert key in meta
    assert meta["model"] == "gpt3_tiny" and meta["framework"] == "paddle"
    assert meta["framework_version"].startswith("paddle 3.3.1, paddlenlp 2.8.1")
    assert meta["params_exact"] == decoder_flops(TINY)["params_exact"] == 273_792
    assert meta["params_nominal"] == TINY["params_nominal"] and meta["world_size"] == nprocs
    assert meta["precision"] == "fp32" and meta["global_batch"] == 16
    for k, v in layout.items():
        assert meta["parallel"][k] == v, (k, meta["parallel"])
    assert meta["parallel"]["flash_attention"] is False  # no kernel on the CPU
    assert any("use_flash_attention" in x for x in meta["inert_options"])
    # the kernel ceiling its ranks timed before training (cases/gpt3/paddle/ceiling.py), the model's own attention
    c, par = meta["kernel_ceiling"], meta["parallel"]
    assert (c["tp"], c["micro_batch"], c["device"], c["dtype"], c["layers"]) == (par["tp"], par["micro_batch"], "cpu", "float32", 4)
    assert c["attention"].startswith("core attention") and c["tokens_per_gpu_s"] > 0

    inits = parsed.of("info", "init_weights")
    assert sorted(r.rank for r in inits) == list(range(nprocs))
    assert all(r.value["tensors"] == 68 and r.value["seconds"] > 0 for r in inits)

    recs = parsed.of("step", "train_step")
    assert [r.value["step"] for r in recs] == list(range(1, steps + 1))
    assert {r.rank for r in recs} == {metas[0].rank}
    for r in recs:
        v = r.value
        assert v["tokens"] == 16 * 128 and v["lr"] > 0
        # training/steptimer.py: the batch fetch is timed inside the step
        assert 0 < v["data_s"] <= v["step_time_s"], v
    mem = parsed.of("memory", "peak_memory")
    assert sorted(r.rank for r in mem) == list(range(nprocs))
    assert all(r.value["device"] == "cpu" and r.value["peak_bytes"] > 0 for r in mem)
    ends = parsed.of("end", "run_end")
    assert [e.value for e in ends] == [{"status": "ok", "steps": steps}]
    return [r.value["loss"] for r in recs]


def test_one_process(one_process):
    rnd, parsed, seconds = one_process
    losses = _check_run(parsed, 1, 30, {"tp": 1, "pp": 1, "dp": 1, "sharding_stage": 0, "micro_batch": 8, "grad_accum": 2})
    assert losses[0] > 6.5 and losses[-1] < losses[0] - 2.0  # ln(1024) = 6.93 down to below 4
    # results.json's phase: the ceiling from run_meta, and the run's tokens/p/s over it
    (phase,) = rnd["phases"]
    ceiling = phase["meta"]["kernel_ceiling"]["tokens_per_gpu_s"]
    assert phase["ceiling_tokens_per_gpu_s"] == ceiling > 0
    assert phase["ceiling_efficiency"] == pytest.approx(phase["tokens_per_gpu_s"] / ceiling)
    print(f"1 process: {seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def test_two_processes_sharding_stage1(sharding_stage1):
    """The reference layout (config_cpux1x2): fleet's sharding stage 1 over 2 gloo ranks."""
    rnd, parsed, seconds = sharding_stage1
    layout = {"dp": 2, "dp_degree": 1, "sharding_stage": 1, "sharding_degree": 2, "micro_batch": 4, "grad_accum": 2}
    losses = _check_run(parsed, 2, 30, layout)
    assert losses[-1] < losses[0] - 2.0
    print(f"2 processes, sharding stage 1: {seconds:.1f} s")


def test_two_processes_data_parallel_with_recompute(data_parallel_recompute):
    """Plain DataParallel over 2 ranks (no_sync during accumulation), full recompute."""
    rnd, parsed, seconds = data_parallel_recompute
    _check_run(parsed, 2, 30, {"dp": 2, "dp_degree": 2, "sharding_degree": 1, "grad_accum": 2, "recompute": "full"})
    print(f"2 processes, DP2 + recompute: {seconds:.1f} s")


def test_layouts_give_one_curve(one_process, sharding_stage1, data_parallel_recompute):
    """Same starting weights, same sequences per step: within 0.5 % at every step, of each
    other and of the committed reference."""
    curves = {
        name: [r.value["loss"] for r in run[1].of("step", "train_step")]
        for name, run in (("1 process", one_process), ("sharding stage 1", sharding_stage1), ("DP2 + recompute", data_parallel_recompute))
    }
    curves["reference"] = REFERENCE["loss"]
    base = curves["1 process"]
    for name, curve in curves.items():
        assert len(curve) == len(base) == 30, name
        worst = max(abs(a - b) / b for a, b in zip(curve, base))
        assert worst < 0.005, f"{name}: {worst:.2%} off the one-process curve"


# ------------------------------------------------------------------ layouts the CPU cannot run


def resolved(tmp: Path, nprocs: int, train: dict | None = None, parallel: dict | None = None) -> dict:
    """A resolved.json as the harness writes it for gpt3_tiny:paddle:cpu:1:<nprocs>."""
    t = {**CASE["standard"]["train"], **TINY["train"], **(train or {})}
    p = {**CASE["standard"]["parallel"], **(parallel or {})}
    return {
        "run_id": f"test_gpt3_tiny_{nprocs}",
        "round": 1,
        "case": {"model": "gpt3_tiny", "framework": "paddle", "hardware": "cpu", "nnodes": 1, "nprocs": nprocs},
        "config_name": f"config_cpux1x{nprocs}",
        "model": {"name": "gpt3_tiny", "params_nominal": TINY["params_nominal"], **TINY["shape"]},
        "train": t,
        "parallel": p,
        "data": {"data_dir": None, "prefix": None, "cache_dir": str(tmp / "cache")},
        "vendor": {"name": "cpu", "device": "cpu", "dist_backend": "gloo", "adapters": {}},
        "output_dir": str(tmp / "out"),
    }


def launch(tmp: Path, cfg: dict, timeout: int = 600):
    """Run train.py under paddle's launcher; return (the process, the parsed rank logs)."""
    nprocs = cfg["case"]["nprocs"]
    cfg_path = tmp / "resolved.json"
    cfg_path.write_text(json.dumps(cfg))
    log_dir = tmp / "ranks"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "FB_RUN_ID": cfg["run_id"]}
    argv = [
        _python(),
        "-m",
        "paddle.distributed.launch",
        "--log_dir",
        str(log_dir),
        "--nproc_per_node",
        str(nprocs),
        str(CASE_DIR / "train.py"),
        "--config",
        str(cfg_path),
    ]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, _rank_logs(log_dir)


@pytest.mark.parametrize(
    "name,parallel,micro,expected",
    [
        ("SH2", {"sharding_stage": 2, "sharding_degree": 2}, 4, "group_sharded_parallel only support gpu, xpu and custom_device now"),
        ("TP2", {"tp": 2}, 8, "Only support xpu, gpu and custom_device now, but this is cpu"),
        ("PP2", {"pp": 2}, 8, "'ParallelEnv' object has no attribute '_device_id'"),
    ],
)
def test_layouts_paddle_cpu_cannot_run(tmp_path, name, parallel, micro, expected):
    """Pinned so that docs/cases/gpt3.md stays true when paddle changes."""
    cfg = resolved(tmp_path, 2, train={"micro_batch": micro, "steps": 2}, parallel=parallel)
    proc, parsed = launch(tmp_path, cfg, timeout=300)
    assert proc.returncode != 0
    errors = [r.value["message"] for r in parsed.of("error", "run_error")]
    assert errors and all(expected in m for m in errors), errors[:1]
    assert {e.value["status"] for e in parsed.of("end", "run_end")} == {"failed"}
