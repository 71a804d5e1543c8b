"""Defects a vendor's stack could really have, as vendor hooks, to show what the loss gate catches.

Each function is a vendor config's ``hook`` (``hook: examples.defects:NAME``): it runs in every
rank before the model is built and breaks one thing the way a faulty kernel, schedule or port
would, leaving the settings untouched (training/runtime.py refuses a hook that changes them).
A recipe keeps the gate's teeth when runs under these hooks are judged not aligned against the
reference of an intact stack (docs/metrics.md, the recipe study; tests/test_recipe_teeth.py).

- ``no_causal_mask``: attention's kernel called without its causal mask (a flag lost in a port):
  each position sees the token it is asked to predict.
- ``repeated_micro_batch``: the data path hands the first micro batch of each step again in place
  of the last (an off-by-one in a sampler): one sample in every ``grad_accum`` is never trained on.
- ``rope_base_off``: the rotary embedding's base 10 % above the model's (a wrong constant in a
  fused RoPE kernel).
- ``unshifted_labels``: the labels are the input tokens, not the next ones (an off-by-one in a
  ported data path): the model is asked to repeat what it sees.
- ``frozen_embeddings``: the token embedding gets no gradient (a sparse-gradient path that drops
  it): the model learns around embeddings that never change.

Attention defects for the conformance check (training/conformance/; docs/metrics.md, its teeth),
each a hook on torch's ``scaled_dot_product_attention`` (as a vendor's faulty kernel would be):

- ``attention_times_zero``: the attention output multiplied by 0.
- ``softmax_scale_x4``: the softmax scale 4 x the one asked for.
- ``attention_window``: causal attention limited to the last ``seq / 16`` keys (512 at 8,192).
- ``qkv_float8``: query, key and value rounded to float8 e4m3 before the kernel (a run that
  declares bf16 computing in float8); where torch has float8.

On the synthetic corpus (an order-1 Markov chain: the next token depends on the current one only,
training/data/synthetic.py) position carries no information, so ``rope_base_off`` cannot change a
loss curve there, and ``repeated_micro_batch`` changes one sample in eight: both stay within the
gate's 2 % (docs/metrics.md has the figures). The gate sees the other three.
"""

from __future__ import annotations

import functools
from typing import Any


def no_causal_mask(cfg: dict[str, Any]) -> None:
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    @functools.wraps(sdpa)
    def unmasked(*args: Any, **kwargs: Any) -> Any:
        kwargs["is_causal"] = False
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = unmasked


def repeated_micro_batch(cfg: dict[str, Any]) -> None:
    from cases.llama3.megatron.batches import StepBatches

    original = StepBatches.microbatches

    @functools.wraps(original)
    def microbatches(self: StepBatches, step: int) -> Any:
        chunks = list(original(self, step))
        if len(chunks) > 1:
            chunks[-1] = chunks[0]
        yield from chunks

    StepBatches.microbatches = microbatches


def rope_base_off(cfg: dict[str, Any]) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    original = RotaryEmbedding.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["rotary_base"] = kwargs.get("rotary_base", 10000) * 1.1
        original(self, *args, **kwargs)

    RotaryEmbedding.__init__ = init


def unshifted_labels(cfg: dict[str, Any]) -> None:
    from cases.llama3.megatron.batches import StepBatches

    original = StepBatches.microbatches

    @functools.wraps(original)
    def microbatches(self: StepBatches, step: int) -> Any:
        for chunk in original(self, step):
            yield {**chunk, "labels": chunk["tokens"]}

    StepBatches.microbatches = microbatches


def frozen_embeddings(cfg: dict[str, Any]) -> None:
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    original = LanguageModelEmbedding.forward

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs).detach()

    LanguageModelEmbedding.forward = forward


def _wrap_sdpa(change: Any) -> None:
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    @functools.wraps(sdpa)
    def changed(*args: Any, **kwargs: Any) -> Any:
        return change(sdpa, *args, **kwargs)

    F.scaled_dot_product_attention = changed


def _times_zero(sdpa: Any, *a: Any, **k: Any) -> Any:
    return sdpa(*a, **k) * 0


def attention_times_zero(cfg: dict[str, Any]) -> None:
    _wrap_sdpa(_times_zero)


def softmax_scale_x4(cfg: dict[str, Any]) -> None:
    def scaled(sdpa: Any, q: Any, *a: Any, **k: Any) -> Any:
        k["scale"] = 4 * (k.get("scale") or q.shape[-1] ** -0.5)
        return sdpa(q, *a, **k)

    _wrap_sdpa(scaled)


def _windowed(sdpa: Any, q: Any, key: Any, v: Any, *a: Any, **k: Any) -> Any:
    """Causal attention limited to the last ``seq / 16`` keys, whether the kernel is told
    ``is_causal``, given a boolean mask, or given an additive one (Baichuan2's ALiBi bias with the
    causal mask folded in); an attention with neither (an encoder's) is left whole."""
    import torch

    n = q.shape[-2]
    width = max(1, n // 16)
    i = torch.arange(n, device=q.device)
    inside = i[None, :] > i[:, None] - width
    mask = k.pop("attn_mask", a[0] if a else None)
    a = a[1:]
    if k.pop("is_causal", False):
        inside = inside & (i[None, :] <= i[:, None])
        if mask is None:
            return sdpa(q, key, v, *a, attn_mask=inside, **k)
    elif mask is None:
        return sdpa(q, key, v, *a, **k)
    if mask.dtype == torch.bool:
        return sdpa(q, key, v, *a, attn_mask=mask & inside, **k)
    return sdpa(q, key, v, *a, attn_mask=mask.masked_fill(~inside, float("-inf")), **k)


def attention_window(cfg: dict[str, Any]) -> None:
    _wrap_sdpa(_windowed)


def qkv_float8(cfg: dict[str, Any]) -> None:
    import torch

    def rounded(sdpa: Any, q: Any, key: Any, v: Any, *a: Any, **k: Any) -> Any:
        f8 = torch.float8_e4m3fn
        return sdpa(q.to(f8).to(q.dtype), key.to(f8).to(key.dtype), v.to(f8).to(v.dtype), *a, **k)

    _wrap_sdpa(rounded)


# --------------------------------------------------------------------------- more defects for the conformance check
#
# - ``alibi_slopes_off``: ALiBi's head slopes 10 % above Press et al.'s (a wrong constant in a
#   ported bias), in cases/baichuan2/deepspeed/model.py's mask and score modification alike.
# - ``paddle_attention_times_zero``, ``paddle_softmax_scale_x4``, ``paddle_attention_window``:
#   the attention defects above in PaddleNLP's GPT (cases/gpt3/paddle), whose attention is its
#   own ``MultiHeadAttention._core_attention`` (or paddle's flash attention), not torch's: these
#   replace those methods as a vendor's faulty kernel would (the window: the core attention only,
#   flash attention takes no mask).
# - ``learned_positions_shifted``: the learned position table read one row on (position ``t`` gets
#   row ``t + 1``, the last position its own row: an off-by-one in a ported embedding), in
#   PaddleNLP's GPT.
#
# The paddle ones refuse another framework (a defect that silently did nothing would pass).


def alibi_slopes_off(cfg: dict[str, Any]) -> None:
    from cases.baichuan2.deepspeed import model

    original = model.alibi_slopes

    @functools.wraps(original)
    def slopes(num_heads: int) -> list[float]:
        model.alibi_slopes = original  # the published recursion, once: each slope off once
        try:
            return [1.1 * s for s in original(num_heads)]
        finally:
            model.alibi_slopes = slopes

    model.alibi_slopes = slopes


def _paddle_only(cfg: dict[str, Any], name: str) -> Any:
    if (cfg.get("case") or {}).get("framework") != "paddle":
        raise RuntimeError(f"examples.defects:{name} breaks PaddleNLP's GPT: the case's framework is not paddle")
    from paddlenlp.transformers.gpt import modeling

    return modeling


def _wrap_paddle_attention(cfg: dict[str, Any], name: str, change: Any, flash: bool = True) -> None:
    """``change(original, self, q, k, v, attention_mask, output_attentions)`` in place of the core
    attention (and of flash attention, with ``flash``)."""
    attention = _paddle_only(cfg, name).MultiHeadAttention
    for method in ("_core_attention", "_flash_attention") if flash else ("_core_attention",):
        original = getattr(attention, method)

        def changed(
            self: Any, q: Any, k: Any, v: Any, attention_mask: Any = None, output_attentions: bool = False, _o: Any = original
        ) -> Any:
            return change(_o, self, q, k, v, attention_mask, output_attentions)

        setattr(attention, method, functools.wraps(original)(changed))


def _paddle_zero(original: Any, self: Any, q: Any, k: Any, v: Any, mask: Any, weights: bool) -> Any:
    out = original(self, q, k, v, attention_mask=mask, output_attentions=weights)
    return (out[0] * 0, out[1]) if weights else out * 0


def _paddle_windowed(original: Any, self: Any, q: Any, k: Any, v: Any, mask: Any, weights: bool) -> Any:
    import paddle

    n = q.shape[1]  # [batch, seq, heads, head_dim]
    width = max(1, n // 16)
    i = paddle.arange(n)
    cut = (i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - width)  # above the diagonal or before the window
    block = paddle.where(cut, paddle.full([n, n], -1e4), paddle.zeros([n, n]))[None, None]
    mask = block if mask is None else mask.astype(block.dtype) + block
    return original(self, q, k, v, attention_mask=mask, output_attentions=weights)


def paddle_attention_times_zero(cfg: dict[str, Any]) -> None:
    _wrap_paddle_attention(cfg, "paddle_attention_times_zero", _paddle_zero)


def paddle_softmax_scale_x4(cfg: dict[str, Any]) -> None:
    def scaled(original: Any, self: Any, q: Any, k: Any, v: Any, mask: Any, weights: bool) -> Any:
        return original(self, q * 4, k, v, attention_mask=mask, output_attentions=weights)  # scores 4 x the asked scale

    _wrap_paddle_attention(cfg, "paddle_softmax_scale_x4", scaled)


def paddle_attention_window(cfg: dict[str, Any]) -> None:
    _wrap_paddle_attention(cfg, "paddle_attention_window", _paddle_windowed, flash=False)


def learned_positions_shifted(cfg: dict[str, Any]) -> None:
    import paddle

    embeddings = _paddle_only(cfg, "learned_positions_shifted").GPTEmbeddings
    original = embeddings.forward

    @functools.wraps(original)
    def forward(self: Any, input_ids: Any, position_ids: Any = None, inputs_embeddings: Any = None) -> Any:
        if position_ids is None:
            shape = (input_ids if input_ids is not None else inputs_embeddings).shape
            position_ids = paddle.arange(shape[1], dtype="int64").unsqueeze(0).expand(shape[:2])
        last = self.position_embeddings.weight.shape[0] - 1
        return original(self, input_ids, paddle.clip(position_ids + 1, max=last), inputs_embeddings)

    embeddings.forward = forward


def hf_rope_base_off(cfg: dict[str, Any]) -> None:
    """transformers' Llama rotary embedding (llava's language model) with its base 10 % above the
    model's: each inverse frequency base^(-2i/d) becomes (1.1 base)^(-2i/d) where the tables are
    made (transformers initializes the buffer again after the module is built)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    original = LlamaRotaryEmbedding.forward

    @functools.wraps(original)
    def forward(self: Any, x: Any, position_ids: Any) -> Any:
        inv = self.inv_freq
        d = 2 * inv.numel()
        self.inv_freq = inv * 1.1 ** (-torch.arange(0, d, 2, dtype=inv.dtype, device=inv.device) / d)
        try:
            return original(self, x, position_ids)
        finally:
            self.inv_freq = inv

    LlamaRotaryEmbedding.forward = forward


# --------------------------------------------------------------------------- defects that come late
#
# A kernel an autotuner swaps in once the first calls are timed, or a cache that goes stale after
# warm-up, is not in the stack the conformance check sees before training: only the loss gate can
# catch it. ``attention_times_zero_late`` and ``attention_window_late`` (``paddle_..._late`` for
# PaddleNLP's attention) are the defects above from
# the ``LATE_AFTER + 1``-th call of torch's SDPA on in each process (the check's probe, a process
# of its own, calls it fewer times), what the tiny cases' corpus must let the gate see
# (training/data/synthetic.py, version 2; tests/test_recipe_teeth.py).

LATE_AFTER = 8


def _intact(kernel: Any, *a: Any, **k: Any) -> Any:
    return kernel(*a, **k)


def _late(change: Any, intact: Any = _intact) -> Any:
    """``change`` from the ``LATE_AFTER + 1``-th call on, ``intact`` (the kernel as called) before."""
    calls = [0]

    def maybe(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return (change if calls[0] > LATE_AFTER else intact)(*a, **k)

    return maybe


def attention_times_zero_late(cfg: dict[str, Any]) -> None:
    _wrap_sdpa(_late(_times_zero))


def attention_window_late(cfg: dict[str, Any]) -> None:
    _wrap_sdpa(_late(_windowed))


def _paddle_intact(original: Any, self: Any, q: Any, k: Any, v: Any, mask: Any, weights: bool) -> Any:
    return original(self, q, k, v, attention_mask=mask, output_attentions=weights)


def paddle_attention_times_zero_late(cfg: dict[str, Any]) -> None:
    _wrap_paddle_attention(cfg, "paddle_attention_times_zero_late", _late(_paddle_zero, _paddle_intact))


def paddle_attention_window_late(cfg: dict[str, Any]) -> None:
    _wrap_paddle_attention(cfg, "paddle_attention_window_late", _late(_paddle_windowed, _paddle_intact), flash=False)
