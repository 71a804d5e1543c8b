"""The Baichuan2 model of cases/baichuan2/deepspeed: its pieces, on the CPU.

These tests need torch.  Where the interpreter running pytest has none (the
harness's own environment), ``test_model_in_framework_env`` runs this file
again under the deepspeed environment's Python (``FB_TEST_DEEPSPEED_PYTHON``).
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest
import yaml

from tests.case_helpers import framework_python, pytest_in, torch_unit
from training import shapes
from training.flops import decoder_flops

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the harness's environment
    torch = None

ROOT = Path(__file__).resolve().parent.parent
CASE_DIR = ROOT / "cases" / "baichuan2" / "deepspeed"
CASE = shapes.complete(yaml.safe_load((CASE_DIR / "case.yaml").read_text()))

needs_torch = torch_unit(torch is not None, "torch is not importable here; test_model_in_framework_env runs these")


def _model_module():
    return importlib.import_module("cases.baichuan2.deepspeed.model")


@pytest.fixture(scope="module")
def M():
    return _model_module()


def tiny_shape(**over):
    shape = dict(CASE["models"]["baichuan2_tiny"]["shape"])
    shape.update(over)
    return shape


def _reference_slopes(n: int) -> list[float]:
    """ALiBi slopes written out from the paper's closed form (independent of model.py)."""

    def pow2(m: int) -> list[float]:
        return [2.0 ** (-8.0 * k / m) for k in range(1, m + 1)]

    c = 2 ** int(math.floor(math.log2(n)))
    if c == n:
        return pow2(n)
    # the odd-indexed terms of the 2c-head sequence: 2^(-8(2k-1)/(2c)) = 2^(-4(2k-1)/c)
    return pow2(c) + [2.0 ** (-4.0 * (2 * k - 1) / c) for k in range(1, n - c + 1)]


@needs_torch
@pytest.mark.parametrize("n", [1, 2, 4, 8, 10, 12, 16, 20, 32, 40, 64])
def test_alibi_slopes_formula(M, n):
    got = M.alibi_slopes(n)
    assert len(got) == n
    assert got == pytest.approx(_reference_slopes(n), rel=1e-12)


@needs_torch
def test_alibi_slopes_40_heads(M):
    s = M.alibi_slopes(40)
    assert s[0] == pytest.approx(2**-0.25)
    assert s[31] == pytest.approx(2**-8)
    assert s[32] == pytest.approx(2**-0.125)  # first of the 64-head sequence's even positions
    assert s[39] == pytest.approx(2 ** (-0.125 * 15))
    assert all(a > b for a, b in zip(s[:32], s[1:32]))


@needs_torch
def test_alibi_mask_values(M):
    heads, seq = 10, 7
    mask = M.alibi_causal_mask(heads, seq, torch.float32)
    assert mask.shape == (1, heads, seq, seq)
    slopes = M.alibi_slopes(heads)
    for h in range(heads):
        for i in range(seq):
            for j in range(seq):
                v = mask[0, h, i, j].item()
                if j > i:
                    assert v == float("-inf")
                else:
                    assert v == pytest.approx(slopes[h] * (j - i), abs=1e-6)


@needs_torch
def test_sdpa_with_mask_matches_explicit_attention(M):
    torch.manual_seed(0)
    heads, seq, d = 10, 12, 16
    q, k, v = (torch.randn(2, heads, seq, d) for _ in range(3))
    mask = M.alibi_causal_mask(heads, seq, torch.float32)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    slopes = torch.tensor(M.alibi_slopes(heads))
    pos = torch.arange(seq)
    bias = slopes[:, None, None] * pos[None, None, :].float()  # the published form: slope * j
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = (scores + bias).masked_fill(~causal, float("-inf"))
    want = scores.softmax(-1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_torch
@pytest.mark.parametrize("checkpointing", [False, True])
def test_future_token_does_not_change_earlier_logits(M, checkpointing):
    torch.manual_seed(0)
    model = M.build_model(tiny_shape(), gradient_checkpointing=checkpointing)
    model.train()  # the training path (normalization every forward, checkpointing)
    seq, t = 32, 20
    a = torch.randint(0, model.config.vocab_size, (2, seq))
    b = a.clone()
    b[:, t] = (b[:, t] + 7) % model.config.vocab_size
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :t], lb[:, :t], rtol=0, atol=0)
    assert not torch.allclose(la[:, t:], lb[:, t:])


@needs_torch
def test_later_positions_see_earlier_tokens_through_alibi(M):
    """A token change is felt by later positions (the mask is not over-masking)."""
    torch.manual_seed(0)
    model = M.build_model(tiny_shape()).eval()
    a = torch.randint(0, model.config.vocab_size, (1, 16))
    b = a.clone()
    b[0, 0] = (b[0, 0] + 1) % model.config.vocab_size
    with torch.no_grad():
        diff = (model(a) - model(b)).abs().amax(-1)[0]
    assert (diff[1:] > 0).all()


@needs_torch
def test_normhead_normalizes_rows_in_training(M):
    torch.manual_seed(0)
    head = M.NormHead(16, 50, std=0.5)
    head.train()
    x = torch.randn(3, 16)
    out = head(x)
    w = head.weight.detach()
    want = x @ (w / w.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(out, want)
    assert torch.allclose(head.normalized_weight().norm(dim=1), torch.ones(50))
    # scaling a row does not change its logits: the row's norm has no effect
    with torch.no_grad():
        head.weight[3] *= 10.0
    torch.testing.assert_close(head(x), want)
    # the gradient passes through the normalization: orthogonal to each row
    head.zero_grad()
    head(x).square().sum().backward()
    g = head.weight.grad
    assert g.abs().sum() > 0
    assert torch.allclose((g * head.weight.detach()).sum(1), torch.zeros(50), atol=1e-5)


@needs_torch
def test_normhead_eval_caches_and_train_resets(M):
    torch.manual_seed(0)
    head = M.NormHead(8, 20)
    x = torch.randn(2, 8)
    head.eval()
    first = head(x)
    with torch.no_grad():
        head.weight.mul_(-1.0)
    torch.testing.assert_close(head(x), first)  # cached normalized weight
    head.train()
    torch.testing.assert_close(head(x), -first)


@needs_torch
def test_rmsnorm(M):
    norm = M.RMSNorm(6, eps=1e-6)
    x = torch.randn(4, 6)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), want)


@needs_torch
def test_structure_has_no_biases_and_untied_embeddings(M):
    model = M.build_model(tiny_shape())
    names = dict(model.named_parameters())
    assert not [n for n in names if n.endswith("bias")]
    assert model.embed_tokens.weight is not model.lm_head.weight
    layer = model.layers[0]
    h, f = model.config.hidden_size, model.config.ffn_hidden_size
    assert layer.self_attn.W_pack.weight.shape == (3 * h, h)
    assert layer.mlp.gate_proj.weight.shape == (f, h)
    assert layer.mlp.up_proj.weight.shape == (f, h)
    assert layer.mlp.down_proj.weight.shape == (h, f)
    assert model.config.norm_eps == 1e-6


@needs_torch
def test_init_std(M):
    torch.manual_seed(0)
    model = M.build_model(tiny_shape(hidden_size=320, num_heads=20), init_std=0.05)
    w = model.layers[0].mlp.gate_proj.weight
    assert float(w.detach().std()) == pytest.approx(0.05, rel=0.05)
    assert float(model.embed_tokens.weight.detach().std()) == pytest.approx(0.05, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


@needs_torch
@pytest.mark.parametrize("name", list(CASE["models"]))
def test_parameter_count_matches_flops_counter(M, name):
    entry = CASE["models"][name]
    with torch.device("meta"):
        model = M.build_model(entry["shape"])
    assert M.count_parameters(model) == decoder_flops(entry)["params_exact"]


def test_13b_parameter_count():
    """The published Baichuan2-13B size: 13,896,668,160 parameters."""
    assert decoder_flops(CASE["models"]["baichuan2_13b"])["params_exact"] == 13_896_668_160


@needs_torch
def test_gradient_checkpointing_gives_the_same_loss_and_grads(M):
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = M.build_model(tiny_shape(), gradient_checkpointing=ckpt)
        x = torch.randint(0, model.config.vocab_size, (2, 33))
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)


@needs_torch
def test_loss_is_cross_entropy_and_starts_near_log_vocab(M):
    torch.manual_seed(0)
    model = M.build_model(tiny_shape())
    x = torch.randint(0, model.config.vocab_size, (2, 65))
    logits = model(x[:, :-1])
    loss = model(x[:, :-1], x[:, 1:])
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, want)
    # NormHead logits of an RMS-normalized state have a standard deviation of about 1,
    # so the loss starts about 1/2 above ln(vocab)
    assert 0.0 < loss.item() - math.log(model.config.vocab_size) < 1.0


@needs_torch
def test_bf16_forward_backward(M):
    torch.manual_seed(0)
    model = M.build_model(tiny_shape(), gradient_checkpointing=True).to(torch.bfloat16)
    x = torch.randint(0, model.config.vocab_size, (2, 65))
    loss = model(x[:, :-1], x[:, 1:])
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@needs_torch
def test_sequence_longer_than_max_positions_is_refused(M):
    model = M.build_model(tiny_shape())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long))


@pytest.mark.framework("deepspeed")
@pytest.mark.skipif(torch is not None, reason="torch is importable here: the tests above ran in this interpreter")
def test_model_in_framework_env():
    py = framework_python("FB_TEST_DEEPSPEED_PYTHON", "no Python with torch to run the model tests")
    proc = pytest_in(py, Path(__file__))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    # only this wrapper itself is skipped there
    assert re.search(r"\d+ passed", summary) and re.search(r"\b1 skipped", summary), summary
