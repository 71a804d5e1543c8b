"""The output layer and the cross-entropy loss in one step, a chunk of tokens at a time.

The plain path (``logits = x @ W^T``, then the loss on ``logits.float()``) keeps the whole
``[tokens, vocab]`` logits alive in bf16 and float32, and their gradient in both again: at
16,384 tokens and a vocabulary of 125,696 that is about 25 GiB on one GPU. Here the forward
goes through the tokens ``chunk`` rows at a time and, for each chunk, computes the logits, the
loss and the loss's gradient with respect to them at once, turns that gradient into the
chunk's gradient of ``x`` and its share of the gradient of ``W`` (the same two products the
backward of the plain path runs), and lets the logits go. The backward only scales the stored
gradients by the incoming one. Peak extra memory: one chunk's logits in float32 (a few of
them) plus the gradient of ``W`` in float32, instead of every token's logits.

The arithmetic follows the plain path: logits from a matrix product in the inputs' dtype,
rounded to it (on CUDA with bf16 / fp16 inputs the GEMM writes them in float32 instead, one
kernel fewer and one rounding fewer: training/gemm.py), then cross-entropy in float32 (mean
over the tokens whose label is not ``ignore_index``) plus an optional z-loss ``z * mean over
all tokens of (max logit)^2``; the logits' gradient is rounded to the inputs' dtype before the
two products, as autograd does through ``.float()``. The gradient of ``W`` is summed over
chunks in float32 (inside each chunk's GEMM) and rounded once, so it differs from the plain
path's single product by rounding only.

Torch only; nothing of a framework. Used by a case's output layer where
``parallel.fused_linear_loss: chunked`` asks for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from training import gemm

#: tokens per chunk unless the caller says otherwise
DEFAULT_CHUNK = 2048


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        ignore_index: int,
        z_loss_weight: float,
    ) -> torch.Tensor:
        n = x.shape[0]
        valid = int((labels != ignore_index).sum())
        grad_x = torch.empty_like(x) if x.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, n, chunk):
            xc, lc = x[start : start + chunk], labels[start : start + chunk]
            logits = gemm.float32_product(xc, weight.t())  # float32 out of the GEMM on CUDA; elsewhere rounded, then widened
            keep = lc != ignore_index
            safe = torch.where(keep, lc, torch.zeros_like(lc))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            if valid:
                total += ((lse - picked) * keep).sum() / valid
            top = logits.max(-1) if z_loss_weight else None
            if top is not None:
                total += z_loss_weight * top.values.pow(2).sum() / n
            if grad_x is None and grad_w is None:
                continue
            # d loss / d logits: (softmax - one-hot) / valid on kept rows, plus the z-loss's term
            g = torch.softmax(logits, dim=-1)
            g.scatter_add_(1, safe[:, None], -torch.ones_like(picked)[:, None])
            g *= (keep.float() / max(valid, 1))[:, None]
            if top is not None:
                g.scatter_add_(1, top.indices[:, None], (2 * z_loss_weight / n * top.values)[:, None])
            g = g.to(x.dtype)
            del logits
            if grad_x is not None:
                grad_x[start : start + chunk] = g @ weight
            if grad_w is not None:
                gemm.accumulate_product(grad_w, g.t(), xc)  # summed in float32 inside the GEMM
        ctx.save_for_backward(grad_x, grad_w)
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_x, grad_w = ctx.saved_tensors
        dx = None if grad_x is None else grad_x * grad_out.to(grad_x.dtype)
        dw = None if grad_w is None else (grad_w * grad_out).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk: int = DEFAULT_CHUNK,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight^T`` against ``labels`` (plus the z-loss), computed
    ``chunk`` tokens at a time. ``x``: ``[..., hidden]``; ``weight``: ``[vocab, hidden]``;
    ``labels``: ``x``'s leading shape, ``ignore_index`` where no loss is taken."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    flat = x.reshape(-1, x.shape[-1])
    return _LinearCrossEntropy.apply(flat, weight, labels.reshape(-1), int(chunk), int(ignore_index), float(z_loss_weight))


def plain_linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, z_loss_weight: float = 0.0
) -> torch.Tensor:
    """The unfused path the chunked one follows: logits, widened to float32, cross-entropy."""
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight).float()
    loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index)
    if z_loss_weight:
        loss = loss + z_loss_weight * logits.max(-1).values.pow(2).mean()
    return loss
