"""A vendor known only from its vendor.yaml and its own plug-ins runs a case end to end.

In a copy of the repository, ``vendor_tools`` scaffolds vendor ``acme`` (chip X1) and its
config for llama3_tiny on megatron, 1 x 2; its vendor.yaml declares device cpu, dist_backend
gloo, its own visible-devices variable, a monitor and a memory query as ``module:function`` of
a module the test writes into the vendor's folder (four made-up devices; made-up memory figures
and a device name), and the chip's ``device_names``. ``vendor_tools check`` passes it; then
start_task.py runs it with the variable set to two of the four devices, and results.json must
carry the plug-ins' figures: the ranks' memory and device name from the memory query, the
monitor's devices from the sampler, device memory over the two visible devices only, and the
variable's value as the ranks saw it (run_meta). The sampler also runs under the node side's
``python -m run_benchmarks.running.monitors`` (SSH and Slurm start it that way).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from run_benchmarks.planning import registry
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.tools import vendor_tools

COPIED = ("run_benchmarks", "training", "cases", "vendors", "setup.cfg", "pyproject.toml")
CASE = "llama3_tiny:megatron:X1:1:2"
VISIBLE = "ACME_VISIBLE_DEVICES"
GIB = 1 << 30

PLUGIN = '''\
"""Acme's plug-ins: the monitor's sampler and the ranks' memory query (made-up figures)."""

import os

GIB = 1 << 30


def sample():
    """Four devices; device i has 10 + i GiB in use of 64, draws 300 + i W."""
    return [
        {"index": i, "util_percent": 40.0 + i, "mem_used_gib": 10.0 + i, "mem_total_gib": 64.0, "power_w": 300.0 + i, "temp_c": 50.0}
        for i in range(4)
    ]


def memory(device):
    """Local rank r peaked at 3 + r GiB of a 48 GiB card named Acme X1."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    return (3 + rank) * GIB, 48 * GIB, f"Acme X1 (plug-in, {device.type})"
'''


def _repo_copy(dst: Path) -> Path:
    for name in COPIED:
        src = registry.ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "logs"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def _plugin_vendor(repo: Path) -> Path:
    """Vendor acme in ``repo``: scaffolded, then filled in as its engineer would; its folder."""
    vendors = repo / "vendors"
    written = vendor_tools.scaffold_vendor("acme", "X1", ["megatron"], vendors_dir=vendors)
    vendor_yaml = next(p for p in written if p.name == "vendor.yaml")
    vy = yaml.safe_load(vendor_yaml.read_text())
    vy.update(
        description="a vendor known only from this file and its plug-ins",
        device="cpu",
        dist_backend="gloo",
        visible_devices_env=VISIBLE,
        monitor="vendors.acme.plugin:sample",
        memory_query="vendors.acme.plugin:memory",
        env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        adapters={"megatron": "vendors.cpu.adapters.megatron:install"},  # megatron-core on CPU processes
    )
    vy["chips"]["X1"].update(device_names=["^Acme X1 "], memory_gib=48, source="made up for this test: no peak")
    vendor_yaml.write_text(yaml.safe_dump(vy, sort_keys=False))
    (vendor_yaml.parent / "plugin.py").write_text(PLUGIN)
    docker = next(p for p in written if p.name == "Dockerfile")
    docker.write_text(docker.read_text().replace(vendor_tools.PLACEHOLDER_IMAGE + "base-image:tag", "python:3.11-slim"))
    requirements = next(p for p in written if p.name == "requirements.txt")
    requirements.write_text((vendors / "cpu" / "megatron" / "requirements.txt").read_text())
    vendor_tools.scaffold_config("acme", CASE, None, vendors_dir=vendors)
    return vendor_yaml.parent


def test_the_plugin_vendor_passes_check(tmp_path):
    repo = _repo_copy(tmp_path / "repo")
    vdir = _plugin_vendor(repo)
    assert vendor_tools.check_vendor("acme", vendors_dir=repo / "vendors") == []
    # the scaffolded config is where the registry looks for it
    assert registry.vendor_config_path("acme", CaseName.parse(CASE), None, vendors_dir=repo / "vendors").is_file()
    # a plug-in that is not there is named
    (vdir / "plugin.py").unlink()
    problems = vendor_tools.check_vendor("acme", vendors_dir=repo / "vendors")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "field 'monitor': module vendors.acme.plugin not found",
        "field 'memory_query': module vendors.acme.plugin not found",
    ], problems


def test_the_plugin_sampler_runs_as_the_node_side_monitor(tmp_path):
    """SSH and Slurm nodes start ``python -m run_benchmarks.running.monitors --kind <the vendor's monitor>``."""
    repo = _repo_copy(tmp_path / "repo")
    _plugin_vendor(repo)
    out = tmp_path / "monitor.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "run_benchmarks.running.monitors",
            "--kind",
            "vendors.acme.plugin:sample",
            "--out",
            str(out),
            "--interval",
            "0.2",
        ],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not out.is_file() or len(out.read_text().splitlines()) < 2):
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        said = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, said
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) >= 2 and all("gpu_error" not in s for s in samples), samples
    assert [g["mem_used_gib"] for g in samples[0]["gpus"]] == [10.0, 11.0, 12.0, 13.0]
    bad = subprocess.run(
        [sys.executable, "-m", "run_benchmarks.running.monitors", "--kind", "no spec", "--out", str(out)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--kind 'no spec' is neither nvml, ixsmi, none nor a sampler's 'module:function'" in bad.stderr


@pytest.mark.framework("megatron")
def test_a_plugin_vendor_runs_a_case_end_to_end(tmp_path, megatron_python):
    repo = _repo_copy(tmp_path / "repo")
    _plugin_vendor(repo)
    logs = tmp_path / "logs"
    reference = repo / "cases" / "llama3" / "megatron" / "reference" / "llama3_tiny" / "standard.json"
    proc = subprocess.run(
        [
            sys.executable,
            "run_benchmarks/start_task.py",
            "--vendor",
            "acme",
            "--case_name",
            CASE,
            "--python",
            megatron_python,
            "--reference",
            str(reference),
            "--log-dir",
            str(logs),
        ],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), VISIBLE: "0,2"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    (run,) = list(logs.iterdir())
    res = json.loads((run / "results.json").read_text())
    (rnd,) = res["rounds"]
    assert proc.returncode == 0 and rnd["status"] == "ok", (proc.stdout[-3000:] + proc.stderr[-3000:], rnd.get("error"))
    assert (res["vendor"], res["hardware"], res["config_name"]) == ("acme", "X1", "config_X1x1x2")
    (phase,) = rnd["phases"]
    assert phase["gate"]["verdict"] == "aligned", phase["gate"]

    # what the ranks were told, and what they ran on
    resolved = json.loads((run / "round1" / "resolved.json").read_text())["vendor"]
    assert {k: resolved[k] for k in ("device", "dist_backend", "visible_devices_env", "memory_query")} == {
        "device": "cpu",
        "dist_backend": "gloo",
        "visible_devices_env": VISIBLE,
        "memory_query": "vendors.acme.plugin:memory",
    }
    meta = phase["meta"]
    assert meta["device"] == "cpu" and meta["visible_devices"] == {VISIBLE: "0,2"}, meta

    # the memory query's figures and name, per rank; the ceiling named the same device
    assert rnd["devices"] == ["Acme X1 (plug-in, cpu)"]
    assert rnd["per_rank_mem_gib"] == {"0": 3.0, "1": 4.0}
    assert (rnd["peak_mem_gib"], rnd["total_mem_gib"]) == (4.0, 48.0)
    assert meta["kernel_ceiling"]["device"] == "Acme X1 (plug-in, cpu)"

    # the sampler's devices; device memory over the visible ones alone (2 holds 12 GiB, 3 holds 13)
    mon = rnd["monitor"]["node0"]
    assert mon["samples"] >= 1 and sorted(mon["gpus"]) == ["0", "1", "2", "3"], mon
    assert [mon["gpus"][i]["power_mean_w"] for i in "0123"] == [300.0, 301.0, 302.0, 303.0]
    assert rnd["device_mem"] == {"used_gib": 12.0, "total_gib": 64.0, "scope": "round"}, rnd["device_mem"]
    assert phase["device_mem"]["used_gib"] == 12.0 and phase["device_mem"]["total_gib"] == 64.0
