"""Parameters and FLOPs per token of LLaVA-1.5 (CLIP ViT + MLP projector + LLaMA), per phase.

Called by the host side as ``llava_flops(model, phase)`` with the case.yaml
``models.<name>`` mapping; standard library only.

``flops_per_token_6n``: FlagPerf's llava1.5_7b convention (seed 002), with N
the nominal parameter count (7e9 for llava1.5_7b):

* ``pretrain`` = 2·N: FlagPerf credits the pretrain stage with 2·N per token
  (one forward) because only the projector is trained; 2·7e9·4013 tok/p/s on
  an A800 (312 TFLOP/s bf16) gives the seed's 18.01 %;
* ``finetune`` = 6·N: 6·7e9·2937 / 312e12 gives 39.5 % (seed: 39.57 %; the
  seed's throughput is a rounded figure).

``flops_per_token_palm``: what each phase really computes, counted the way
PaLM (appendix B) counts: 2 FLOPs per multiply-accumulate of every matmul
(embedding lookups, norms, activations and the softmax are not counted), and
attention as ``QK^T`` + ``AV`` over the full (non-causal) length.  A token is
one position of the language model's sequence (text + image tokens, no
padding), the unit the case's throughput is measured in.  Per sample of mean
length T with I images (model["palm_assumptions"][phase]):

* vision tower (frozen, forward only, every layer runs: LLaVA takes the
  penultimate layer's output from a full forward), per image over
  S = patches + 1 positions: ``2·S·Lv·(4·dv² + 2·dv·fv) + 2·patches·3·p²·dv +
  4·Lv·S²·dv``;
* projector (``linear_1`` dv->d, GELU, ``linear_2`` d->d; trained in both
  phases), per image token: forward ``2·(P1+P2)``, weight grads
  ``2·(P1+P2)``, data grad of ``linear_2`` only ``2·P2`` (the vision output
  needs no gradient);
* language model, per token, N_lm its matmul parameters (layers + output
  layer):
  - pretrain (frozen, but the loss's gradient must reach the image tokens'
    embeddings): forward ``2·N_lm`` + data grads ``2·N_lm`` (no weight
    grads) + attention ``4·L·d·T`` forward and ``8·L·d·T`` backward;
  - finetune: ``6·N_lm + 12·L·d·T`` (PaLM's formula).

Per token = LM + I·(vision + patches·projector)/T.  Not counted: padding to
the longest sample of a micro-batch (depends on batching), recompute when
activation checkpointing is on (PaLM's convention: model FLOPs, not hardware
FLOPs).  T and I are properties of the data set, not of the model: the values
in ``shape.palm_assumptions`` are the case's stated assumptions and the palm figure
is only as exact as they are; train.py reports the measured mean length and
images per sample in each phase's summary.
"""

from __future__ import annotations

from typing import Any

from training.flops import param_counts
from training.shapes import LlavaShape, typed

PHASES = ("pretrain", "finetune")


def vision_params(shape: dict[str, Any] | LlavaShape) -> dict[str, int]:
    """CLIP vision tower, exact: matmul params per layer and the total."""
    s = typed(shape, LlavaShape)
    dv, fv, lv, p = s.vision_hidden_size, s.vision_ffn_hidden_size, s.vision_num_layers, s.patch_size
    patches = (s.image_size // p) ** 2
    layer_matmul = 4 * dv * dv + 2 * dv * fv
    layer = layer_matmul + 4 * dv + fv + dv + 2 * 2 * dv  # + q,k,v,o biases, fc biases, two layernorms
    conv = 3 * p * p * dv
    embeddings = conv + dv + (patches + 1) * dv  # patch conv (no bias), class embedding, positions
    total = embeddings + 2 * dv + lv * layer + 2 * dv  # pre- and post-layernorm
    return {"patches": patches, "layer_matmul": layer_matmul, "conv": conv, "total": total}


def projector_params(shape: dict[str, Any] | LlavaShape) -> dict[str, int]:
    s = typed(shape, LlavaShape)
    dv, d = s.vision_hidden_size, s.hidden_size
    p1, p2 = dv * d, d * d
    return {"linear_1": p1, "linear_2": p2, "total": p1 + d + p2 + d}


def llava_params(shape: dict[str, Any] | LlavaShape) -> dict[str, int]:
    s = typed(shape, LlavaShape)
    lm = param_counts(s)
    v, pr = vision_params(s), projector_params(s)
    return {"vision": v["total"], "projector": pr["total"], "language_model": lm["total"], "total": v["total"] + pr["total"] + lm["total"]}


def palm_flops_per_token(model: dict, phase: str) -> dict[str, float]:
    """The palm count of one phase, by part (per token), and the total."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    shape = typed(model["shape"], LlavaShape)
    if phase not in shape.palm_assumptions:
        raise ValueError(f"model.shape.palm_assumptions has no {phase!r}")
    assume = shape.palm_assumptions[phase]
    t, images = float(assume["mean_seq_length"]), float(assume["images_per_sample"])
    n_lm = param_counts(shape)["non_embedding"]
    lm_attn_fwd = 4.0 * shape.num_layers * shape.hidden_size * t
    if phase == "pretrain":
        lm = 4.0 * n_lm + 3.0 * lm_attn_fwd
    else:
        lm = 6.0 * n_lm + 3.0 * lm_attn_fwd
    v = vision_params(shape)
    dv, lv = shape.vision_hidden_size, shape.vision_num_layers
    s_v = v["patches"] + 1
    vision = 2.0 * s_v * lv * v["layer_matmul"] + 2.0 * v["patches"] * v["conv"] + 4.0 * lv * s_v * s_v * dv
    pr = projector_params(shape)
    projector = 4.0 * (pr["linear_1"] + pr["linear_2"]) + 2.0 * pr["linear_2"]  # per image token
    per_image = vision + v["patches"] * projector
    return {
        "language_model": lm,
        "vision": images * vision / t,
        "projector": images * v["patches"] * projector / t,
        "total": lm + images * per_image / t,
    }


def llava_flops(model: dict, phase: str) -> dict:
    """The case.yaml counter: ``flops: training.flops_llava:llava_flops``."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    n = float(model["params_nominal"])
    parts = llava_params(model["shape"])
    return {
        "params_exact": parts["total"],
        # pretrain trains the projector alone; finetune the projector and the language model
        "params_trainable": parts["projector"] + (0 if phase == "pretrain" else parts["language_model"]),
        "params_nominal": n,
        "flops_per_token_6n": (2.0 if phase == "pretrain" else 6.0) * n,
        "flops_per_token_palm": palm_flops_per_token(model, phase)["total"],
    }
