"""llava/deepspeed's conformance probe: the vision tower, the projector, one decoder layer of the
language model, its embedding and loss head, built as the run builds them (model.py: transformers'
LlavaForConditionalGeneration from the case's shape, SDPA attention, the language model's speed
switches; the vendor's adapter and hooks already applied), in the run's precision, run forward and
backward once on a seeded image and tokens; what it computed goes to the reference
(training/conformance/reference.py) in the probe file.

One process, no DeepSpeed engine (ZeRO partitions the states, not the math). The tower keeps two
encoder layers, as the penultimate layer's output (``vision_feature_layer: -2``) then comes from
its first; the language model keeps one. The loss is the model's own (transformers' shifted
cross-entropy), on the sampled positions alone (every other label ignored). Both phases run the
same step: pretrain freezes all but the projector, which changes what is updated, not the math.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import numpy as np

from training.conformance.forking import torch_after_fork as after_fork  # noqa: F401 (the check forks the probe)


def before_fork(cfg: dict[str, Any]) -> None:
    """The probe's imports, made in the rank before it forks the probe (the build imports them next)."""
    from transformers import LlavaForConditionalGeneration  # noqa: F401

    from cases.llava.deepspeed import model  # noqa: F401


def probe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's config for a probe: one language-model layer, a two-layer vision tower, no
    schedule switches (the probe builds neither ZeRO nor recompute)."""
    one = copy.deepcopy(cfg)
    one["model"].update(num_layers=1, vision_num_layers=2)
    par = one["parallel"]
    for key, value in (("zero_stage", 0), ("recompute", "none"), ("recompute_num_layers", None), ("offload_optimizer", False)):
        if key in par:
            par[key] = value
    one["train"].update(micro_batch=1, global_batch=1)
    one["train"].pop("phases", None)
    return one


def probe(cfg: dict[str, Any], out: Any) -> None:
    """Fill the probe file (``out(spec, precision)`` makes it)."""
    import torch
    import torch.nn.functional as F

    from cases.llava.deepspeed import model as llava_model
    from training.accelerator import Accelerator
    from training.conformance.export import log, sample_positions

    log("imported")
    one = probe_config(cfg)
    shape = {k: v for k, v in one["model"].items() if k not in ("name", "params_nominal")}
    precision = str(one["train"].get("precision", "bf16"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    acc = Accelerator(cfg.get("vendor") or {})
    device = acc.device(0)
    model = llava_model.build_model(shape, dtype, device)
    switches = {k: (one["parallel"].get(k) or "none") for k in ("fused_elementwise", "fused_rope")}
    llava_model.apply_speed_switches(model, **switches)
    model.train()
    log("built")
    seed = int(one["train"].get("seed", 1234))
    params = dict(model.named_parameters())
    with torch.no_grad():  # drawn where they live; activations of order one
        for name, p in params.items():
            draw = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
            w = torch.randn(p.shape, generator=draw, device=p.device, dtype=torch.float32)
            if name.endswith("bias"):
                w = 0.1 * w
            elif p.dim() == 1 and ("norm" in name or "layrnorm" in name):
                w = 1.0 + 0.1 * w
            elif "embed_tokens" in name or "class_embedding" in name or "position_embedding" in name:
                pass
            else:
                w = w / (p[0].numel() ** 0.5)  # a linear's or the patch convolution's fan-in
            p.copy_(w.to(p.dtype))
    seq, vocab = int(shape["seq_length"]), int(shape["vocab_size"])
    image_token = int(shape["image_token_index"])
    n_img = llava_model.num_image_tokens(shape)
    gen = torch.Generator().manual_seed(seed + 29)
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    tokens[tokens == image_token] = (image_token + 1) % vocab
    image_positions = list(range(1, 1 + n_img))
    tokens[0, image_positions] = image_token
    size = int(shape["image_size"])
    pixels = torch.randn((1, 3, size, size), generator=gen)
    positions = sample_positions(seq - 1)  # the last position predicts nothing
    targets = torch.randint(0, vocab, (seq,), generator=gen)
    labels = torch.full((1, seq), -100, dtype=torch.long)
    labels[0, torch.as_tensor(positions) + 1] = targets[torch.as_tensor(positions)]  # transformers shifts by one
    caught: dict[str, Any] = {}
    lm = llava_model.language_model(model)
    layer = lm.layers[0]
    layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: caught.__setitem__("attention", a[0]))
    layer.register_forward_hook(lambda m, a, o: caught.__setitem__("layer", o[0] if isinstance(o, tuple) else o))
    result = model(
        input_ids=tokens.to(device),
        pixel_values=pixels.to(device, dtype),
        attention_mask=torch.ones_like(tokens).to(device),
        labels=labels.to(device),
    )
    result.loss.backward()
    acc.synchronize(device)
    log("forward and backward")
    pos_t = torch.as_tensor(positions, device=device)
    vcfg = model.config.vision_config
    text = model.config.text_config
    heads, groups = int(text.num_attention_heads), int(text.num_key_value_heads)
    f = out(
        {
            "family": "llava1.5",
            "positions": "rope",
            "rope_base": float(shape.get("rope_base", 10000.0)),
            "norm": "rms",
            "norm_eps": float(shape.get("norm_eps", 1e-5)),
            "mlp": "swiglu",
            "head": "plain",
            "heads": heads,
            "groups": groups,
            "head_dim": int(text.hidden_size) // heads,
            "seq_length": seq,
            "vision": {
                "patch_size": int(vcfg.patch_size),
                "heads": int(vcfg.num_attention_heads),
                "norm_eps": float(vcfg.layer_norm_eps),
                "image_positions": image_positions,
            },
        },
        precision,
    )
    rows, inverse = torch.unique(tokens[0], return_inverse=True)
    f.inputs(inverse.numpy(), targets.numpy(), positions)
    f.add_array("param:pixels", pixels[0].to(dtype).float().numpy())  # as the tower reads them
    f.output("attention", caught["attention"][0, pos_t])
    f.output("layer", caught["layer"][0, pos_t])
    logits = result.logits[0, pos_t].float()
    f.output("loss", F.cross_entropy(logits, targets.to(device)[pos_t], reduction="none"))

    def find(suffix: str) -> torch.Tensor:
        hits = [p for n, p in params.items() if n.endswith(suffix)]
        if len(hits) != 1:
            raise RuntimeError(f"conformance probe: {len(hits)} parameters end in {suffix!r} (have {', '.join(params)})")
        return hits[0]

    def send(name: str, suffix: str, salt: int, value: Any = None) -> None:
        p = find(suffix)
        f.parameter(name, p.detach() if value is None else value, p.grad, salt=salt)

    emb = find("embed_tokens.weight")
    f.embedding_rows(emb, emb.grad, rows)
    lm_names = {
        "wq": "language_model.layers.0.self_attn.q_proj.weight",
        "wk": "language_model.layers.0.self_attn.k_proj.weight",
        "wv": "language_model.layers.0.self_attn.v_proj.weight",
        "wo": "language_model.layers.0.self_attn.o_proj.weight",
        "ln1": "language_model.layers.0.input_layernorm.weight",
        "ln2": "language_model.layers.0.post_attention_layernorm.weight",
        "w_gate": "language_model.layers.0.mlp.gate_proj.weight",
        "w_up": "language_model.layers.0.mlp.up_proj.weight",
        "w_down": "language_model.layers.0.mlp.down_proj.weight",
        "lnf": "language_model.norm.weight",
        "w_out": "lm_head.weight",
    }
    for salt, (name, suffix) in enumerate(lm_names.items(), start=2):
        send(name, suffix, salt)
    tower = "vision_tower.vision_model." if any("vision_tower.vision_model." in n for n in params) else "vision_tower."
    patch = find(tower + "embeddings.patch_embedding.weight")
    f.parameter(
        "v_patch",
        patch.detach().reshape(patch.shape[0], -1),
        None if patch.grad is None else patch.grad.reshape(patch.shape[0], -1),
        salt=20,
    )
    vision_names = {
        "v_cls": "embeddings.class_embedding",
        "v_pos": "embeddings.position_embedding.weight",
        "v_pre_ln": "pre_layrnorm.weight",
        "v_pre_ln_bias": "pre_layrnorm.bias",
        "v_ln1": "encoder.layers.0.layer_norm1.weight",
        "v_ln1_bias": "encoder.layers.0.layer_norm1.bias",
        "v_wq": "encoder.layers.0.self_attn.q_proj.weight",
        "v_bq": "encoder.layers.0.self_attn.q_proj.bias",
        "v_wk": "encoder.layers.0.self_attn.k_proj.weight",
        "v_bk_value": "",
        "v_wv": "encoder.layers.0.self_attn.v_proj.weight",
        "v_bv": "encoder.layers.0.self_attn.v_proj.bias",
        "v_wo": "encoder.layers.0.self_attn.out_proj.weight",
        "v_bo": "encoder.layers.0.self_attn.out_proj.bias",
        "v_ln2": "encoder.layers.0.layer_norm2.weight",
        "v_ln2_bias": "encoder.layers.0.layer_norm2.bias",
        "v_fc1": "encoder.layers.0.mlp.fc1.weight",
        "v_bfc1": "encoder.layers.0.mlp.fc1.bias",
        "v_fc2": "encoder.layers.0.mlp.fc2.weight",
        "v_bfc2": "encoder.layers.0.mlp.fc2.bias",
    }
    for salt, (name, suffix) in enumerate(vision_names.items(), start=21):
        if name == "v_bk_value":  # the key's bias: softmax drops a constant q . bk, so its true gradient is zero
            f.add_array("param:v_bk", np.asarray(find(tower + "encoder.layers.0.self_attn.k_proj.bias").detach().float().cpu().numpy()))
            continue
        send(name, tower + suffix, salt)
    for salt, (name, suffix) in enumerate(
        {"p_w1": "linear_1.weight", "p_b1": "linear_1.bias", "p_w2": "linear_2.weight", "p_b2": "linear_2.bias"}.items(), start=50
    ):
        send(name, "multi_modal_projector." + suffix, salt)
