"""baichuan2/deepspeed's conformance probe: one decoder layer, the embedding and the NormHead
loss head of the case's own model (model.py), built with the run's precision and speed switches
(attention kernel, fused elementwise regions, recompute, fused linear loss), the vendor's adapter
and hooks already applied, run forward and backward once on seeded inputs; what it computed goes
to the reference (training/conformance/reference.py) in the probe file.

One process and no DeepSpeed engine: ZeRO partitions, gathers and reduces the same tensors (its
settings only place and schedule work, which the loss gate judges across layouts); the probe
checks the math of a step. ZeRO-3's own linear (``memory_efficient_linear``) is not built here.

The loss is the case's own (``causal_lm_loss``, or ``fused_loss`` under ``fused_linear_loss:
chunked``) with every label but those of the sampled positions ignored: the mean of the
per-token loss there, as the reference computes it. The per-token loss sent for comparison is
cross-entropy of the logits the NormHead made (the plain product again where the loss was
chunked).
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

from training.conformance.forking import torch_after_fork as after_fork  # noqa: F401 (the check forks the probe)


def before_fork(cfg: dict[str, Any]) -> None:
    """The probe's imports, made in the rank before it forks the probe (the build imports them next)."""
    import torch._dynamo  # noqa: F401 (the first forward imports it)

    from cases.baichuan2.deepspeed import model  # noqa: F401
    from training import deepspeed_loop  # noqa: F401


def probe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's config for a probe: one layer, one process, one sequence, no ZeRO (its
    settings schedule and place work only: no part of the check's key)."""
    one = copy.deepcopy(cfg)
    one["model"]["num_layers"] = 1
    one["parallel"] = {k: v for k, v in one["parallel"].items() if k != "zero"}
    one["train"].update(micro_batch=1, global_batch=1, gradient_accumulation_steps=None)
    return one


def probe(cfg: dict[str, Any], out: Any) -> None:
    """Fill ``out`` (training.conformance.export.ProbeFile's maker: ``out(spec, precision)``)."""
    import torch
    import torch.nn.functional as F

    from cases.baichuan2.deepspeed import model as case_model
    from cases.baichuan2.deepspeed import settings as case_settings
    from training.accelerator import Accelerator
    from training.conformance.export import log, sample_positions
    from training.deepspeed_loop import DTYPES

    log("imported")
    s = case_settings.from_config(probe_config(cfg), 1)
    c, shape, train = s.common, s.shape, s.common.train
    if shape["z_loss_weight"]:
        raise RuntimeError(f"conformance probe: model.z_loss_weight {shape['z_loss_weight']}: the reference has no z-loss")
    acc = Accelerator(cfg.get("vendor") or {})
    device = acc.device(0)
    dtype = DTYPES[train.precision]
    switches = case_model.speed_switches(c.sections["parallel"], shape["num_layers"])
    mcfg = case_model.Baichuan2Config.from_shape(shape, init_std=train.init_std, **switches)
    model = case_model.Baichuan2ForCausalLM(mcfg)
    if c.sections["parallel"].get("recompute", "none") != "none":  # as training/deepspeed_loop.py switches it on
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    params = dict(model.named_parameters())
    with torch.no_grad():  # drawn where they live, in float32, then as the run holds them
        for name, p in params.items():
            draw = torch.Generator(device=p.device).manual_seed(train.seed + zlib.crc32(name.encode()))
            w = torch.randn(p.shape, generator=draw, device=p.device, dtype=torch.float32)
            if p.dim() == 1:  # norm weights
                w = 1.0 + 0.1 * w
            elif name != "embed_tokens.weight":  # activations of order one: scores of unit spread
                w = w / p.shape[1] ** 0.5
            p.copy_(w)
    model.to(dtype)
    model.train()
    log("built")

    seq, vocab = shape["seq_length"], shape["vocab_size"]
    gen = torch.Generator().manual_seed(train.seed + 17)
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    labels = torch.randint(0, vocab, (1, seq), generator=gen)
    positions = sample_positions(seq)
    pos_t = torch.as_tensor(positions)
    sampled = torch.full_like(labels, -100)
    sampled[0, pos_t] = labels[0, pos_t]
    caught: dict[str, Any] = {}

    def keep(key: str, value: torch.Tensor) -> None:
        caught.setdefault(key, value.detach())  # the forward's, not a recomputation's

    layer = model.layers[0]
    layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: keep("attention", a[0]))
    layer.register_forward_hook(lambda m, a, o: keep("layer", o))
    model.norm.register_forward_hook(lambda m, a, o: keep("final_norm", o))
    loss = model(tokens.to(device), sampled.to(device))
    loss.float().backward()
    acc.synchronize(device)
    log("forward and backward")
    with torch.no_grad():
        z = caught["final_norm"][0, pos_t.to(device)]
        logits = F.linear(z, model.lm_head.normalized_weight())
        per_token = F.cross_entropy(logits.float(), labels[0, pos_t].to(device), reduction="none")

    heads, d = mcfg.num_heads, mcfg.head_dim
    f = out(
        {
            "family": "baichuan2",
            "positions": "alibi",
            "norm": "rms",
            "norm_eps": float(mcfg.norm_eps),
            "mlp": "swiglu",
            "head": "normhead",
            "heads": heads,
            "groups": heads,
            "head_dim": d,
            "seq_length": seq,
            "attention_kernel": switches["attention"],
        },
        train.precision,
    )
    rows, inverse = torch.unique(tokens[0], return_inverse=True)
    f.inputs(inverse.numpy(), labels[0].numpy(), positions)
    f.output("attention", caught["attention"][0, pos_t.to(device)])
    f.output("layer", caught["layer"][0, pos_t.to(device)])
    f.output("loss", per_token)

    def grad(p: torch.Tensor) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    emb = params["embed_tokens.weight"]
    f.embedding_rows(emb, emb.grad, rows)
    w_pack, g_pack = params["layers.0.self_attn.W_pack.weight"], grad(params["layers.0.self_attn.W_pack.weight"])
    h = mcfg.hidden_size
    for i, name in enumerate(("wq", "wk", "wv")):  # W_pack's rows: [q; k; v], each [heads * head_dim, hidden]
        f.parameter(name, w_pack.detach()[i * h : (i + 1) * h], g_pack[i * h : (i + 1) * h], salt=2 + i)
    for name, key, salt in (
        ("wo", "layers.0.self_attn.o_proj.weight", 7),
        ("w_gate", "layers.0.mlp.gate_proj.weight", 5),
        ("w_up", "layers.0.mlp.up_proj.weight", 6),
        ("w_down", "layers.0.mlp.down_proj.weight", 8),
        ("w_out", "lm_head.weight", 9),
        ("ln1", "layers.0.input_layernorm.weight", 10),
        ("ln2", "layers.0.post_attention_layernorm.weight", 11),
        ("lnf", "norm.weight", 12),
    ):
        p = params[key]
        f.parameter(name, p.detach(), grad(p), salt=salt)
    missing = (
        set(params)
        - {"embed_tokens.weight", "layers.0.self_attn.W_pack.weight"}
        - {
            k
            for k in params
            if k.endswith(("o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "layernorm.weight"))
            or k in ("lm_head.weight", "norm.weight")
        }
    )
    if missing:
        raise RuntimeError(f"conformance probe: parameters the reference does not read: {', '.join(sorted(missing))}")
