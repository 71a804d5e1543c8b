"""training.accelerator: the device calls of a case by the vendor's device type, and a
vendor's memory query. Unit tests need torch: they run here when it is importable, else
this file runs again under the deepspeed environment's Python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.case_helpers import units_in_env

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not importable here (runs in the framework env)")


@needs_torch
def test_cpu_device_and_its_memory():
    from training.accelerator import Accelerator

    acc = Accelerator({"device": "cpu"})
    dev = acc.device(3)
    assert dev == torch.device("cpu") and acc.module is None
    acc.synchronize(dev)
    acc.reset_peak(dev)
    peak, total, name = acc.memory(dev)
    assert name == "cpu" and 0 < peak < total


@needs_torch
def test_a_device_type_torch_does_not_know_is_named():
    from training.accelerator import Accelerator

    with pytest.raises(RuntimeError, match="vendor.device 'npu': torch has no torch.npu module here"):
        Accelerator({"device": "npu"})


@needs_torch
def test_the_vendors_memory_query_answers_instead(tmp_path, monkeypatch):
    from training.accelerator import Accelerator

    (tmp_path / "acme_mem.py").write_text("def query(device):\n    return 123, 456, f'acme {device.type}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    acc = Accelerator({"device": "cpu", "memory_query": "acme_mem:query"})
    assert acc.memory(acc.device(0)) == (123, 456, "acme cpu")


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env():
    assert "3 passed" in units_in_env("FB_TEST_DEEPSPEED_PYTHON", Path(__file__), timeout=300)
