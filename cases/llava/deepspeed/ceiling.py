"""The kernel ceiling of llava/deepspeed (training/ceiling.py), one per phase.

ZeRO data parallelism keeps every layer whole on every GPU (tp 1). One GPU's micro batch of
a phase is ``train.micro_batch`` samples of the phase's mean length ``T`` (text and image
tokens, no padding) with ``round(micro_batch * images_per_sample)`` images. ``T`` and the
images per sample are the case's stated assumptions, case.yaml's
``palm_assumptions.<phase>`` (``mean_seq_length``, ``images_per_sample``), the same values the
phase's PaLM FLOPs count with (training/flops_llava.py): the ceiling is timed before the
phase trains, when the mean length the phase measures (its ``phase_summary`` record) is not
known yet. The micro batch runs, by transformers' module names:

- the vision tower (CLIP, frozen, fed by data: forward only), every one of its layers
  (LLaVA reads the penultimate layer's output of a full forward): ``q_proj``, ``k_proj``,
  ``v_proj``, ``out_proj``, ``fc1``, ``fc2`` over the images' ``patches + 1`` positions, and
  its attention over the full length (no causal mask); the patch embedding's convolution
  once, as its matrix product (``3 * patch^2 -> width`` per patch);
- the projector (trained in both phases): ``linear_1`` forward and weight-gradient (its
  input, the vision tower's output, needs no gradient), ``linear_2`` every product, over the
  image tokens;
- the language model (LLaMA): per decoder layer ``q_proj``, ``k_proj``, ``v_proj``,
  ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj`` and once ``lm_head``, over the
  micro batch's tokens, and its causal attention, forward and backward. ``pretrain``: the
  language model is frozen, but the loss's gradient must cross it to reach the image tokens:
  forward and data-gradient products, no weight-gradient; ``finetune``: all three.

Attention is transformers' ``sdpa`` function (the one the model's ``_attn_implementation``
names, model.py's config) on ``[b, s, heads, d]`` projections, without a padding mask (so the
language model's is the causal kernel). Recompute is left out: the ceiling counts a step's
own kernels once.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cases.llava.deepspeed.settings import PHASES
from training import ceiling
from training.metriclog import MetricLogger

if TYPE_CHECKING:
    import torch

    from training.accelerator import Accelerator
    from training.settings import Common


def assumptions(shape: dict[str, Any], phase: str) -> tuple[float, float]:
    """(mean sample length, images per sample) of ``phase``: case.yaml's ``palm_assumptions``."""
    try:
        a = shape["palm_assumptions"][phase]
        mean, images = float(a["mean_seq_length"]), float(a["images_per_sample"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"model.shape.palm_assumptions.{phase}: mean_seq_length and images_per_sample are needed for the kernel ceiling ({exc!r})"
        ) from None
    if not 1 <= mean <= int(shape["seq_length"]) or images < 0:
        raise ValueError(
            f"model.shape.palm_assumptions.{phase}: mean_seq_length {mean} must be in 1..seq_length {shape['seq_length']}, "
            f"images_per_sample {images} >= 0"
        )
    return mean, images


def micro_batch_shape(shape: dict[str, Any], phase: str, micro_batch: int) -> dict[str, int]:
    """The sizes one micro batch of ``phase`` is timed at: its sample length, tokens, images,
    image tokens (patches) per image and vision positions (patches + class token)."""
    mean, per_sample = assumptions(shape, phase)
    length = round(mean)
    patches = (int(shape["image_size"]) // int(shape["patch_size"])) ** 2
    return {
        "seq_length": length,
        "tokens": micro_batch * length,
        "images": round(micro_batch * per_sample),
        "patches": patches,
        "vision_seq": patches + 1,
    }


def gemms(shape: dict[str, Any], phase: str, micro_batch: int) -> list[ceiling.Gemm]:
    """The phase's linear layers, with the products its step runs (module docstring)."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
    mb = micro_batch_shape(shape, phase, micro_batch)
    h, f, vocab, layers = (int(shape[k]) for k in ("hidden_size", "ffn_hidden_size", "vocab_size", "num_layers"))
    heads = int(shape["num_heads"])
    groups, d = int(shape.get("num_kv_groups") or heads), h // heads
    lm = ("fwd", "dgrad") if phase == "pretrain" else ceiling.PRODUCTS
    t = mb["tokens"]
    out = [
        ceiling.Gemm("lm.q_proj", t, heads * d, h, products=lm, count=layers),
        ceiling.Gemm("lm.k_proj", t, groups * d, h, products=lm, count=layers),
        ceiling.Gemm("lm.v_proj", t, groups * d, h, products=lm, count=layers),
        ceiling.Gemm("lm.o_proj", t, h, heads * d, products=lm, count=layers),
        ceiling.Gemm("lm.gate_proj", t, f, h, products=lm, count=layers),
        ceiling.Gemm("lm.up_proj", t, f, h, products=lm, count=layers),
        ceiling.Gemm("lm.down_proj", t, h, f, products=lm, count=layers),
        ceiling.Gemm("lm.lm_head", t, vocab, h, per_layer=False, products=lm),
    ]
    if mb["images"]:
        dv, fv, lv = (int(shape[k]) for k in ("vision_hidden_size", "vision_ffn_hidden_size", "vision_num_layers"))
        rows, tokens, p = mb["images"] * mb["vision_seq"], mb["images"] * mb["patches"], int(shape["patch_size"])
        fwd = ("fwd",)
        out += [
            ceiling.Gemm("vision.patch_embedding", tokens, dv, 3 * p * p, per_layer=False, products=fwd),
            *(ceiling.Gemm(f"vision.{n}", rows, dv, dv, products=fwd, count=lv) for n in ("q_proj", "k_proj", "v_proj", "out_proj")),
            ceiling.Gemm("vision.fc1", rows, fv, dv, products=fwd, count=lv),
            ceiling.Gemm("vision.fc2", rows, dv, fv, products=fwd, count=lv),
            ceiling.Gemm("projector.linear_1", tokens, h, dv, per_layer=False, products=("fwd", "wgrad")),
            ceiling.Gemm("projector.linear_2", tokens, h, h, per_layer=False),
        ]
    return out


def sdpa(shape: dict[str, Any], heads: int, groups: int, head_dim: int, causal: bool) -> Any:
    """transformers' attention function of the model's ``_attn_implementation`` (``sdpa``) as
    ``attend(q, k, v)``, without a mask, the module's causality given."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cases.llava.deepspeed import model

    fn = ALL_ATTENTION_FUNCTIONS[model.llava_config(shape)._attn_implementation]
    module = types.SimpleNamespace(is_causal=causal, num_key_value_groups=heads // groups)
    scale = head_dim**-0.5
    return lambda q, k, v: fn(module, q, k, v, None, dropout=0.0, scaling=scale, is_causal=causal)[0]


def attentions(shape: dict[str, Any], phase: str, micro_batch: int) -> list[ceiling.Attention]:
    """The language model's causal attention (forward and backward) and, with images, the
    vision tower's (full length, forward only)."""
    mb = micro_batch_shape(shape, phase, micro_batch)
    h, heads = int(shape["hidden_size"]), int(shape["num_heads"])
    groups, d = int(shape.get("num_kv_groups") or heads), h // heads
    kernel = "sdpa (transformers)"
    out = [
        ceiling.Attention(
            "lm.attention",
            sdpa(shape, heads, groups, d, causal=True),
            kernel,
            micro_batch,
            heads,
            groups,
            mb["seq_length"],
            d,
            count=int(shape["num_layers"]),
            layout="bshd",
        )
    ]
    if mb["images"]:
        vh = int(shape["vision_num_heads"])
        dv = int(shape["vision_hidden_size"]) // vh
        out.append(
            ceiling.Attention(
                "vision.attention",
                sdpa(shape, vh, vh, dv, causal=False),
                kernel,
                mb["images"],
                vh,
                vh,
                mb["vision_seq"],
                dv,
                count=int(shape["vision_num_layers"]),
                causal=False,
                backward=False,
                layout="bshd",
            )
        )
    return out


def kernel_ceiling(
    c: Common, shape: dict[str, Any], device: torch.device, accelerator: Accelerator | None = None, repeat: int = 5
) -> dict[str, Any]:
    """training/ceiling.py's ceiling of phase ``c.phase``'s micro batch on ``device``, timed and
    named by ``accelerator`` (the vendor's; default: the device type's calls)."""
    from training.deepspeed_loop import DTYPES

    phase, b = c.phase, c.train.micro_batch
    mean, per_sample = assumptions(shape, phase)
    mb = micro_batch_shape(shape, phase, b)
    about = {
        "phase": phase,
        "attention": "sdpa (transformers): language model causal, forward + backward; vision tower full length, forward",
        "micro_batch": b,
        "seq_length": mb["seq_length"],
        "mean_seq_length": mean,
        "seq_length_source": f"palm_assumptions.{phase}.mean_seq_length",
        "images_per_sample": per_sample,
        "images_per_micro_batch": mb["images"],
        "layers": int(shape["num_layers"]),
        "vision_layers": int(shape["vision_num_layers"]),
        "language_model": "frozen: forward and data-gradient products" if phase == "pretrain" else "trained: every product",
    }
    return ceiling.measure_parts(
        gemms(shape, phase, b),
        attentions(shape, phase, b),
        tokens=mb["tokens"],
        tp=1,
        dtype=DTYPES[c.train.precision],
        device=device,
        repeat=repeat,
        accelerator=accelerator,
        about=about,
        hold_s=c.train.ceiling_hold_s,
    )


def ceiling_only(cfg: dict, log: MetricLogger, phases: Iterable[str] = PHASES) -> None:
    """``--ceiling`` (start_task.py --ceiling): every phase's ceiling on this process's first
    device, one ``info`` record each (with its ``phase``); no process group, model or data."""
    from training import settings

    shape = settings.shape_source(cfg["model"])

    def measure(world: int, phase: str | None, device: torch.device, acc: Accelerator) -> dict[str, Any]:
        return kernel_ceiling(settings.from_config(cfg, world, phase), shape, device, acc)

    ceiling.record_alone(cfg, log, measure, phases)
