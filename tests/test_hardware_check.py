"""A round whose ranks ran on another device than the case names fails, with its figures kept."""

import time

import pytest

from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.planning.config import ClusterConfig
from run_benchmarks.running import orchestrator
from run_benchmarks.running.runtimes.base import NodeOutcome
from training.metriclog import REQUIRED_META, MetricLogger


def _round(tmp_path, device_name, hardware="H100"):
    plan = planning.build(
        CaseName.parse(f"llama3_8b:megatron:{hardware}:1:2"),
        "nvidia",
        ClusterConfig(),
        tmp_path,
        sets=["train.steps=2", "train.warmup_steps=0"],
    )
    node = tmp_path / "round1" / "node0"
    (node / "ranks").mkdir(parents=True)
    with open(node / "ranks" / "stdout.log", "w") as fh:
        log = MetricLogger(run="r", rank=0, stream=fh)
        meta = {k: 1 for k in REQUIRED_META if k != "parallel"}
        log.meta(**meta, parallel={"tp": 2})
        for s in (1, 2):
            log.step(s, 10.0, 65536, 3.0, 1e-5)
        log.peak_memory(60 * 2**30, 140 * 2**30, device_name)
        log.end("ok", 2)
    out = NodeOutcome("localhost", 0, 0, False, node)
    return orchestrator.evaluate_round(plan, 1, [out], time.monotonic())


@pytest.mark.parametrize(
    "device,ok", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 PCIe", False), ("NVIDIA H200", False), ("NVIDIA A100-SXM4-80GB", False)]
)
def test_device_must_be_the_named_chip(tmp_path, device, ok):
    rnd = _round(tmp_path, device)
    assert rnd.devices == [device]
    # two steps and no reference curve for llama3_8b: a clean round whose loss is not judged
    assert rnd.status == ("unjudged" if ok else "failed"), rnd.error
    if not ok:
        assert f"the case names H100 but the ranks ran on {device}" in rnd.error
        assert "vendors/nvidia/vendor.yaml" in rnd.error
        assert rnd.tokens_per_gpu_s == pytest.approx(65536 / 3.0 / 2)  # the measurement is kept


def test_h200_case_accepts_h200(tmp_path):
    rnd = _round(tmp_path, "NVIDIA H200", hardware="H200")
    assert rnd.status == "unjudged" and rnd.error == "phase train: loss not judged: no reference curve"
