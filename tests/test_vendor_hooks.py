"""Vendor adapters and per-config hooks may adapt the runtime, never the settings."""

import json
import os
import subprocess
import sys

import pytest

from training import runtime


def _cfg(hooks):
    return {
        "case": {"framework": "megatron"},
        "train": {"lr": 1e-5, "global_batch": 512},
        "model": {"hidden_size": 4096},
        "vendor": {"adapters": {}, "hooks": hooks},
    }


@pytest.fixture
def hook_module(tmp_path, monkeypatch):
    (tmp_path / "acme_hooks.py").write_text(
        "import os\n"
        "def kernels(cfg):\n    os.environ['ACME_FAST_KERNELS'] = '1'\n"
        "def cheat(cfg):\n    cfg['train']['global_batch'] = 64\n"
        "def widen(cfg):\n    cfg['model']['hidden_size'] = 1024\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ACME_FAST_KERNELS", raising=False)
    yield
    sys.modules.pop("acme_hooks", None)


def test_a_runtime_hook_runs(hook_module):
    cfg = _cfg(["acme_hooks:kernels"])
    runtime.apply_adapter(cfg)
    assert os.environ["ACME_FAST_KERNELS"] == "1"


@pytest.mark.parametrize("hook, path", [("acme_hooks:cheat", "train.global_batch"), ("acme_hooks:widen", "model.hidden_size")])
def test_a_hook_changing_settings_is_refused(hook_module, hook, path):
    cfg = _cfg([hook])
    with pytest.raises(RuntimeError, match=f"vendor function {hook} changed '{path}'"):
        runtime.apply_adapter(cfg)
    assert cfg["train"]["global_batch"] == 512 and cfg["model"]["hidden_size"] == 4096


def test_hook_reaches_the_resolved_config(tmp_path):
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning.casename import CaseName
    from run_benchmarks.planning.config import ClusterConfig

    p = planning.build(CaseName.parse("llama3_tiny:megatron:cpu:1:2"), "cpu", ClusterConfig(), tmp_path)
    assert p.resolved(1, "o", "c")["vendor"]["hooks"] == []
    assert p.resolved(1, "o", "c")["vendor"]["adapters"]["megatron"] == "vendors.cpu.adapters.megatron:install"


@pytest.mark.framework("megatron")
def test_the_cpu_vendors_paced_hook_sleeps_after_each_optimizer_step(megatron_python):
    """vendors/cpu/pace.py, applied as a rank applies a config's hook: every optimizer step of
    the process is followed by its pause, the settings untouched; the paced config names it."""
    import yaml

    from run_benchmarks.planning.registry import ROOT, VENDORS_DIR

    doc = yaml.safe_load((VENDORS_DIR / "cpu/cases/llama3_tiny/megatron/config_cpux2x1_paced.yaml").read_text())
    base = yaml.safe_load((VENDORS_DIR / "cpu/cases/llama3_tiny/megatron/config_cpux2x1.yaml").read_text())
    assert doc["hook"] == "vendors.cpu.pace:half_second_steps" and not doc["validated"]
    assert {k: doc[k] for k in ("parallel", "train")} == {k: base[k] for k in ("parallel", "train")}  # the layout of config_cpux2x1
    script = """
import json, sys, time, torch
from training import runtime
from vendors.cpu import pace
cfg = {"case": {"framework": "megatron"}, "train": {"lr": 1e-3}, "vendor": {"adapters": {}, "hooks": [sys.argv[1]]}}
p = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.AdamW([p]); p.grad = torch.ones(4)
t = time.monotonic(); opt.step(); plain = time.monotonic() - t
runtime.apply_adapter(cfg)
took = []
for _ in range(2):
    t = time.monotonic(); opt.step(); took.append(time.monotonic() - t)
print(json.dumps({"plain": plain, "took": took, "pause": pace.PAUSE_S}))
"""
    out = subprocess.run([megatron_python, "-c", script, doc["hook"]], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["plain"] < res["pause"] and all(t >= res["pause"] for t in res["took"]), res
