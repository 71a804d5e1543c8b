"""The pre-launch memory check: a layout whose weights, gradients and optimizer states alone
cannot fit the device (or, offloaded, the hosts) is refused with its figures, exit 2, before
any process starts; on this host, on the hosts of an SSH cluster, and in --dry-run."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import psutil
import pytest

from tests.case_helpers import start_task
from training.memory import megatron_states, paddle_states, zero_states

GiB = 2**30


start = functools.partial(start_task, timeout=300)


def test_zero_states_by_stage_and_offload():
    c = {"params_exact": 1e9}
    assert zero_states(c, {"zero": {"stage": 0}}, 4, 4)["device_bytes"] == 16e9
    assert zero_states(c, {"zero": {"stage": 1}}, 4, 4)["device_bytes"] == 4e9 + 12e9 / 4
    assert zero_states(c, {"zero": {"stage": 2}}, 4, 4)["device_bytes"] == 2e9 + 14e9 / 4
    assert zero_states(c, {"zero": {"stage": 3}}, 4, 4)["device_bytes"] == 16e9 / 4
    off = zero_states(c, {"zero": {"stage": 3, "offload_optimizer": "cpu"}}, 4, 2)
    assert off["device_bytes"] == 4e9 / 4 and off["host_bytes_per_node"] == 16e9 / 4 * 2  # two ranks on the node
    frozen = zero_states({"params_exact": 1e9, "params_trainable": 1e8}, {"zero": {"stage": 2}}, 2, 2)
    assert frozen["device_bytes"] == 2e9 + (2e8 + 12e8) / 2  # frozen weights held, never trained


def test_megatron_states_by_layout_and_offload():
    c = {"params_exact": 8e9}
    # TP2 DP2: 4e9 params per rank, bf16 weights + fp32 grads, master weights and moments split over DP
    assert megatron_states(c, {"tp": 2, "pp": 1}, 4, 4)["device_bytes"] == 4e9 * (2 + 4) + 4e9 * 12 / 2
    off = megatron_states(c, {"tp": 1, "pp": 1, "optimizer_cpu_offload": True}, 1, 1)
    # on the host: the moments (8) and the fp32 copies of master weight and gradient (8)
    assert off["device_bytes"] == 8e9 * 10 and off["host_bytes_per_node"] == 8e9 * 16


def test_paddle_states_by_layout_and_sharding_stage():
    c = {"params_exact": 8e9}
    # TP2 PP2: 2e9 params per rank; fp16 weights and gradients, fp32 master weights and moments
    assert paddle_states(c, {"tp": 2, "pp": 2}, 8, 8)["device_bytes"] == 2e9 * 16
    assert paddle_states(c, {"sharding_stage": 1, "sharding_degree": 4}, 8, 8)["device_bytes"] == 8e9 * 4 + 8e9 * 12 / 4
    two = paddle_states(c, {"sharding_stage": 2, "sharding_degree": 4}, 8, 8)
    assert two["device_bytes"] == 8e9 * 2 + 8e9 * 14 / 4 and two["basis"] == "TP1 PP1 DP8, 8e+09 params per rank, sharding stage 2 over 4"
    assert paddle_states(c, {"sharding_stage": 0, "sharding_degree": 4}, 8, 8)["device_bytes"] == 8e9 * 16  # degree alone shards nothing


def test_a_paddle_layout_that_cannot_fit_the_card_is_refused_before_anything(tmp_path):
    """gpt3_13B on eight A100 without sharding: 191.5 GiB of states per card."""
    proc = start("--vendor", "nvidia", "--case_name", "gpt3_13B:paddle:A100:1:8", "--set", "parallel.sharding_stage=0", "--dry-run")
    assert proc.returncode == 2 and "need 191.5 GiB per A100 (TP1 PP1 DP8, 1.29e+10 params per rank)" in proc.stderr, proc.stderr
    assert "a higher ZeRO or sharding stage" in proc.stderr


def test_a_layout_that_cannot_fit_the_card_is_refused_before_anything(tmp_path):
    """llama3_8b on two H100 without tensor parallelism or offload: 89.8 GiB of states per card."""
    proc = start(
        "--vendor",
        "nvidia",
        "--case_name",
        "llama3_8b:megatron:H100:1:2",
        "--set",
        "parallel.tp=1",
        "--set",
        "parallel.optimizer_cpu_offload=false",
        "--log-dir",
        str(tmp_path),
        "--dry-run",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "config_H100x1x2.yaml: weights, gradients and optimizer states alone need 89.8 GiB per H100 (TP1 PP1 DP2" in line
    assert "more than 90% of its 80 GiB" in line and not list(tmp_path.iterdir())
    # the plan shows the bound of each phase
    ok = start("--vendor", "nvidia", "--case_name", "llava1.5_7b:deepspeed:H100:1:2", "--dry-run", "--json")
    mem = json.loads(ok.stdout)["memory"]
    assert set(mem) == {"pretrain", "finetune"} and mem["finetune"]["device_gib"] == pytest.approx(50.65, abs=0.01)
    assert mem["pretrain"]["device_gib"] < 14 and "ZeRO-2 over 2" in mem["pretrain"]["basis"]


def test_offloaded_states_larger_than_this_host_are_refused(tmp_path):
    """8 ranks with their Adam moments on the host need 119.7 GiB of it (moments, fp32 master weights and gradients); this host has less."""
    total = psutil.virtual_memory().total / GiB
    if total > 119.7 / 0.75:
        pytest.skip(f"this host has {total:.0f} GiB: the 8-rank offload fits")
    proc = start(
        "--vendor",
        "nvidia",
        "--case_name",
        "llama3_8b:megatron:H100:1:8",
        "--set",
        "parallel.optimizer_cpu_offload=true",
        "--python",
        sys.executable,
        "--log-dir",
        str(tmp_path),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "the optimizer states offloaded to host memory alone need 119.7 GiB per node" in line
    assert f"'s {total:.1f} GiB" in line and "Traceback" not in proc.stderr
    (run_dir,) = tmp_path.iterdir()
    res = json.loads((run_dir / "results.json").read_text())
    assert res["status"] == "failed" and "119.7 GiB per node" in res["error"] and res["rounds"] == []
    assert not (run_dir / "round1").exists()  # nothing was launched


@pytest.mark.cluster
def test_each_ssh_host_is_checked_by_name(cluster, tmp_path):
    """Two hosts (network namespaces of this machine), 16 ranks with moments on the host (59.8 GiB each)."""
    from tests.test_ssh_runtime import cluster_file

    total = psutil.virtual_memory().total / GiB
    if total > 59.8 / 0.75:
        pytest.skip(f"this host has {total:.0f} GiB: the offload fits")
    cfile = cluster_file(cluster, tmp_path, sys.executable, runtime="process")
    proc = start(
        "--vendor",
        "nvidia",
        "--case_name",
        "llama3_8b:megatron:H100:2:8",
        "--set",
        "parallel.optimizer_cpu_offload=true",
        "--cluster",
        str(cfile),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "need 59.8 GiB per node" in line and "more than 75% of h1's" in line, proc.stderr


def test_the_one_h200_config_fits_a_128_gb_host_and_full_offload_does_not():
    """llama3_8b on one H200: the whole optimizer on the host needs 119.7 GiB of it, more than 75 %
    of the 125.9 GiB a 128 GB host has (such a run was killed at 124.2 GiB, 2026-11-29); the
    config's 40 % offload needs 47.9 GiB and passes."""
    from run_benchmarks.errors import InputError
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning.casename import CaseName
    from run_benchmarks.planning.config import ClusterConfig

    host = {"vm": int(125.9 * GiB)}
    cn = CaseName.parse("llama3_8b:megatron:H200:1:1")
    part = planning.build(cn, "nvidia", ClusterConfig(), Path("/tmp"), recipe="short")
    assert part.memory["train"]["host_gib_per_node"] == pytest.approx(47.86, abs=0.01)
    planning.check_host_memory(part.memory, host, "config_H200x1x1.yaml")
    full = planning.build(cn, "nvidia", ClusterConfig(), Path("/tmp"), sets=["parallel.optimizer_offload_fraction=1.0"])
    with pytest.raises(InputError, match=r"need 119\.7 GiB per node .* more than 75% of vm's 125\.9 GiB"):
        planning.check_host_memory(full.memory, host, "config_H200x1x1.yaml")
