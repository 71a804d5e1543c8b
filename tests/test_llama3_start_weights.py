"""llama3 on megatron-core: every parallel layout starts from the TP1/PP1 model.

The starting weights of a TP2 and of a PP2 run, joined back from their shards and stages
(cases/llama3/megatron/weights_check.py, gloo ranks under torchrun), are bit-equal to
those of one process, and each parameter's spread follows megatron's own initialisation.
That the layouts then train alike (one process, DP2, TP2 and PP2 through start_task.py)
is tests/test_llama3_megatron_case.py's.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.case_helpers import framework_python
from tests.test_llama3_megatron_case import ROOT, resolved_config, run_case_script

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

    cmp = subprocess.run(
        [py, "cases/llama3/megatron/weights_check.py", "--compare", *files], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
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


_TWO_FILES = """
import sys, torch
a = torch.linspace(-1, 1, 12).view(3, 4)
b = a.clone()
b[2, 1] = 0.5
torch.save({"weights": {"w": a, "n": torch.ones(4)}}, sys.argv[1])
torch.save({"weights": {"w": b, "n": torch.ones(4)}}, sys.argv[2])
"""


@pytest.mark.framework("megatron")
def test_compare_says_which_elements_differ_and_by_how_much(tmp_path):
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    subprocess.run([py, "-c", _TWO_FILES, a, b], check=True, timeout=300)
    cmp = subprocess.run(
        [py, "cases/llama3/megatron/weights_check.py", "--compare", a, b], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert cmp.returncode == 1, cmp.stdout + cmp.stderr
    assert (
        f"{b}: w differs in 1 of 12 elements (first at flat index 9; largest |difference| 0.136 at 9, 0.636363626 vs 0.5)" in cmp.stdout
    ), cmp.stdout
    assert " n " not in cmp.stdout
