"""training.accelerator: the device calls of a case by the vendor's device type, and a
vendor's memory query; the settings and profiler pieces that go with it; and, on the source,
that the cases and training/ name CUDA only where a kernel is CUDA's alone. Unit tests that
need torch run here when it is importable, else this file runs again under the deepspeed
environment's Python."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.case_helpers import torch_unit

try:
    import torch
except ImportError:
    torch = None

needs_torch = torch_unit(torch is not None)


@needs_torch
def test_cpu_device_and_its_memory():
    from training.accelerator import Accelerator

    acc = Accelerator({"device": "cpu"})
    dev = acc.device(3)
    assert dev == torch.device("cpu") and acc.module is None
    assert not acc.is_accelerator and not acc.pin_memory
    acc.synchronize(dev)
    acc.reset_peak(dev)
    acc.empty_cache()
    peak, total, name = acc.memory(dev)
    assert name == "cpu" and 0 < peak < total
    assert acc.device_name(dev) == "cpu" and acc.max_reserved(dev) is None and acc.alloc_retries(dev) is None
    calls = []
    assert acc.seconds_per_call(lambda: calls.append(1), 4, dev) >= 0 and len(calls) == 4
    assert Accelerator.of(dev).type == "cpu" and Accelerator.of("cpu").query is None


class _Event:
    """Stands in for ``torch.<type>.Event``: 250 ms between any two."""

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.recorded = False

    def record(self):
        self.recorded = True

    def synchronize(self):
        assert self.recorded

    def elapsed_time(self, end):
        assert self.recorded and end.recorded
        return 250.0


@needs_torch
def test_another_device_type_is_asked_through_its_torch_module(monkeypatch):
    """A device type other than cuda (xpu here: its torch module exists in every build, and
    stands in for npu, mlu, musa, which only their extensions add) gets every call from
    torch.<type>; its events time, else the wall clock between two synchronizes."""
    from training.accelerator import Accelerator

    said = []
    props = type("Props", (), {"name": "Acme X1", "total_memory": 64 << 30})()
    fake = {
        "set_device": lambda i: said.append(("set_device", i)),
        "synchronize": lambda d=None: said.append(("synchronize", d)),
        "reset_peak_memory_stats": lambda d: said.append(("reset", d)),
        "max_memory_allocated": lambda d: 5 << 30,
        "max_memory_reserved": lambda d: 6 << 30,
        "reset_accumulated_memory_stats": lambda d: said.append(("reset counts", d)),
        "memory_stats": lambda d: {"num_alloc_retries": 2, "num_ooms": 0},
        "get_device_properties": lambda d: props,
        "empty_cache": lambda: said.append(("empty_cache",)),
        "Event": _Event,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.xpu, name, fn, raising=False)
    acc = Accelerator({"device": "xpu"})
    dev = acc.device(1)
    assert dev == torch.device("xpu", 1) and acc.is_accelerator and acc.pin_memory
    acc.synchronize(dev)
    acc.reset_peak(dev)
    acc.empty_cache()
    assert said == [("set_device", 1), ("synchronize", dev), ("reset", dev), ("reset counts", dev), ("empty_cache",)]
    assert acc.memory(dev) == (5 << 30, 64 << 30, "Acme X1") and acc.device_name(dev) == "Acme X1"
    assert acc.max_reserved(dev) == 6 << 30 and acc.alloc_retries(dev) == 2
    monkeypatch.setattr(torch.xpu, "memory_stats", lambda d: {})  # a stack that keeps no such count
    assert acc.alloc_retries(dev) is None
    calls = []
    assert acc.seconds_per_call(lambda: calls.append(1), 5, dev) == pytest.approx(0.05) and len(calls) == 5
    said.clear()
    monkeypatch.delattr(torch.xpu, "Event")
    assert acc.seconds_per_call(lambda: calls.append(1), 2, dev) >= 0 and len(calls) == 7
    assert said == [("synchronize", dev), ("synchronize", dev)]


@needs_torch
def test_the_profiler_traces_the_device_types_kernels():
    import torch.profiler as tp

    from training.profiling import device_activity

    assert device_activity("cpu") is None
    assert device_activity("cuda") == tp.ProfilerActivity.CUDA and device_activity("xpu") == tp.ProfilerActivity.XPU
    assert device_activity("npu") is None  # no extension has registered npu here


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


def test_the_collective_backend_is_the_vendors():
    """vendor.dist_backend: gloo by default on the CPU only; any other device names its own."""
    from training import runtime
    from training import settings as common

    cfg = {"case": {"model": "m"}, "model": {"params_nominal": 1.0}, "train": {"steps": 1, "global_batch": 2, "lr": 1.0}}
    assert common.from_config(cfg, 2).dist_backend == "gloo"
    c = common.from_config({**cfg, "vendor": {"device": "npu", "dist_backend": "hccl"}}, 2)
    assert (c.device, c.dist_backend) == ("npu", "hccl")
    with pytest.raises(common.SettingsError, match="resolved config: vendor.dist_backend is missing"):
        common.from_config({**cfg, "vendor": {"device": "mlu"}}, 2)
    with pytest.raises(common.SettingsError, match="vendor.device must be a lower-case name such as cuda, npu, cpu"):
        common.from_config({**cfg, "vendor": {"device": "NPU!", "dist_backend": "hccl"}}, 2)
    assert runtime.visible_devices({"visible_devices_env": None}) is None


def test_ranks_record_the_variables_the_vendor_names(monkeypatch):
    """``recorded_env`` (vendor.yaml): each rank's run_meta ``environment`` holds every variable of
    its environment whose name starts with one of the vendor's prefixes, by name, and nothing
    else; a vendor naming none records none; a prefix that is no variable name is refused naming
    the field."""
    from run_benchmarks.planning.config import VendorConfig
    from training import runtime

    for name in [n for n in os.environ if n.startswith(("NCCL_", "GLOO_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_MAX_CTAS", "16")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCLX_OTHER", "not a prefix match")
    got = runtime.recorded_env({"recorded_env": ["NCCL_", "GLOO_"]})
    assert got == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_MAX_CTAS": "16", "NCCL_NVLS_ENABLE": "0"}
    assert list(got) == sorted(got)
    assert runtime.recorded_env({"recorded_env": []}) is None and runtime.recorded_env({}) is None
    vendor = {"name": "v", "device": "cuda", "dist_backend": "nccl", "chips": {"X": {"peak_flops": {}, "memory_gib": 1, "source": "s"}}}
    assert VendorConfig.model_validate({**vendor, "recorded_env": ["NCCL_"]}).recorded_env == ["NCCL_"]
    with pytest.raises(ValueError, match="(?s)recorded_env.*names or name prefixes of environment variables such as NCCL_, got 'nccl_'"):
        VendorConfig.model_validate({**vendor, "recorded_env": ["nccl_"]})


#: where the cases and training/ may name CUDA: kernels that are CUDA's alone, behind a check
#: that names vendor.device and the switch, and paddle's name for the CUDA device
CUDA_ONLY = {
    ("cases/llama3/megatron/kernels.py", "_check_cuda"): "liger-kernel's Triton kernels",
    ("cases/llama3/megatron/kernels.py", "cudnn_attention_mode"): "torch's cuDNN attention",
    (
        "cases/llama3/megatron/kernels.py",
        "reference_attention",
    ): "torch's flash / memory-efficient SDPA backends, the cuDNN check's reference",
    ("training/gemm.py", "out_dtype_gemm"): "torch's out_dtype GEMMs (mm / addmm.dtype_out exist for CUDA alone)",
    ("cases/llama3/megatron/kernels.py", "install_wgrad_accumulation"): "the refusal where CUDA has neither apex nor out_dtype GEMMs",
    ("cases/llama3/megatron/modeling.py", "CuDNNCoreAttention.__init__"): "torch's cuDNN attention",
    ("cases/llama3/megatron/modeling.py", "use_transformer_engine"): "TransformerEngine",
    ("cases/llama3/megatron/settings.py", "check_device"): "the check of the CUDA-only switches",
    (
        "cases/llama3/megatron/tp_gemm_comm.py",
        "_symmetric",
    ): "torch's symmetric memory (tp_comm_overlap: symm_mem), CUDA's; plain collectives elsewhere",
    ("cases/llama3/megatron/tp_gemm_comm.py", "_symm_mem_matmul_reduce_scatter"): "the streams of the symmetric-memory reduce-scatter",
    ("cases/llava/deepspeed/settings.py", "check_device"): "the check of the CUDA-only switch (liger)",
    ("cases/gpt3/paddle/model.py", "flash_attention_available"): "paddle's flash attention",
    ("cases/gpt3/paddle/settings.py", "paddle_device"): "paddle's name of the cuda device",
    ("training/paddle_loop.py", "device_module"): "paddle's module for the gpu device",
}


def _cuda_mentions(path: Path) -> set[str]:
    """The functions (Class.method) of a file that use torch.cuda / paddle's device.cuda or the
    names cuda, gpu, nccl as string values (docstrings and comments aside)."""
    found: set[str] = set()

    def visit(node: ast.AST, where: list[str]) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = [*where, node.name]
        cuda_attr = isinstance(node, ast.Attribute) and node.attr == "cuda" and not isinstance(getattr(node, "ctx", None), ast.Store)
        if cuda_attr or (isinstance(node, ast.Constant) and node.value in ("cuda", "gpu", "nccl")):
            found.add(".".join(where) or "<module>")
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text(), str(path)), [])
    return found


def test_cuda_is_named_only_where_a_kernel_is_cudas_alone():
    found = {
        (str(f.relative_to(ROOT)), where)
        for folder in ("cases", "training")
        for f in sorted((ROOT / folder).rglob("*.py"))
        for where in _cuda_mentions(f)
    }
    assert found == set(CUDA_ONLY), (
        f"named but not listed: {sorted(found - set(CUDA_ONLY))}; listed but gone: {sorted(set(CUDA_ONLY) - found)}; "
        "device calls go through training.accelerator (Accelerator), a CUDA-only kernel behind a vendor.device check"
    )


def test_the_source_check_sees_a_cuda_call(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""cuda"""\nimport torch\n\nclass T:\n    def go(self, d):\n        torch.cuda.synchronize()\n        return d.type == "cuda"\n'
    )
    assert _cuda_mentions(f) == {"T.go"}


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env(deepspeed_units):
    assert deepspeed_units.of(__file__)["passed"] == 5


@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA device: runs on the GPU machine")
def test_a_cuda_allocators_retry_is_counted_and_reset_with_the_peak():
    """On a real CUDA device: with the card filled by 1 GiB blocks and every other one freed, a
    2 GiB block fits no cached hole, so the allocator gives its cache back and asks again; the
    count says so, and reset_peak starts it afresh."""
    from training.accelerator import Accelerator

    acc = Accelerator({"device": "cuda"})
    dev = acc.device(0)
    blocks = []
    try:
        while True:
            blocks.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev))
    except torch.OutOfMemoryError:
        pass
    del blocks[::2]
    acc.reset_peak(dev)  # the failed fill retried too: count from here
    assert acc.alloc_retries(dev) == 0 and len(blocks) >= 4
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    assert acc.alloc_retries(dev) >= 1
    del big, blocks
    acc.reset_peak(dev)
    assert acc.alloc_retries(dev) == 0
