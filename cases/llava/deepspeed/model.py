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

Speed switches of the language model (:func:`apply_speed_switches`, the values checked by
``settings.speed_switches``; the defaults leave transformers' model as it is):

``fused_elementwise``     ``compile``: every LlamaRMSNorm (both of each decoder layer and
                          the final one) and the SwiGLU of every LlamaMLP run the same
                          arithmetic as ``torch.compile`` regions (``training/fused.py``; full
                          graph; the token dimension dynamic, since the collator pads each
                          micro-batch to its own length). The MLP's three projections stay eager: under ZeRO-3
                          their weights are gathered by hooks on those modules.
                          ``liger``: liger-kernel's Triton RMSNorm (casting mode ``llama``,
                          transformers' order; not in place) and SwiGLU
                          (``LigerSwiGLUMLP.forward``) bound to the same modules. CUDA only.
``fused_rope``            ``compile``: the rotary embedding of queries and keys in every
                          attention of the language model (transformers' ``apply_rotary_pos_emb``,
                          ``x * cos + rotate_half(x) * sin``) as one ``torch.compile`` region
                          (``training/fused.py``'s ``rope``; batch and sequence dynamic) instead
                          of eight eager kernels each way. transformers looks the function up in
                          its module at each call, so the switch sets it there for the process,
                          as each phase asks (``none`` puts transformers' own back).
``recompute_num_layers``  with ``recompute: full``, only the first K decoder layers of the
                          language model are recomputed in the backward; the others keep
                          their activations (the vision tower is untouched).
"""

from __future__ import annotations

import contextlib
import glob
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cases.llava.deepspeed.settings import FUSED_ELEMENTWISE, FUSED_ROPE
from training import fused, shapes

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


def num_image_tokens(shape: Any) -> int:
    sh = shapes.typed(shape, shapes.LlavaShape)
    return (sh.image_size // sh.patch_size) ** 2


def llava_config(shape: Any) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    sh = shapes.typed(shape, shapes.LlavaShape)
    vision = CLIPVisionConfig(
        hidden_size=sh.vision_hidden_size,
        intermediate_size=sh.vision_ffn_hidden_size,
        num_hidden_layers=sh.vision_num_layers,
        num_attention_heads=sh.vision_num_heads,
        image_size=sh.image_size,
        patch_size=sh.patch_size,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        projection_dim=768,  # CLIP's contrastive projection: LLaVA takes layer -2's states, so it is never built
    )
    text = LlamaConfig(
        hidden_size=sh.hidden_size,
        intermediate_size=sh.ffn_hidden_size,
        num_hidden_layers=sh.num_layers,
        num_attention_heads=sh.num_heads,
        num_key_value_heads=sh.kv_groups,
        vocab_size=sh.vocab_size,
        max_position_embeddings=sh.max_position_embeddings,
        rms_norm_eps=sh.norm_eps,
        rope_theta=sh.rope_base,
        # no padding_idx: its row init indexes the weight, which is empty under deepspeed.zero.Init;
        # padded positions are masked from attention and loss, so the row gets no gradient anyway
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=None,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=sh.image_token_index,
        image_seq_length=num_image_tokens(sh),
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


# --------------------------------------------------------------------------- speed switches


def _compiled_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm's order: normalize in float32, round to the input's dtype, then scale
    out = fused.compiled(fused.rms_norm, dynamic=True)(fused.token_rows(hidden_states), self.weight, self.variance_epsilon)
    return out.view(hidden_states.shape)


def _compiled_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    out = fused.compiled(fused.swiglu, dynamic=True)(fused.token_rows(gate), fused.token_rows(up))
    return self.down_proj(out.view(gate.shape))


def _compiled_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: Any = None, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    if position_ids is not None or unsqueeze_dim != 1:  # another transformers' call: not what fused.rope computes
        raise RuntimeError(
            f"parallel.fused_rope: compile expects apply_rotary_pos_emb(q, k, cos, sin) on [batch, heads, seq, dim], "
            f"got position_ids={position_ids is not None}, unsqueeze_dim={unsqueeze_dim}: use fused_rope: none"
        )
    q, k = fused.seq_rows(q, k, seq_dim=2)
    cos, sin = fused.seq_rows(cos, sin, seq_dim=1)
    return fused.compiled(fused.rope, dynamic=True)(q, k, cos, sin)


#: transformers' own rotary embedding, as its module had it when this module was imported
_EAGER_ROPE: Callable[..., Any] | None = None


def _set_rope(fused_rope: str) -> None:
    """Point transformers' llama module at the rotary embedding ``fused_rope`` names."""
    global _EAGER_ROPE
    from transformers.models.llama import modeling_llama

    if _EAGER_ROPE is None:
        _EAGER_ROPE = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = _compiled_rope if fused_rope == "compile" else _EAGER_ROPE


def _liger_forwards() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """liger-kernel's RMSNorm and SwiGLU MLP forwards (liger_kernel.transformers)."""
    try:
        from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP
    except ImportError as exc:
        raise RuntimeError(
            f"parallel.fused_elementwise: liger needs liger-kernel (and triton): {exc}; "
            "install it (pip install liger-kernel==0.8.5) or choose none or compile"
        ) from exc
    return LigerRMSNorm.forward, LigerSwiGLUMLP.forward


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The LlamaModel inside LlavaForConditionalGeneration (its decoder layers and final norm)."""
    return model.model.language_model


def apply_speed_switches(
    model: torch.nn.Module, fused_elementwise: str = "none", recompute_num_layers: int | None = None, fused_rope: str = "none"
) -> dict[str, int]:
    """Apply the language model's speed switches to a built model (partitioned by ZeRO-3 or
    not), before the DeepSpeed engine starts; returns how many norms, MLPs and attentions
    (their rotary embedding) were changed.

    ``fused_elementwise`` binds a new ``forward`` to every LlamaRMSNorm and LlamaMLP of the
    language model (the parameters stay where they are). ``recompute_num_layers`` wraps the
    model's ``gradient_checkpointing_enable`` (what ``training.deepspeed_loop`` calls for
    ``recompute: full``) so that it leaves layers K and up without recompute.
    """
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    if fused_elementwise not in FUSED_ELEMENTWISE:
        raise ValueError(f"parallel.fused_elementwise must be one of {', '.join(FUSED_ELEMENTWISE)}, got {fused_elementwise!r}")
    if fused_rope not in FUSED_ROPE:
        raise ValueError(f"parallel.fused_rope must be one of {', '.join(FUSED_ROPE)}, got {fused_rope!r}")
    _set_rope(fused_rope)
    lm = language_model(model)
    norms = [m for m in lm.modules() if isinstance(m, LlamaRMSNorm)]
    mlps = [m for m in lm.modules() if isinstance(m, LlamaMLP)]
    if fused_elementwise != "none":
        act = lm.config.hidden_act
        if act != "silu":
            raise ValueError(f"parallel.fused_elementwise: {fused_elementwise} fuses SwiGLU; the language model's hidden_act is {act!r}")
        if fused_elementwise == "compile":
            norm_forward, mlp_forward = _compiled_norm_forward, _compiled_mlp_forward
        else:
            norm_forward, mlp_forward = _liger_forwards()
            for m in norms:  # what LigerRMSNorm.forward reads besides weight and variance_epsilon
                m.offset, m.casting_mode, m.in_place, m.row_mode = 0.0, "llama", False, None
        for m in norms:
            m.forward = types.MethodType(norm_forward, m)
            m.fused_elementwise = fused_elementwise
        for m in mlps:
            m.forward = types.MethodType(mlp_forward, m)
            m.fused_elementwise = fused_elementwise
    if recompute_num_layers is not None:
        layers = list(lm.layers)
        if not 0 <= recompute_num_layers <= len(layers):
            raise ValueError(f"parallel.recompute_num_layers must be null or 0..{len(layers)}, got {recompute_num_layers!r}")
        enable = model.gradient_checkpointing_enable

        def enable_first_layers(*args: Any, **kwargs: Any) -> None:
            enable(*args, **kwargs)
            for layer in layers[recompute_num_layers:]:
                layer.gradient_checkpointing = False

        model.gradient_checkpointing_enable = enable_first_layers
    changed = fused_elementwise != "none"
    attentions = len(lm.layers) if fused_rope != "none" else 0
    return {"norms": len(norms) if changed else 0, "mlps": len(mlps) if changed else 0, "ropes": attentions}


def recomputed_layers(model: torch.nn.Module) -> list[bool]:
    """Whether each decoder layer of the language model is recomputed in the backward."""
    return [bool(layer.gradient_checkpointing) for layer in language_model(model).layers]


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
