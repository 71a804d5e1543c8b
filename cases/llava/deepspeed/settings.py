"""What the llava/deepspeed case reads from ``resolved.json`` beyond training/settings.py:
its model shape and its speed switches.

The shape is read through training/shapes.py's ``LlavaShape`` (:func:`shape`); the language model
transformers builds is LLaMA's, so a shape with other flags (:data:`LLAVA_FLAGS`) is refused.

The common train / parallel / data / vendor keys of each phase are read by
``training.settings.from_config`` (the phase's sections overlaid with their
``phases.<phase>`` entries), the ZeRO section by the shared loop
(``training.deepspeed_loop.zero_section``), the data keys by ``train.py``. This module reads
the ``parallel`` switches of the language model (model.py applies them), per phase, so
``parallel.phases.finetune.recompute_num_layers`` reaches the finetune phase alone:

* ``fused_elementwise``: ``none`` (default: transformers' eager LlamaRMSNorm and SwiGLU MLP)
  | ``compile`` (both as torch.compile regions) | ``liger`` (liger-kernel's Triton kernels;
  CUDA only, refused with both keys named on any other ``vendor.device``);
* ``fused_rope``: ``none`` (default: transformers' eager rotary embedding) | ``compile`` (one
  torch.compile region for queries and keys);
* ``recompute_num_layers``: null (default: with ``recompute: full`` every decoder layer of the
  language model is recomputed) or K in 0..num_layers (only the first K are); it needs the
  phase's ``recompute: full``.

Standard library only, so the host-side tests import it. Every error names the key.
"""

from __future__ import annotations

from typing import Any

from training import settings as common
from training import shapes
from training.settings import Common, SettingsError

PHASES = ("pretrain", "finetune")  # one round trains both, in this order
FUSED_ELEMENTWISE = ("none", "compile", "liger")
FUSED_ROPE = ("none", "compile")
#: the language model model.py builds (transformers' LlamaForCausalLM): what a shape must say
LLAVA_FLAGS = shapes.LLAMA


def shape(model: dict[str, Any]) -> shapes.LlavaShape:
    """The model's shape (flat in resolved.json's ``model`` or under ``model.shape``), checked to
    be the LLaMA language model and CLIP tower model.py builds."""
    return shapes.built(model, LLAVA_FLAGS, "the llava case's LLaMA language model", shapes.LlavaShape)


def check_device(fused_elementwise: str, device: str) -> None:
    """Switches whose kernels exist on CUDA devices only."""
    if fused_elementwise == "liger" and device != "cuda":
        raise SettingsError(
            f"parallel.fused_elementwise: liger runs liger-kernel's Triton kernels, which need vendor.device: cuda "
            f"(this vendor's device is {device}); use none or compile"
        )


def speed_switches(c: Common, num_layers: int) -> dict[str, Any]:
    """``{"fused_elementwise", "recompute_num_layers", "fused_rope"}`` of the phase ``c`` was read for, checked
    against the language model's ``num_layers``, the phase's ``recompute`` and the vendor's device;
    absent keys take today's path (``none``, every layer recomputed)."""
    par = c.sections["parallel"]
    fused = par.get("fused_elementwise")
    fused = "none" if fused is None else fused
    if fused not in FUSED_ELEMENTWISE:
        raise SettingsError(f"parallel.fused_elementwise must be one of {', '.join(FUSED_ELEMENTWISE)}, got {fused!r} (phase {c.phase})")
    check_device(fused, c.device)
    layers = par.get("recompute_num_layers")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= num_layers:
            raise SettingsError(
                f"parallel.recompute_num_layers must be null or 0..{num_layers} (decoder layers of the language model), "
                f"got {layers!r} (phase {c.phase})"
            )
        if c.parallel.recompute != "full":
            raise SettingsError(
                f"parallel.recompute_num_layers ({layers}) needs parallel.recompute: full, but the {c.phase} phase's "
                f"recompute is {c.parallel.recompute}"
            )
    rope = par.get("fused_rope")
    rope = "none" if rope is None else rope
    if rope not in FUSED_ROPE:
        raise SettingsError(f"parallel.fused_rope must be one of {', '.join(FUSED_ROPE)}, got {rope!r} (phase {c.phase})")
    return {"fused_elementwise": fused, "recompute_num_layers": layers, "fused_rope": rope}


def check(cfg: dict[str, Any], world_size: int) -> None:
    """Every phase's settings and speed switches as its ranks read them, for ``world_size``
    ranks: the ranks run it before the first phase trains, the harness before launch (case.yaml's
    ``settings``)."""
    num_layers = shape(cfg["model"]).num_layers
    for phase in PHASES:
        speed_switches(common.from_config(cfg, world_size, phase), num_layers)
        check_data(common.phase_sections(cfg, phase)["data"], phase)


#: the values the reader (training/data/llava.py) takes for the phase's data keys
TEMPLATES, ASPECTS, MISSING = ("plain", "vicuna_v1"), ("square", "pad"), ("fail", "skip")


def check_data(data: dict[str, Any], phase: str) -> None:
    """A phase's data keys as its reader takes them: a value it cannot use is refused, never replaced."""
    where = f"data.phases.{phase}"
    common.choice(data.get("template"), f"{where}.template", TEMPLATES)
    common.choice(data.get("image_aspect_ratio", "square"), f"{where}.image_aspect_ratio", ASPECTS)
    common.choice(data.get("missing_images") or "fail", "data.missing_images", MISSING)
    common.integer(data.get("num_workers", 0), "data.num_workers", 0)
    common.integer(data.get("synthetic_seed", 1234), "data.synthetic_seed", 0)
