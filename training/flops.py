"""Parameter counts, FLOPs per token and MFU, under two conventions.

``6n``   FlagPerf's convention: 6 x nominal N FLOPs per token (N is the round
         number in the model's name, e.g. 8e9 for llama3_8b).
``palm`` PaLM's (Chowdhery et al. 2022, appendix B): 6N + 12·L·H·Q·T FLOPs per
         token, N the exact parameter count without the input embedding
         table, L layers, H heads, Q head size, T sequence length.

Mixture-of-experts decoders (``num_experts`` > 0 in the shape): every token passes the router
and ``moe_top_k`` of the experts, so the FLOPs count the *active* parameters (the 6N
convention takes ``params_active_nominal`` from case.yaml where given, else the exact active
count), while memory (training/memory.py) holds *all* of them (``params_exact``).

Standard library only: imported by cases inside every framework environment
and by the host side.
"""

from __future__ import annotations

from training.shapes import ModelShape, read


def param_counts(s: ModelShape) -> dict[str, int]:
    """Exact parameter counts by part."""
    h, kv = s.hidden_size, s.kv_groups * s.head_dim
    norm_params = h * (2 if s.norm == "layernorm" else 1)
    attn = h * h + 2 * h * kv + h * h  # q, k, v, o
    attn += sum(width for part, width in (("q", h), ("k", kv), ("v", kv), ("o", h)) if s.biased(part))
    ffn = (s.moe_ffn_hidden_size or s.ffn_hidden_size) if s.num_experts else s.ffn_hidden_size
    mlp = (3 if s.gated_mlp else 2) * h * ffn
    if s.biased("mlp"):
        mlp += ffn * (2 if s.gated_mlp else 1) + h
    experts, idle = 0, 0  # per layer: all experts' parameters; those a token does not pass
    if s.num_experts:
        experts, idle = s.num_experts * mlp, (s.num_experts - s.moe_top_k) * mlp
        mlp = h * s.num_experts + experts  # the router, then the experts
    layer = attn + mlp + 2 * norm_params
    embedding = s.vocab_size * h
    positions = s.seq_length * h if s.learned_positions else 0
    output = 0 if s.tied_embeddings else s.vocab_size * h
    total = embedding + positions + s.num_layers * layer + norm_params + output
    # PaLM counts the output projection (a matmul per token) but not the
    # input lookup table, which costs no matmul FLOPs.
    non_embedding = total - embedding - positions + (embedding if s.tied_embeddings else 0)
    return {
        "embedding": embedding,
        "positions": positions,
        "per_layer": layer,
        "layers": s.num_layers * layer,
        "final_norm": norm_params,
        "output": output,
        "total": total,
        "experts": s.num_layers * experts,
        "active": total - s.num_layers * idle,  # what one token passes through
        "non_embedding": non_embedding,
        "non_embedding_active": non_embedding - s.num_layers * idle,
    }


def flops_per_token_6n(params_nominal: float) -> float:
    return 6.0 * params_nominal


def attention_flops_per_token_palm(num_layers: int, num_heads: int, head_dim: int, seq_length: int) -> float:
    return 12.0 * num_layers * num_heads * head_dim * seq_length


def flops_per_token_palm(s: ModelShape) -> float:
    n = param_counts(s)["non_embedding_active"]
    return 6.0 * n + attention_flops_per_token_palm(s.num_layers, s.num_heads, s.head_dim, s.seq_length)


def mfu(flops_per_token: float, tokens_per_gpu_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction; None when the peak is unknown."""
    if not peak_flops or tokens_per_gpu_s is None or flops_per_token <= 0:
        return None
    return flops_per_token * tokens_per_gpu_s / peak_flops


def decoder_shape(shape: dict) -> ModelShape:
    """The shape of a case.yaml ``shape`` mapping or of resolved.json's ``model`` (other keys
    ignored, an absent flag taking its default: training/shapes.py)."""
    return read(shape)


def decoder_flops(model: dict, phase: str = "train") -> dict:
    """The counter named ``decoder`` in case.yaml: a decoder-only LM.

    ``model`` is the case.yaml ``models.<name>`` mapping (``shape`` and
    ``params_nominal``; for experts also ``params_active_nominal``).  Every counter
    returns the first four keys; a mixture of experts adds ``params_active``, which
    its 6N FLOPs count instead of ``params_nominal``.
    """
    s = decoder_shape(model["shape"])
    counts = param_counts(s)
    out = {
        "params_exact": counts["total"],
        "params_nominal": float(model["params_nominal"]),
        "flops_per_token_6n": flops_per_token_6n(float(model["params_nominal"])),
        "flops_per_token_palm": flops_per_token_palm(s),
    }
    if s.num_experts:
        active = float(model.get("params_active_nominal") or counts["active"])
        out.update(params_active=counts["active"], params_experts=counts["experts"], flops_per_token_6n=flops_per_token_6n(active))
    return out
