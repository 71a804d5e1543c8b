"""Baichuan2 (7B/13B family, ALiBi variant) written with plain torch.

The published Baichuan2-13B is remote code on a model hub; this is the same
architecture written for the benchmark, with no framework import:

- token embedding (untied from the output layer);
- ``num_layers`` pre-norm decoder layers: RMSNorm -> multi-head attention with
  a fused ``W_pack`` (q, k, v) projection, no biases, ALiBi position bias
  (no position parameters) -> residual; RMSNorm -> SwiGLU MLP
  (``down(silu(gate(x)) * up(x))``) -> residual;
- a final RMSNorm (eps 1e-6);
- ``NormHead``: the output layer whose weight rows (one per vocabulary entry)
  are L2-normalized before the matmul, in every forward pass during training.

Attention runs through ``torch.nn.functional.scaled_dot_product_attention``
with the ALiBi bias passed as an additive float mask that already holds the
causal mask (``-inf`` above the diagonal).  The bias is ``slope_h * (j - i)``
for key ``j`` and query ``i``; the published code uses ``slope_h * j``, which
differs by a per-row constant and therefore gives the same softmax, but
``j - i`` keeps the values near the diagonal small, where a bf16 mask is most
precise.

Speed switches (``parallel`` settings, read by :func:`speed_switches`; the
defaults are the plain path above):

- ``fused_elementwise``: ``none`` | ``compile``.  ``compile`` runs the same
  RMSNorm and SwiGLU functions (``training/fused.py``) as ``torch.compile``
  regions (full graph, static shapes, Inductor on GPUs): each is one kernel per
  direction, and SwiGLU keeps only its two inputs for the backward.
- ``attention``: ``sdpa`` | ``flex``.  ``flex`` runs torch's FlexAttention
  (compiled with ``training.fused.compiled``, static shapes) with the ALiBi bias as a score modification and the causal mask
  as a block mask: no ``[heads, seq, seq]`` mask in memory, fully masked
  blocks skipped.  The bias is added in float32 (the ``sdpa`` path adds it
  rounded to the activation dtype).  FlexAttention has no CPU backward.
- ``recompute_num_layers``: with ``recompute: full``, only the first N decoder
  layers are recomputed in the backward (null: all of them); the others keep
  their activations.
- ``fused_linear_loss``: ``none`` | ``chunked``.  ``chunked`` computes the
  NormHead product and the loss (with the z-loss) ``training/fused_loss.py``'s
  way: 2,048 tokens at a time, each chunk's gradients made in the forward, so
  the ``[tokens, vocab]`` logits are never held whole (at micro batch 8 and
  vocabulary 125,696: 16,384 x 125,696 values, in bf16 and float32, twice).
  Same arithmetic as the plain path; the output weight's gradient is summed
  over chunks in float32.

Importable without DeepSpeed: the case's ``train.py`` builds the model inside
``deepspeed.zero.Init`` when ZeRO stage 3 is on, and the unit tests build it
directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training import fused, fused_loss

ATTENTION = ("sdpa", "flex")
FUSED_ELEMENTWISE = ("none", "compile")
FUSED_LINEAR_LOSS = ("none", "chunked")
#: tokens per chunk of ``fused_linear_loss: chunked``
LOSS_CHUNK = 2048


@dataclasses.dataclass
class Baichuan2Config:
    num_layers: int = 40
    hidden_size: int = 5120
    num_heads: int = 40
    ffn_hidden_size: int = 13696
    vocab_size: int = 125696
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-6
    init_std: float = 0.02
    z_loss_weight: float = 0.0  # Baichuan2's max-z auxiliary loss; 0 turns it off
    gradient_checkpointing: bool = False
    checkpoint_reentrant: bool = True
    attention: str = "sdpa"  # sdpa | flex
    fused_elementwise: str = "none"  # none | compile
    recompute_num_layers: int | None = None  # with checkpointing on: the first N layers (None: all)
    fused_linear_loss: str = "none"  # none | chunked

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_shape(cls, shape: dict[str, Any], **overrides: Any) -> Baichuan2Config:
        """From a case.yaml ``shape`` mapping (unknown keys such as ``seq_length`` ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in shape.items() if k in names}
        kwargs.update(overrides)
        cfg = cls(**kwargs)
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads}")
        speed_switches(
            {
                "attention": cfg.attention,
                "fused_elementwise": cfg.fused_elementwise,
                "recompute_num_layers": cfg.recompute_num_layers,
                "fused_linear_loss": cfg.fused_linear_loss,
            },
            cfg.num_layers,
        )
        return cfg


def speed_switches(parallel: dict[str, Any], num_layers: int | None = None) -> dict[str, Any]:
    """The model's speed switches from a phase's ``parallel`` settings, checked; absent keys
    take the plain path (``attention: sdpa``, ``fused_elementwise: none``, every layer
    recomputed, ``fused_linear_loss: none``). A bad value is a ValueError naming the key."""
    attention = parallel.get("attention") or "sdpa"
    if attention not in ATTENTION:
        raise ValueError(f"parallel.attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    fused = parallel.get("fused_elementwise") or "none"
    if fused not in FUSED_ELEMENTWISE:
        raise ValueError(f"parallel.fused_elementwise must be one of {', '.join(FUSED_ELEMENTWISE)}, got {fused!r}")
    layers = parallel.get("recompute_num_layers")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0 or (num_layers is not None and layers > num_layers):
            bound = f"0..{num_layers}" if num_layers is not None else "an integer >= 0"
            raise ValueError(f"parallel.recompute_num_layers must be null or {bound}, got {layers!r}")
    loss = parallel.get("fused_linear_loss") or "none"
    if loss not in FUSED_LINEAR_LOSS:
        raise ValueError(f"parallel.fused_linear_loss must be one of {', '.join(FUSED_LINEAR_LOSS)}, got {loss!r}")
    return {"attention": attention, "fused_elementwise": fused, "recompute_num_layers": layers, "fused_linear_loss": loss}


# --------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi head slopes (Press et al. 2022), as Baichuan2 uses them.

    For a power of two ``n`` the slopes are the geometric sequence that starts
    at ``2 ** (-8 / n)`` with that same ratio.  Otherwise, with ``c`` the largest
    power of two below ``n``: the ``c`` slopes of ``c`` heads, then every other
    slope of ``2c`` heads (indices 0, 2, 4, ...), taking the first ``n - c``.
    """
    if num_heads < 1:
        raise ValueError("num_heads must be positive")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def alibi_causal_mask(num_heads: int, seq_len: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """Additive attention mask ``[1, heads, seq, seq]``: ALiBi bias with the causal mask folded in."""
    slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32, device=device)
    pos = torch.arange(seq_len, dtype=torch.float32, device=device)
    rel = pos[None, :] - pos[:, None]  # j - i: 0 on the diagonal, negative for past keys
    bias = slopes[:, None, None] * rel[None, :, :]
    bias = bias.masked_fill(rel[None, :, :] > 0, float("-inf"))
    return bias.unsqueeze(0).to(dtype)


# --------------------------------------------------------------------------- layers


class Linear(nn.Linear):
    """A bias-free linear layer initialized N(0, std) in its own constructor.

    Every leaf module initializes its parameters when it is built, so that the
    model can be built inside ``deepspeed.zero.Init``, which partitions each
    module's parameters as soon as its constructor returns.
    """

    def __init__(self, in_features: int, out_features: int, std: float):
        self._init_std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self._init_std)


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, std: float):
        self._init_std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self._init_std)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, fused: str = "none"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Baichuan2's order: normalize in float32, round, then scale (training/fused.py)
        fn = fused.compiled(fused.rms_norm) if self.fused == "compile" else fused.rms_norm
        return fn(x, self.weight, self.eps)


@dataclasses.dataclass(frozen=True)
class FlexAlibi:
    """What the ``flex`` attention needs, made once per sequence length and device: the
    ALiBi score modification (``score + slope_h * (j - i)``) and the causal block mask."""

    score_mod: Callable[..., torch.Tensor]
    block_mask: Any


def flex_alibi(num_heads: int, seq_len: int, device: torch.device | str) -> FlexAlibi:
    from torch.nn.attention.flex_attention import create_block_mask

    slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32, device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return FlexAlibi(alibi, create_block_mask(causal, None, None, seq_len, seq_len, device=device))


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: FlexAlibi) -> torch.Tensor:
    """FlexAttention, compiled, on contiguous ``[b, heads, s, head_dim]`` inputs."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return fused.compiled(flex)(q.contiguous(), k.contiguous(), v.contiguous(), score_mod=bias.score_mod, block_mask=bias.block_mask)


class Attention(nn.Module):
    def __init__(self, cfg: Baichuan2Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.W_pack = Linear(cfg.hidden_size, 3 * cfg.hidden_size, cfg.init_std)
        self.o_proj = Linear(cfg.hidden_size, cfg.hidden_size, cfg.init_std)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | FlexAlibi) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.W_pack(x).view(b, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        if isinstance(mask, FlexAlibi):
            out = flex_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        out = out.transpose(1, 2).reshape(b, s, self.hidden_size)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: Baichuan2Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std)
        self.up_proj = Linear(cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_std)
        self.down_proj = Linear(cfg.ffn_hidden_size, cfg.hidden_size, cfg.init_std)
        self.fused = cfg.fused_elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = fused.compiled(fused.swiglu) if self.fused == "compile" else fused.swiglu
        return self.down_proj(fn(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Baichuan2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.fused_elementwise)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.fused_elementwise)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | FlexAlibi) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class NormHead(nn.Module):
    """Output layer with L2-normalized weight rows (one row per vocabulary entry).

    In training the rows are normalized in every forward pass, so gradients
    flow through the normalization.  In eval mode the normalized weight is
    computed once and cached until ``train()`` is called again.
    """

    def __init__(self, hidden_size: int, vocab_size: int, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        nn.init.normal_(self.weight, 0.0, std)
        self._eval_weight: torch.Tensor | None = None

    def train(self, mode: bool = True) -> NormHead:
        self._eval_weight = None
        return super().train(mode)

    def normalized_weight(self) -> torch.Tensor:
        return F.normalize(self.weight, p=2, dim=1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, z_loss_weight: float = 0.0) -> torch.Tensor:
        """Logits; with ``labels`` (training, ``fused_linear_loss: chunked``), the loss of the
        product a chunk of tokens at a time instead. Inside this module's forward, so that
        ZeRO-3 gathers the weight for it as for the plain product."""
        if labels is not None:
            return fused_loss.linear_cross_entropy(x, self.normalized_weight(), labels, chunk=LOSS_CHUNK, z_loss_weight=z_loss_weight)
        if self.training:
            w = self.normalized_weight()
        else:
            if self._eval_weight is None or self._eval_weight.dtype != self.weight.dtype:
                with torch.no_grad():
                    self._eval_weight = self.normalized_weight()
            w = self._eval_weight
        return F.linear(x, w)


# --------------------------------------------------------------------------- model


class Baichuan2ForCausalLM(nn.Module):
    def __init__(self, cfg: Baichuan2Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.fused_elementwise)
        self.lm_head = NormHead(cfg.hidden_size, cfg.vocab_size, cfg.init_std)
        self._mask_cache: tuple[tuple, torch.Tensor] | None = None
        # Parameters are initialized by each leaf module as it is built:
        # N(0, init_std) for every matrix, ones for the norms.

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Recompute every decoder layer in the backward pass (the Hugging Face method name)."""
        self.config.gradient_checkpointing = True
        self.config.checkpoint_reentrant = bool((gradient_checkpointing_kwargs or {}).get("use_reentrant", True))

    def gradient_checkpointing_disable(self) -> None:
        self.config.gradient_checkpointing = False

    def alibi_mask(self, seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | FlexAlibi:
        """The ALiBi + causal mask of the ``sdpa`` attention, or the ``flex`` attention's
        score modification and block mask; made once per sequence length, dtype and device."""
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {seq_len} tokens exceeds max_position_embeddings {self.config.max_position_embeddings}")
        key = (seq_len, dtype, str(device), self.config.attention)
        if self._mask_cache is None or self._mask_cache[0] != key:
            if self.config.attention == "flex":
                mask: Any = flex_alibi(self.config.num_heads, seq_len, device)
            else:
                mask = alibi_causal_mask(self.config.num_heads, seq_len, dtype, device)
            self._mask_cache = (key, mask)
        return self._mask_cache[1]

    def recomputed(self, index: int) -> bool:
        """Whether decoder layer ``index`` is recomputed in this forward pass."""
        cfg = self.config
        if not (cfg.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return False
        return cfg.recompute_num_layers is None or index < cfg.recompute_num_layers

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` without labels; the mean loss with them.

        ``labels[:, t]`` is the target of position ``t`` (already shifted);
        entries equal to -100 are ignored.
        """
        x = self.embed_tokens(input_ids)
        mask = self.alibi_mask(input_ids.shape[1], x.dtype, x.device)
        for index, layer in enumerate(self.layers):
            if self.recomputed(index):
                x = checkpoint(layer, x, mask, use_reentrant=self.config.checkpoint_reentrant)
            else:
                x = layer(x, mask)
        x = self.norm(x)
        if labels is not None and self.config.fused_linear_loss == "chunked":
            return self.lm_head(x, labels, self.config.z_loss_weight)
        logits = self.lm_head(x)
        if labels is None:
            return logits
        return causal_lm_loss(logits, labels, self.config.z_loss_weight)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0) -> torch.Tensor:
    flat = logits.float().view(-1, logits.shape[-1])
    loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)
    if z_loss_weight:
        loss = loss + z_loss_weight * flat.max(-1).values.pow(2).mean()
    return loss


def init_rule(model: nn.Module) -> Callable[[str], Any]:
    """The model's own initialization, parameter by parameter, for
    ``training.deepspeed_weights.starting_weights``: N(0, init_std) for every matrix
    (embedding, linear layers, NormHead), ones for the RMSNorm weights."""
    from training.deepspeed_weights import ONES, Normal

    std = Normal(model.config.init_std)
    rules: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            if isinstance(module, RMSNorm):
                rules[name] = ONES
            elif isinstance(module, (Linear, Embedding, NormHead)):
                rules[name] = std
            else:
                raise TypeError(f"{name}: no initialization rule for a {type(module).__name__}")
    return rules.__getitem__


def count_parameters(model: nn.Module) -> int:
    """Exact parameter count, also for a model partitioned by ZeRO stage 3."""
    total = 0
    for p in model.parameters():
        total += int(getattr(p, "ds_numel", p.numel()))
    return total


def build_model(shape: dict[str, Any], **overrides: Any) -> Baichuan2ForCausalLM:
    return Baichuan2ForCausalLM(Baichuan2Config.from_shape(shape, **overrides))
