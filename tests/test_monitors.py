"""Host monitors: the ixsmi parser (on sample output), psutil sampling, summaries."""

import json
import time
from pathlib import Path

from run_benchmarks.running import monitors

SAMPLE = Path(__file__).parent / "data" / "ixsmi_query_sample.csv"


def test_ixsmi_parser_on_sample_output():
    # A SAMPLE written in the CSV shape of `ixsmi --query-gpu=... --format=csv` (the
    # nvidia-smi query format Iluvatar's tool follows); no Iluvatar hardware runs here.
    gpus = monitors.parse_ixsmi_csv(SAMPLE.read_text())
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    assert gpus[0]["util_percent"] == 97 and gpus[0]["power_w"] == 251.30 and gpus[0]["temp_c"] == 61
    assert round(gpus[0]["mem_used_gib"], 2) == round(57950 / 1024, 2) and gpus[0]["mem_total_gib"] == 64
    assert gpus[2]["power_w"] is None  # "[N/A]" is unknown, not zero
    assert monitors.parse_ixsmi_csv("") == []


def test_monitor_thread_samples_and_summary(tmp_path):
    out = tmp_path / "monitor.jsonl"
    mon = monitors.MonitorThread("none", out, interval=0.05)
    mon.start()
    time.sleep(0.5)
    mon.stop()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) >= 3 and all(0 <= s["host"]["cpu_percent"] <= 100 for s in lines)
    summary = monitors.monitor_summary(out)
    assert summary["samples"] == len(lines) and summary["host_mem_peak_gib"] > 0 and summary["gpus"] == {}


def test_summary_of_gpu_samples(tmp_path):
    out = tmp_path / "m.jsonl"
    gpus = monitors.parse_ixsmi_csv(SAMPLE.read_text())
    rows = [{"t": float(i), "host": {"cpu_percent": 50.0, "mem_used_gib": 10.0, "mem_total_gib": 64.0}, "gpus": gpus} for i in range(3)]
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = monitors.monitor_summary(out)
    assert s["gpus"]["0"]["mem_total_gib"] == 64 and s["gpus"]["0"]["util_mean_percent"] == 97
    assert s["gpus"]["2"]["power_mean_w"] is None and s["duration_s"] == 2.0


def test_nvml_reader_without_a_driver_gives_host_metrics_only():
    import pytest

    if Path("/dev/nvidiactl").exists():
        pytest.skip("an NVIDIA driver is present: NVML answers here")
    assert monitors.gpu_reader("nvml") is None  # no exception: the round goes on with host metrics
    assert monitors.gpu_reader("none") is None


def test_nvml_samples_carry_the_sm_clock_and_why_it_is_held_down():
    """No NVIDIA driver runs here: the reader's NVML calls answer from a stand-in module holding
    nvidia-ml-py's own constants, so what is read and how the reason mask is named is checked."""
    import types

    import pynvml

    class Stand(types.SimpleNamespace):
        pass

    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    nv = Stand(
        **{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith("nvmlClocksEventReason") or k.startswith("NVML_")},
        NVMLError=pynvml.NVMLError,
        nvmlDeviceGetClockInfo=lambda h, kind: 1755 if kind == pynvml.NVML_CLOCK_SM else 0,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: mask,
    )
    import unittest.mock

    with unittest.mock.patch.dict("sys.modules", {"pynvml": nv}):
        nv.nvmlInit, nv.nvmlDeviceGetCount, nv.nvmlDeviceGetHandleByIndex = (lambda: None), (lambda: 1), (lambda i: f"gpu{i}")
        reader = monitors.NVMLReader()
    assert reader.clocks("gpu0") == {"sm_clock_mhz": 1755.0, "sm_clock_max_mhz": 1980.0, "clock_held": ["power cap", "thermal (hardware)"]}

    def unsupported(*_):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nv.nvmlDeviceGetMaxClockInfo = unsupported
    reader.reasons = unsupported
    assert reader.clocks("gpu0") == {"sm_clock_mhz": 1755.0, "sm_clock_max_mhz": None, "clock_held": None}
    # an older binding: the reasons under their former names, the same bits
    names = {k.replace("ClocksEvent", "ClocksThrottle"): v for k, v in vars(nv).items() if k.startswith("nvmlClocksEventReason")}
    rest = {
        k: v for k, v in vars(nv).items() if not k.startswith("nvmlClocksEventReason") and k != "nvmlDeviceGetCurrentClocksEventReasons"
    }
    old = Stand(
        **{**rest, **names, "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: mask, "nvmlDeviceGetMaxClockInfo": lambda h, kind: 1980}
    )
    with unittest.mock.patch.dict("sys.modules", {"pynvml": old}):
        legacy = monitors.NVMLReader()
    assert legacy.clocks("gpu0")["clock_held"] == ["power cap", "thermal (hardware)"]
    # a binding without the reasons at all: the clock still, no reasons
    bare = Stand(**{k: v for k, v in vars(old).items() if k != "nvmlDeviceGetCurrentClocksThrottleReasons"})
    with unittest.mock.patch.dict("sys.modules", {"pynvml": bare}):
        assert monitors.NVMLReader().clocks("gpu0") == {"sm_clock_mhz": 1755.0, "sm_clock_max_mhz": 1980.0, "clock_held": None}


def test_a_device_monitor_that_cannot_run_is_in_the_summary_once(tmp_path, monkeypatch):
    """A vendor's sampler calling a tool that is not installed (npu-smi absent), and a module
    that is not there: each node's summary (results.json's round monitor) says why, once,
    with how many samples failed."""
    import time

    (tmp_path / "npu_monitor.py").write_text("import subprocess\n\ndef sample():\n    return subprocess.run(['npu-smi', 'info'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for kind, error in (
        ("npu_monitor:sample", "monitor npu_monitor:sample: FileNotFoundError: [Errno 2] No such file or directory: 'npu-smi'"),
        ("no_such_monitor:sample", "monitor no_such_monitor:sample: ModuleNotFoundError: No module named 'no_such_monitor'"),
    ):
        out = tmp_path / f"{kind.split(':')[0]}.jsonl"
        mon = monitors.MonitorThread(kind, out, interval=0.05)
        mon.start()
        time.sleep(0.3)
        mon.stop()
        s = monitors.monitor_summary(out)
        assert s["error"] == error, s
        assert s["failed_samples"] == (s["samples"] if "npu" in kind else 1) and s["samples"] >= 2, s
