"""llama3/megatron's conformance probe: one decoder layer, the embedding and the loss head, built
as the run builds them (modeling.py: the layer spec, core attention, norms, RoPE and loss of the
run's switches, the vendor's adapter and hooks already applied, the run's precision, sequence
length and widths), run forward and backward once on seeded inputs; what it computed goes to
the reference (training/conformance/reference.py) in the probe file.

One process, tensor and pipeline parallel size 1: the check is of the math of a step, not of
its collectives, which the loss gate judges across layouts.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

from training.conformance.forking import torch_after_fork as after_fork  # noqa: F401 (the check forks the probe)

# parallel switches that only schedule or place work: a one-layer, one-process probe runs without them
_SCHEDULE_ONLY = {
    "tp": 1,
    "pp": 1,
    "sequence_parallel": False,
    "tp_comm_overlap": "none",
    "recompute": "none",
    "distributed_optimizer": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "optimizer_cpu_offload": False,
    "overlap_cpu_optimizer_d2h_h2d": False,
    "offload_pinned_copy": False,
}


def before_fork(cfg: dict[str, Any]) -> None:
    """The probe's imports, made in the rank before it forks the probe (the build imports them next)."""
    from cases.llama3.megatron import kernels, modeling  # noqa: F401


def probe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's config for a probe: one layer, one process, one sequence."""
    one = copy.deepcopy(cfg)
    one["model"]["num_layers"] = 1
    one["parallel"].update({k: v for k, v in _SCHEDULE_ONLY.items() if k in one["parallel"] or k in ("tp", "pp")})
    one["train"].update(micro_batch=1, global_batch=1)
    return one


def probe(cfg: dict[str, Any], out: Any) -> None:
    """Fill ``out`` (training.conformance.export.ProbeFile's maker: ``out(spec, precision)``)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from cases.llama3.megatron import kernels, modeling
    from cases.llama3.megatron.settings import from_config
    from training.accelerator import Accelerator
    from training.conformance.export import log, sample_positions

    log("imported")

    s = from_config(probe_config(cfg), 1)
    sh, train = s.shape, s.common.train
    acc = Accelerator(cfg.get("vendor") or {})
    device = acc.device(0)
    if not dist.is_initialized():
        dist.init_process_group(backend=s.common.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(train.seed)
    tconfig = modeling.transformer_config(s)
    if s.layout.gradient_accumulation_fusion:
        kernels.install_wgrad_accumulation(device, modeling.DTYPES[train.precision])
    model = modeling.build_model(s, tconfig)
    log("built")
    gen = torch.Generator().manual_seed(train.seed + 17)
    params = dict(model.named_parameters())
    with torch.no_grad():  # drawn where they live (the reference gets them as they are)
        for name, p in params.items():
            draw = torch.Generator(device=p.device).manual_seed(train.seed + zlib.crc32(name.encode()))
            w = torch.randn(p.shape, generator=draw, device=p.device, dtype=torch.float32)
            if p.dim() == 1:  # norm weights
                w = 1.0 + 0.1 * w
            elif "word_embeddings" not in name:  # activations stay of order one: scores of unit spread, so scale and mask matter
                w = w / p.shape[1] ** 0.5
            p.copy_(w.to(p.dtype))
    if train.precision in ("bf16", "fp16"):
        model = Float16Module(tconfig, model)
    for p in params.values():
        if getattr(p, "main_grad", None) is None and s.layout.gradient_accumulation_fusion:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    seq, vocab = sh.seq_length, sh.vocab_size
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    labels = torch.randint(0, vocab, (1, seq), generator=gen)
    positions = sample_positions(seq)
    caught: dict[str, Any] = {}
    layer = model.module.decoder.layers[0] if hasattr(model, "module") else model.decoder.layers[0]
    layer.self_attention.core_attention.register_forward_hook(lambda m, a, o: caught.__setitem__("attention", o))
    layer.register_forward_hook(lambda m, a, o: caught.__setitem__("layer", o[0] if isinstance(o, tuple) else o))
    pos_t = torch.as_tensor(positions, device=device)
    losses = model(tokens.to(device), torch.arange(seq, device=device)[None], None, labels=labels.to(device))
    loss = losses[0, pos_t].float().mean()
    loss.backward()
    acc.synchronize(device)
    log("forward and backward")

    f = out(
        {
            "family": "llama3",
            "positions": "rope",
            "rope_base": float(sh.rope_base),
            "norm": "rms",
            "norm_eps": float(sh.norm_eps),
            "mlp": "swiglu",
            "head": "plain",
            "heads": sh.num_heads,
            "groups": sh.num_kv_groups,
            "head_dim": sh.hidden_size // sh.num_heads,
            "seq_length": seq,
            "attention_kernel": modeling.attention_kernel(s),
        },
        train.precision,
    )
    rows, inverse = torch.unique(tokens[0], return_inverse=True)
    f.inputs(inverse.numpy(), labels[0].numpy(), positions)
    f.output("attention", caught["attention"][pos_t, 0])
    f.output("layer", caught["layer"][pos_t, 0])
    f.output("loss", losses[0, pos_t].float())
    heads, groups, d = sh.num_heads, sh.num_kv_groups, sh.hidden_size // sh.num_heads
    per = heads // groups

    def grad(p: torch.Tensor) -> torch.Tensor:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        main = getattr(p, "main_grad", None)
        return g.float() + main if main is not None else g

    def find(suffix: str) -> torch.Tensor:
        hits = [p for n, p in params.items() if n.endswith(suffix)]
        if len(hits) != 1:
            raise RuntimeError(f"conformance probe: {len(hits)} parameters end in {suffix!r} (have {', '.join(params)})")
        return hits[0]

    def first(*suffixes: str) -> torch.Tensor:
        for suffix in suffixes:
            if any(n.endswith(suffix) for n in params):
                return find(suffix)
        raise RuntimeError(f"conformance probe: no parameter ends in any of {suffixes}")

    emb = find("word_embeddings.weight")
    f.embedding_rows(emb, grad(emb), rows)
    qkv = find("linear_qkv.weight")  # per query group: its query heads, its key, its value (megatron's layout)
    g_qkv = grad(qkv)
    hidden = qkv.shape[1]

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = t.reshape(groups, per + 2, d, hidden)
        return t[:, :per].reshape(heads * d, hidden), t[:, per].reshape(groups * d, hidden), t[:, per + 1].reshape(groups * d, hidden)

    for (name, value), (_, g) in zip(zip(("wq", "wk", "wv"), split(qkv.detach())), zip(("wq", "wk", "wv"), split(g_qkv))):
        f.parameter(name, value, g, salt=2 + ("wq", "wk", "wv").index(name))
    fc1 = find("linear_fc1.weight")  # [gate; up]
    ffn = fc1.shape[0] // 2
    g_fc1 = grad(fc1)
    f.parameter("w_gate", fc1.detach()[:ffn], g_fc1[:ffn], salt=5)
    f.parameter("w_up", fc1.detach()[ffn:], g_fc1[ffn:], salt=6)
    for name, suffix, salt in (("wo", "linear_proj.weight", 7), ("w_down", "linear_fc2.weight", 8), ("w_out", "output_layer.weight", 9)):
        p = find(suffix)
        f.parameter(name, p.detach(), grad(p), salt=salt)
    for name, suffixes, salt in (
        ("ln1", ("input_layernorm.weight", "linear_qkv.layer_norm_weight"), 10),
        ("ln2", ("pre_mlp_layernorm.weight", "linear_fc1.layer_norm_weight"), 11),
        ("lnf", ("final_layernorm.weight",), 12),
    ):
        p = first(*suffixes)
        f.parameter(name, p.detach(), grad(p), salt=salt)
    dist.destroy_process_group()
