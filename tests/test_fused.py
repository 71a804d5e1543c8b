"""training/fused.py: the compiled elementwise functions give the eager ones' outputs and
gradients (``aot_eager`` on the CPU, static and dynamic), a static region compiles once per
shape and a dynamic one once for every token count, each function keeps the arithmetic of the
model it stands in for (transformers' LlamaRMSNorm, ``torch.nn.RMSNorm``), and the compiled
regions follow the module's backend."""

from __future__ import annotations

import pytest

from tests.case_helpers import torch_unit

try:
    import torch
except ImportError:  # the host interpreter: the tests run again in the deepspeed environment
    torch = None

needs_torch = torch_unit(torch is not None)

if torch is not None:
    import torch.nn.functional as F
    from torch._dynamo.testing import CompileCounterWithBackend

    from training import fused


@pytest.fixture
def counter(monkeypatch):
    """A counting ``aot_eager`` backend on the shared module, with dynamo's caches cleared."""
    torch._dynamo.reset()
    monkeypatch.setattr(fused, "_COMPILED", {})
    backend = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fused, "COMPILE_BACKEND", backend)
    yield backend
    torch._dynamo.reset()


def _norm_inputs(dtype, tokens: int, hidden: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(2, tokens, hidden, generator=g)).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).requires_grad_()
    return x, w


def _out_and_grads(fn, *inputs):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    g = torch.Generator().manual_seed(99)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))  # not a uniform gradient
    return [out.detach()] + [t.grad.clone() for t in inputs]


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:  # bf16: to bf16's own precision
            torch.testing.assert_close(a, b)


@needs_torch
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_functions_equal_the_eager_ones(counter, dynamic: bool, dtype: str) -> None:
    dt = getattr(torch, dtype)
    x, w = _norm_inputs(dt, 10)
    rows = fused.token_rows if dynamic else (lambda t: t)
    for norm in (fused.rms_norm, fused.torch_rms_norm):
        want = _out_and_grads(lambda a, b, norm=norm: norm(a, b, 1e-6), x, w)
        got = _out_and_grads(lambda a, b, norm=norm: fused.compiled(norm, dynamic)(rows(a), b, 1e-6).view(a.shape), x, w)
        _same(got, want)
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(2, 10, 64, generator=g).to(dt).requires_grad_() for _ in range(2))
    _same(
        _out_and_grads(lambda a, b: fused.compiled(fused.swiglu, dynamic)(rows(a), rows(b)).view(a.shape), gate, up),
        _out_and_grads(fused.swiglu, gate, up),
    )
    packed = torch.randn(2, 10, 128, generator=g).to(dt).requires_grad_()
    _same(
        _out_and_grads(lambda y: fused.compiled(fused.swiglu_packed, dynamic)(rows(y)).view(2, 10, 64), packed),
        _out_and_grads(fused.swiglu_packed, packed),
    )
    assert counter.frame_count == 4  # each function captured once


@needs_torch
@pytest.mark.parametrize(
    "dynamic, marked, captures",
    [
        (False, False, 3),  # static: one graph per length
        (True, False, 2),  # automatic dynamic: the second length makes the token count symbolic
        (True, True, 1),  # the token count marked (token_rows): one graph from the first length on
    ],
)
def test_captures_per_length(counter, dynamic: bool, marked: bool, captures: int) -> None:
    fn = fused.compiled(fused.rms_norm, dynamic)
    rows = fused.token_rows if marked else (lambda t: t.reshape(-1, t.shape[-1]))
    for tokens in (6, 10, 23):
        x, w = _norm_inputs(torch.float32, tokens)
        want = _out_and_grads(lambda a, b: fused.rms_norm(a, b, 1e-6), x, w)
        _same(_out_and_grads(lambda a, b: fn(rows(a), b, 1e-6).view(a.shape), x, w), want)
    assert counter.frame_count == captures


@needs_torch
def test_token_rows_is_a_view_with_the_token_count_marked() -> None:
    x = torch.randn(2, 5, 8)
    rows = fused.token_rows(x)
    assert rows.shape == (10, 8) and rows.data_ptr() == x.data_ptr()
    assert 0 in getattr(rows, "_dynamo_weak_dynamic_indices", set())


@needs_torch
def test_each_region_is_made_once_per_function_backend_and_dynamic(counter, monkeypatch) -> None:
    a = fused.compiled(fused.swiglu)
    assert fused.compiled(fused.swiglu) is a and fused.compiled(fused.swiglu, dynamic=False) is a
    assert fused.compiled(fused.swiglu, dynamic=True) is not a
    assert fused.compiled(fused.swiglu_packed) is not a
    other = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fused, "COMPILE_BACKEND", other)
    b = fused.compiled(fused.swiglu)
    assert b is not a
    b(torch.ones(3, 4), torch.ones(3, 4))
    assert (other.frame_count, counter.frame_count) == (1, 0)  # the backend set when it was made


@needs_torch
def test_rms_norm_rounds_before_the_weight_as_llama_rms_norm_does() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w = _norm_inputs(torch.bfloat16, 16, hidden=512)
    ref = LlamaRMSNorm(512, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w)
        assert torch.equal(fused.rms_norm(x, w, 1e-5), ref(x)), transformers.__version__
        x32 = x.float()
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(fused.rms_norm(x, w, 1e-5), w * normalized.to(torch.bfloat16))


@needs_torch
def test_torch_rms_norm_is_torch_nn_rms_norm() -> None:
    x, w = _norm_inputs(torch.bfloat16, 16, hidden=512)
    ref = torch.nn.RMSNorm(512, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w)
        assert torch.equal(fused.torch_rms_norm(x, w, 1e-5), ref(x))
        assert torch.equal(fused.torch_rms_norm(x, w, 1e-5), F.rms_norm(x, (512,), w, 1e-5))


@needs_torch
def test_swiglu_packed_takes_gate_then_up() -> None:
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    assert torch.equal(fused.swiglu_packed(torch.cat([gate, up], -1)), F.silu(gate) * up)
    assert torch.equal(fused.swiglu(gate, up), F.silu(gate) * up)


def test_units_in_framework_env(deepspeed_units):
    assert deepspeed_units.of(__file__)["passed"] == 12
