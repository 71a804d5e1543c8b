"""gpt3_tiny on paddle, 1 and 2 CPU processes, through ``paddle.distributed.launch``.

The framework Python comes from ``FB_TEST_PADDLE_PYTHON`` (the conftest sets it
when the cpu vendor's paddle environment is built); without it the tests skip.
``train.py`` is started the way the harness starts it, with a hand-written
``resolved.json`` (docs/architecture.md), and its per-rank logs are read with
``training.metriclog.parse_lines`` only.  The layouts paddle's CPU build cannot
run are pinned to the errors docs/cases/gpt3.md quotes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.case_helpers import framework_python
from training.flops import decoder_flops
from training.metriclog import REQUIRED_META, parse_lines

ROOT = Path(__file__).resolve().parent.parent
CASE_DIR = ROOT / "cases" / "gpt3" / "paddle"
CASE = yaml.safe_load((CASE_DIR / "case.yaml").read_text())
TINY = CASE["models"]["gpt3_tiny"]
REFERENCE = json.loads((CASE_DIR / "reference" / "gpt3_tiny" / "config_cpux1x2.json").read_text())

pytestmark = pytest.mark.framework("paddle")


def _python() -> str:
    return framework_python("FB_TEST_PADDLE_PYTHON", "no paddle environment to run the case in")


def resolved(tmp: Path, nprocs: int, train: dict | None = None, parallel: dict | None = None) -> dict:
    """A resolved.json as the harness writes it for gpt3_tiny:paddle:cpu:1:<nprocs>."""
    t = {**CASE["standard"]["train"], **TINY["train"], **(train or {})}
    p = {**CASE["standard"]["parallel"], **(parallel or {})}
    return {
        "run_id": f"test_gpt3_tiny_{nprocs}", "round": 1,
        "case": {"model": "gpt3_tiny", "framework": "paddle", "hardware": "cpu", "nnodes": 1, "nprocs": nprocs},
        "config_name": f"config_cpux1x{nprocs}",
        "model": {"name": "gpt3_tiny", "params_nominal": TINY["params_nominal"], **TINY["shape"]},
        "train": t,
        "parallel": p,
        "data": {"data_dir": None, "prefix": None, "cache_dir": str(tmp / "cache")},
        "vendor": {"name": "cpu", "device": "cpu", "dist_backend": "gloo", "adapters": {}},
        "output_dir": str(tmp / "out"),
    }  # fmt: skip


def launch(tmp: Path, cfg: dict, timeout: int = 600):
    """Run train.py under paddle's launcher; return (returncode, parsed log, seconds)."""
    nprocs = cfg["case"]["nprocs"]
    cfg_path = tmp / "resolved.json"
    cfg_path.write_text(json.dumps(cfg))
    log_dir = tmp / "ranks"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "FB_RUN_ID": cfg["run_id"]}
    argv = [_python(), "-m", "paddle.distributed.launch", "--log_dir", str(log_dir), "--nproc_per_node", str(nprocs),
            str(CASE_DIR / "train.py"), "--config", str(cfg_path)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    text = []
    for f in sorted(log_dir.glob("workerlog.*")):
        text += f.read_text(errors="replace").splitlines()
    parsed = parse_lines(text, source=str(log_dir))
    assert not parsed.errors, parsed.errors[:3]
    return proc, parsed, seconds


def _check_run(parsed, nprocs: int, steps: int, layout: dict) -> list[float]:
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

    recs = parsed.of("step", "train_step")
    assert [r.value["step"] for r in recs] == list(range(1, steps + 1))
    assert {r.rank for r in recs} == {metas[0].rank}
    for r in recs:
        assert r.value["tokens"] == 16 * 128 and r.value["step_time_s"] > 0 and r.value["lr"] > 0
    losses = [r.value["loss"] for r in recs]
    mem = parsed.of("memory", "peak_memory")
    assert sorted(r.rank for r in mem) == list(range(nprocs))
    assert all(r.value["device"] == "cpu" and r.value["peak_bytes"] > 0 for r in mem)
    ends = parsed.of("end", "run_end")
    assert [e.value for e in ends] == [{"status": "ok", "steps": steps}]
    return losses


def _aligned(losses: list[float]) -> float:
    """Mean relative error against the reference from step 21 on (the harness's rule)."""
    ref = REFERENCE["loss"]
    pairs = [(a, b) for s, a, b in zip(range(1, len(losses) + 1), losses, ref) if s >= 21]
    return sum(abs(a - b) / b for a, b in pairs) / len(pairs)


def test_one_process(tmp_path):
    proc, parsed, seconds = launch(tmp_path, resolved(tmp_path, 1, train={"micro_batch": 8}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _check_run(parsed, 1, 30, {"tp": 1, "pp": 1, "dp": 1, "sharding_stage": 0, "micro_batch": 8, "grad_accum": 2})
    assert losses[0] > 6.5 and losses[-1] < losses[0] - 2.0  # ln(1024) = 6.93 down to below 4
    assert _aligned(losses) < 0.02
    print(f"1 process: {seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def test_two_processes_sharding_stage1(tmp_path):
    """The reference layout (config_cpux1x2): fleet's sharding stage 1 over 2 gloo ranks."""
    cfg = resolved(tmp_path, 2, train={"micro_batch": 4}, parallel={"sharding_stage": 1, "sharding_degree": 2})
    proc, parsed, seconds = launch(tmp_path, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    layout = {"dp": 2, "dp_degree": 1, "sharding_stage": 1, "sharding_degree": 2, "micro_batch": 4, "grad_accum": 2}
    losses = _check_run(parsed, 2, 30, layout)
    assert losses[-1] < losses[0] - 2.0
    assert _aligned(losses) < 0.02
    print(f"2 processes, sharding stage 1: {seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def test_two_processes_data_parallel_with_recompute(tmp_path):
    """Plain DataParallel over 2 ranks, micro-batch 1 (8 accumulation steps, no_sync),
    full recompute: the same sequences per step, so the same curve."""
    cfg = resolved(tmp_path, 2, train={"micro_batch": 1, "steps": 10}, parallel={"recompute": "full"})
    proc, parsed, seconds = launch(tmp_path, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _check_run(parsed, 2, 10, {"dp": 2, "dp_degree": 2, "sharding_degree": 1, "grad_accum": 8, "recompute": "full"})
    # lr decay over 30 steps as in the reference: the first 10 steps match it
    assert losses == pytest.approx(REFERENCE["loss"][:10], rel=1e-3)
    print(f"2 processes, DP2 + recompute: {seconds:.1f} s")


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
    proc, parsed, _ = launch(tmp_path, cfg, timeout=300)
    assert proc.returncode != 0
    errors = [r.value["message"] for r in parsed.of("error", "run_error")]
    assert errors and all(expected in m for m in errors), errors[:1]
    assert {e.value["status"] for e in parsed.of("end", "run_end")} == {"failed"}
