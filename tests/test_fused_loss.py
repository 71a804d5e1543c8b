"""training/fused_loss.py: the chunked output layer + cross-entropy gives the plain path's loss
and gradients (float32 to rounding, bf16 to bf16's precision), with ignored labels, the z-loss,
a chunk that does not divide the tokens, and a frozen weight; its memory stays a chunk's."""

from __future__ import annotations

import pytest

from tests.case_helpers import torch_unit

try:
    import torch
except ImportError:  # the host interpreter: the tests run again in the deepspeed environment
    torch = None

needs_torch = torch_unit(torch is not None)

if torch is not None:
    from training.fused_loss import linear_cross_entropy, plain_linear_cross_entropy


def _inputs(dtype, tokens: int = 37, hidden: int = 16, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(vocab, hidden, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens), generator=g)
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return x, w, labels


def _loss_and_grads(fn, x, w, labels, **kw):
    x.grad = w.grad = None
    loss = fn(x, w, labels, **kw)
    (3.0 * loss).backward()  # a non-unit incoming gradient
    return loss.detach(), x.grad.clone(), w.grad.clone()


@needs_torch
@pytest.mark.parametrize("chunk", [1, 8, 37, 74, 1000])
@pytest.mark.parametrize("z", [0.0, 1e-3])
def test_float32_equals_the_plain_path(chunk: int, z: float) -> None:
    x, w, labels = _inputs(torch.float32)
    want = _loss_and_grads(plain_linear_cross_entropy, x, w, labels, z_loss_weight=z)
    got = _loss_and_grads(linear_cross_entropy, x, w, labels, chunk=chunk, z_loss_weight=z)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_torch
def test_bfloat16_follows_the_plain_paths_rounding() -> None:
    x, w, labels = _inputs(torch.bfloat16, tokens=64, hidden=32, vocab=96)
    want = _loss_and_grads(plain_linear_cross_entropy, x, w, labels, z_loss_weight=1e-4)
    got = _loss_and_grads(linear_cross_entropy, x, w, labels, chunk=24, z_loss_weight=1e-4)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)  # the loss is float32 from the same logits
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2e-2, atol=2e-3)


@needs_torch
def test_a_frozen_weight_gets_no_gradient_and_x_still_does() -> None:
    x, w, labels = _inputs(torch.float32)
    w.requires_grad_(False)
    loss = linear_cross_entropy(x, w, labels, chunk=10)
    loss.backward()
    assert w.grad is None and x.grad is not None
    x2 = x.detach().clone().requires_grad_()
    plain_linear_cross_entropy(x2, w, labels).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


@needs_torch
def test_a_wrong_chunk_is_refused() -> None:
    x, w, labels = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk must be a positive number of tokens"):
        linear_cross_entropy(x, w, labels, chunk=0)


@needs_torch
def test_what_is_kept_for_the_backward_is_not_the_logits() -> None:
    """Bytes of the tensors autograd keeps between forward and backward: the plain path keeps
    [tokens, vocab] float32 logits (their log-softmax); the chunked one only the gradients of x
    and W, whatever the chunk."""
    tokens, hidden, vocab = 4096, 64, 4096
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (0.1 * torch.randn(vocab, hidden, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)

    def kept(fn, **kw) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(x, w, labels, **kw)
        loss.backward()
        return sum(seen.values())

    logits = tokens * vocab * 4
    assert kept(plain_linear_cross_entropy) >= logits
    for chunk in (256, 4096):
        assert kept(linear_cross_entropy, chunk=chunk) == (tokens * hidden + vocab * hidden) * 4 < logits / 8


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the unit tests above ran in this interpreter")
def test_units_in_framework_env(deepspeed_units):
    assert deepspeed_units.of(__file__)["passed"] == 14
