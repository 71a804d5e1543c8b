"""LLaVA-1.5 built from the case's shape with transformers, and real weights loaded from paths.

The model is ``transformers.LlavaForConditionalGeneration`` from a
``LlavaConfig`` of a ``CLIPVisionConfig`` and a ``LlamaConfig`` (nothing is
downloaded), SDPA attention everywhere, a 2-layer GELU MLP projector.

Starting weights: :func:`init_rule` (transformers' initialization) drawn by
``training.deepspeed_weights``, then, where ``data`` names checkpoints (all
optional):

``model_path``           a LLaVA checkpoint folder: llava-hf layout (either
                         generation of its key names) or LLaVA's original
                         (``model.mm_projector.0/2``);
``vision_tower_path``    a CLIP checkpoint (``vision_model.*``; the text tower is skipped);
``language_model_path``  a LLaMA/Vicuna checkpoint (``model.*``, ``lm_head``).

Files are ``*.safetensors`` or ``pytorch_model*.bin``. An embedding or output
matrix with fewer rows than the model's vocabulary (Vicuna's 32000 against
llava-hf's 32064, which adds the image and pad tokens) fills the first rows.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: checkpoint key prefix -> (part, prefix that replaces it), first match wins
_RULES = (
    ("model.vision_tower.vision_tower.vision_model.", "vision"),
    ("model.vision_tower.vision_model.", "vision"),
    ("vision_tower.vision_model.", "vision"),
    ("model.vision_tower.", "vision"),
    ("vision_tower.", "vision"),
    ("vision_model.", "vision"),
    ("text_model.", None),
    ("model.mm_projector.0.", "projector:linear_1."),
    ("model.mm_projector.2.", "projector:linear_2."),
    ("model.multi_modal_projector.", "projector"),
    ("multi_modal_projector.", "projector"),
    ("model.language_model.model.", "lm"),
    ("language_model.model.", "lm"),
    ("model.language_model.", "lm"),
    ("language_model.lm_head.", "lm_head"),
    ("lm_head.", "lm_head"),
    ("model.", "lm"),
)


def canonical(key: str) -> str | None:
    """``part/rest`` for a model or checkpoint key, None for keys of no part of LLaVA."""
    for prefix, part in _RULES:
        if key.startswith(prefix):
            if part is None:
                return None
            rest = key[len(prefix) :]
            if ":" in part:
                part, sub = part.split(":")
                rest = sub + rest
            if part == "vision" and rest.startswith("vision_model."):
                rest = rest[len("vision_model.") :]
            return f"{part}/{rest}"
    return None


def num_image_tokens(shape: dict) -> int:
    return (int(shape["image_size"]) // int(shape["patch_size"])) ** 2


def llava_config(shape: dict) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=int(shape["vision_hidden_size"]),
        intermediate_size=int(shape["vision_ffn_hidden_size"]),
        num_hidden_layers=int(shape["vision_num_layers"]),
        num_attention_heads=int(shape["vision_num_heads"]),
        image_size=int(shape["image_size"]),
        patch_size=int(shape["patch_size"]),
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        projection_dim=int(shape.get("vision_projection_dim", 768)),
    )
    text = LlamaConfig(
        hidden_size=int(shape["hidden_size"]),
        intermediate_size=int(shape["ffn_hidden_size"]),
        num_hidden_layers=int(shape["num_layers"]),
        num_attention_heads=int(shape["num_heads"]),
        num_key_value_heads=int(shape.get("num_kv_groups") or shape["num_heads"]),
        vocab_size=int(shape["vocab_size"]),
        max_position_embeddings=int(shape["seq_length"]),
        rms_norm_eps=float(shape.get("norm_eps", 1e-5)),
        rope_theta=float(shape.get("rope_base", 10000.0)),
        # no padding_idx: its row init indexes the weight, which is empty under deepspeed.zero.Init;
        # padded positions are masked from attention and loss, so the row gets no gradient anyway
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=None,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=int(shape["image_token_index"]),
        image_seq_length=num_image_tokens(shape),
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    shape: dict, dtype: torch.dtype, device: torch.device, init_context: contextlib.AbstractContextManager | None = None
) -> torch.nn.Module:
    """The model in ``dtype``, built inside ``init_context`` (``deepspeed.zero.Init``, which
    places the parameters) when one is given, else on ``device``."""
    # imported before zero.Init: importing transformers' model code under it fails
    from transformers import LlavaForConditionalGeneration

    cfg = llava_config(shape)
    place = init_context if init_context is not None else torch.device(device)
    with _default_dtype(dtype), place:
        model = LlavaForConditionalGeneration(cfg)
    return model


def init_rule(shape: dict) -> Callable[[str], Any]:
    """transformers' own initialization of this model, parameter by parameter, for
    ``training.deepspeed_weights.starting_weights``, which draws it the same under every
    layout (under ``deepspeed.zero.Init`` transformers' init writes into empty tensors).

    Biases zeros, norm weights ones. CLIP's vision tower (``CLIPPreTrainedModel._init_weights``,
    width w, L layers, all times initializer_factor): class embedding w**-0.5; q/k/v
    w**-0.5 (2L)**-0.5; out_proj w**-0.5; fc1 (2w)**-0.5; fc2 w**-0.5 (2L)**-0.5; patch and
    position embeddings initializer_range. Projector, language model and lm_head: the text
    config's initializer_range (``PreTrainedModel._init_weights``).
    """
    from training.deepspeed_weights import ONES, ZEROS, Normal

    cfg = llava_config(shape)
    vc, factor = cfg.vision_config, cfg.vision_config.initializer_factor
    w, layers = vc.hidden_size, vc.num_hidden_layers
    deep = w**-0.5 * (2 * layers) ** -0.5 * factor
    vision = {
        "class_embedding": w**-0.5 * factor,
        "q_proj.weight": deep,
        "k_proj.weight": deep,
        "v_proj.weight": deep,
        "out_proj.weight": w**-0.5 * factor,
        "fc1.weight": (2 * w) ** -0.5 * factor,
        "fc2.weight": deep,
        "patch_embedding.weight": vc.initializer_range * factor,
        "position_embedding.weight": vc.initializer_range * factor,
    }
    text_std = cfg.text_config.initializer_range

    def rule(name: str) -> Any:
        module = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if name.endswith(".bias"):
            return ZEROS
        if "norm" in module:  # layer_norm1/2, pre_layrnorm, post_layernorm, input_layernorm, norm
            return ONES
        if (canonical(name) or "").startswith("vision/"):
            for suffix, std in vision.items():
                if name.endswith(suffix):
                    return Normal(std)
            raise KeyError(f"{name}: no initialization rule for this vision tower parameter")
        return Normal(text_std)

    return rule


def trainable(phase: str) -> Callable[[str], bool]:
    """pretrain: the projector only; finetune: projector + language model (the vision tower stays frozen)."""
    if phase == "pretrain":
        return lambda name: (canonical(name) or "").startswith("projector/")
    return lambda name: not (canonical(name) or "vision/").startswith("vision/")


def _checkpoint_tensors(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    """Key -> loader of every tensor of a checkpoint folder (or file)."""
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")) + glob.glob(os.path.join(path, "*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weights under {path}")
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for f in files:
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():
                    out[k] = lambda f=f, k=k: safe_open(f, framework="pt").get_tensor(k)
        else:
            sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
            for k in sd:
                out[k] = lambda sd=sd, k=k: sd[k]
    return out


def load_pretrained(model: torch.nn.Module, data: dict, initial: Callable[[str, Any], torch.Tensor]) -> dict[str, Any]:
    """Fill ``model`` (partitioned or not) from the paths in ``data``.

    ``initial(name, param)`` is the parameter's full starting value: rows a smaller
    checkpoint vocabulary leaves out keep it. Returns
    ``{"sources": [...], "loaded": n, "not_loaded": [canonical names]}``.
    """
    from training.deepspeed_weights import full_shape, write_full

    sources = [data[k] for k in ("model_path", "vision_tower_path", "language_model_path") if data.get(k)]
    if not sources:
        return {"sources": [], "loaded": 0, "not_loaded": []}
    found: dict[str, Callable[[], torch.Tensor]] = {}
    for src in sources:
        for key, get in _checkpoint_tensors(src).items():
            c = canonical(key)
            if c is not None:
                found[c] = get
    names = {n: canonical(n) for n, _ in model.named_parameters()}
    loaded = 0
    for name, p in model.named_parameters():  # the same order on every rank
        if names[name] not in found:
            continue
        src, shape = found[names[name]](), full_shape(p)
        if tuple(src.shape) == shape:
            full = src
        elif src.dim() == 2 and src.shape[1] == shape[1] and src.shape[0] < shape[0]:
            full = initial(name, p)
            full[: src.shape[0]].copy_(src)  # vocabulary rows
        else:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(src.shape)} does not fit the model's {shape}: the case.yaml shape must match the weights"
            )
        write_full(p, full, name)
        loaded += 1
    return {"sources": sources, "loaded": loaded, "not_loaded": sorted(c for n, c in names.items() if c not in found)}


def copy_model(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """Copy every parameter of ``src`` into ``dst`` (either partitioned or not); the same on every rank."""
    from training.deepspeed_weights import read_full, write_full

    params = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        write_full(p, read_full(params[name]), name)
    return len(params)
