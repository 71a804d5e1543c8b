"""Parameter counts, FLOPs per token and MFU, under two conventions.

``6n``   FlagPerf's convention: 6 x nominal N FLOPs per token (N is the round
         number in the model's name, e.g. 8e9 for llama3_8b).
``palm`` PaLM's (Chowdhery et al. 2022, appendix B): 6N + 12·L·H·Q·T FLOPs per
         token, N the exact parameter count without the input embedding
         table, L layers, H heads, Q head size, T sequence length.

Standard library only: imported by cases inside every framework environment
and by the host side.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """Shape of a decoder-only transformer, enough to count its parameters."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int
    num_kv_groups: int | None = None  # None: multi-head attention (groups == heads)
    gated_mlp: bool = True  # SwiGLU: three matrices; plain GELU MLP: two
    tied_embeddings: bool = False
    bias: bool = False  # linear biases (GPT-3 has them)
    norm: str = "rmsnorm"  # rmsnorm: weight only; layernorm: weight + bias
    learned_positions: bool = False  # GPT-3's position embedding table

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_groups(self) -> int:
        return self.num_kv_groups or self.num_heads


def param_counts(s: DecoderShape) -> dict[str, int]:
    """Exact parameter counts by part."""
    h, kv = s.hidden_size, s.kv_groups * s.head_dim
    norm_params = h * (2 if s.norm == "layernorm" else 1)
    attn = h * h + 2 * h * kv + h * h  # q, k, v, o
    if s.bias:
        attn += h + 2 * kv + h
    mlp = (3 if s.gated_mlp else 2) * h * s.ffn_hidden_size
    if s.bias:
        mlp += s.ffn_hidden_size * (2 if s.gated_mlp else 1) + h
    layer = attn + mlp + 2 * norm_params
    embedding = s.vocab_size * h
    positions = s.seq_length * h if s.learned_positions else 0
    output = 0 if s.tied_embeddings else s.vocab_size * h
    total = embedding + positions + s.num_layers * layer + norm_params + output
    return {
        "embedding": embedding,
        "positions": positions,
        "per_layer": layer,
        "layers": s.num_layers * layer,
        "final_norm": norm_params,
        "output": output,
        "total": total,
        # PaLM counts the output projection (a matmul per token) but not the
        # input lookup table, which costs no matmul FLOPs.
        "non_embedding": total - embedding - positions + (embedding if s.tied_embeddings else 0),
    }


def flops_per_token_6n(params_nominal: float) -> float:
    return 6.0 * params_nominal


def attention_flops_per_token_palm(num_layers: int, num_heads: int, head_dim: int, seq_length: int) -> float:
    return 12.0 * num_layers * num_heads * head_dim * seq_length


def flops_per_token_palm(s: DecoderShape) -> float:
    n = param_counts(s)["non_embedding"]
    return 6.0 * n + attention_flops_per_token_palm(s.num_layers, s.num_heads, s.head_dim, s.seq_length)


def mfu(flops_per_token: float, tokens_per_gpu_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction; None when the peak is unknown."""
    if not peak_flops or tokens_per_gpu_s is None or flops_per_token <= 0:
        return None
    return flops_per_token * tokens_per_gpu_s / peak_flops


_SHAPE_FIELDS = {f.name for f in dataclasses.fields(DecoderShape)}


def decoder_shape(shape: dict) -> DecoderShape:
    """A DecoderShape from a case.yaml ``shape`` mapping (extra keys ignored)."""
    return DecoderShape(**{k: v for k, v in shape.items() if k in _SHAPE_FIELDS})


def decoder_flops(model: dict, phase: str = "train") -> dict:
    """The counter named ``decoder`` in case.yaml: a decoder-only LM.

    ``model`` is the case.yaml ``models.<name>`` mapping (``shape`` and
    ``params_nominal``).  Every counter returns these four keys.
    """
    s = decoder_shape(model["shape"])
    return {
        "params_exact": param_counts(s)["total"],
        "params_nominal": float(model["params_nominal"]),
        "flops_per_token_6n": flops_per_token_6n(float(model["params_nominal"])),
        "flops_per_token_palm": flops_per_token_palm(s),
    }
