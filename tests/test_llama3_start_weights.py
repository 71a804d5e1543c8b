"""llama3 on megatron-core: every parallel layout starts from, and trains like, the TP1/PP1 model.

(a) The starting weights of a TP2 and of a PP2 run, joined back from their shards and
    stages (cases/llama3/megatron/weights_check.py, gloo ranks under torchrun), are
    bit-equal to those of one process; each parameter's spread follows megatron's own
    initialisation.
(b) Through start_task.py, one process, DP2, TP2 and PP2 give the same loss at every step
    (within 0.5 %), and every step record keeps to the timing rule of
    training/steptimer.py: ``0 < data_s <= step_time_s``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.case_helpers import framework_python
from tests.test_llama3_megatron_case import ROOT, resolved_config, run_case_script
from training.metriclog import parse_file

START = str(ROOT / "run_benchmarks" / "start_task.py")

#: name -> (processes, parallel layout)
LAYOUTS = {"TP1PP1": (1, {"tp": 1, "pp": 1}), "TP2": (2, {"tp": 2, "pp": 1}), "PP2": (2, {"tp": 1, "pp": 2})}

_STD_REPORT = """
import json, sys, torch
d = torch.load(sys.argv[1])
w, ref = d["weights"], d["megatron_std"]
print(json.dumps({n: {"shape": list(t.shape), "std": float(t.std()), "ones": bool((t == 1).all()),
                      "megatron_std": ref.get(n)} for n, t in w.items()}))
"""


@pytest.mark.framework("megatron")
def test_layouts_start_from_the_tp1_pp1_model(tmp_path):
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    files = []
    for name, (nprocs, parallel) in LAYOUTS.items():
        out = tmp_path / f"{name}.pt"
        cfg = resolved_config(tmp_path / name, nprocs, f"weights_{name}", parallel=parallel)
        extra = ["--megatron-std"] if nprocs == 1 else []
        proc = run_case_script(tmp_path / name, cfg, nprocs, "weights_check.py", "--out", str(out), *extra)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        files.append(str(out))

    cmp = subprocess.run([py, "cases/llama3/megatron/weights_check.py", "--compare", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert "15 tensors equal in 3 files" in cmp.stdout  # 2 layers x 6, embedding, final norm, output layer

    rep = subprocess.run([py, "-c", _STD_REPORT, files[0]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    params = json.loads(rep.stdout)
    assert params["decoder.layers.1.mlp.linear_fc1.weight"]["shape"] == [2 * 224, 64]
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"]["shape"] == [(4 + 2 * 2) * 16, 64]
    for name, p in params.items():
        if "layernorm" in name:
            assert p["ones"], name
            continue
        # megatron: N(0, 0.02) and, for linear_proj / linear_fc2, 0.02 / sqrt(2 * num_layers)
        expect = 0.01 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0.02
        assert p["std"] == pytest.approx(expect, rel=0.05), name
        assert p["megatron_std"] == pytest.approx(expect, rel=0.05), name


def _start(tmp_path: Path, nprocs: int, *extra: str) -> Path:
    proc = subprocess.run(
        [sys.executable, START, "--vendor", "cpu", "--case_name", f"llama3_tiny:megatron:cpu:1:{nprocs}",
         "--set", "train.steps=8", "--log-dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run_dir


@pytest.mark.framework("megatron")
def test_layouts_train_alike_and_time_the_batch_fetch(tmp_path):
    runs = {"1": (1, ()), "DP2": (2, ()), "TP2": (2, ("--variant", "TP2")), "PP2": (2, ("--variant", "PP2"))}
    curves = {}
    for name, (nprocs, extra) in runs.items():
        run_dir = _start(tmp_path / name, nprocs, *extra)
        res = json.loads((run_dir / "results.json").read_text())
        (rnd,) = res["rounds"]
        assert rnd["status"] == "ok", rnd["error"]
        loss = rnd["phases"][0]["loss"]
        curves[name] = [loss[str(k)] for k in range(1, 9)]

        rank_logs = sorted((run_dir / "round1" / "node0" / "ranks").rglob("stdout.log"))
        assert len(rank_logs) == nprocs
        records = [r for f in rank_logs for r in parse_file(f).of("step", "train_step")]
        assert [r.value["step"] for r in records] == list(range(1, 9))
        for r in records:
            v = r.value
            assert 0 < v["data_s"] <= v["step_time_s"], (name, v)

    base = curves["1"]
    assert abs(base[0] - 6.93) < 0.1 and base[-1] < base[0] - 0.5, base  # untrained at first, then learning
    for name, loss in curves.items():
        worst = max(abs(a - b) / b for a, b in zip(loss, base))
        assert worst < 0.005, (name, loss, base)
