"""The llama3/megatron case's settings, read from the harness's ``resolved.json``.

Everything the case reads from the resolved config is read here, validated and
derived once (data-parallel size, gradient accumulation), so that a bad value
fails before any process group or model exists, with a message that names the
key.  Standard library only.

Keys read (``cfg`` is the resolved.json object): the common train / parallel /
data / vendor keys through ``training.settings.from_config`` (their defaults are
listed there), and this case's own:

* the shape, under ``model.shape`` or flat in ``model``, read through training/shapes.py's
  ``ModelShape`` (planning writes it whole); its flags must be :data:`LLAMA_FLAGS`
* ``parallel``: ``recompute`` is one of none|selective|full; optional
  ``recompute_method`` (uniform|block), ``recompute_num_layers``, ``sequence_parallel``, ``distributed_optimizer``, ``overlap_grad_reduce``,
  ``overlap_param_gather``, ``attention`` (sdpa|cudnn|local|te; cudnn needs
  vendor.device cuda), ``fused_elementwise`` (none|compile|liger: RMSNorm and
  SwiGLU as torch.compile regions or liger-kernel's Triton kernels, liger on cuda
  only; they replace megatron's local modules, so not with transformer_impl
  transformer_engine, and under auto only where TransformerEngine is absent),
  ``fused_rope`` (none|compile|qkv: megatron's unfused RoPE as one torch.compile region; or
  the QKV split and the RoPE of query and key as one compiled function each way, cos and sin
  worked out once a forward: kernels.qkv_rope),
  ``fused_linear_loss`` (none|chunked: output layer and cross-entropy in one, a chunk of
  tokens at a time, vocabulary split over TP; kernels.LinearCrossEntropy),
  ``fused_add_norm`` (each residual sum and the RMSNorm after it in one kernel, in the
  norms of ``fused_elementwise`` compile|liger; modeling.AddNormLayer),
  ``cross_entropy`` (megatron|fused|liger: the vocabulary-parallel cross-entropy after the
  output layer: megatron's own, megatron's fused one (bf16 only), or liger-kernel's Triton
  kernels (cuda); not with ``fused_linear_loss: chunked``, which computes its own),
  ``transformer_impl`` (auto|local|transformer_engine), ``fused_adam`` (torch's AdamW
  as its fused kernel where megatron falls back to torch's optimizer; kernels.fuse_adam),
  ``fused_grad_clip`` (the gradient norm and the clipping as torch's multi-tensor kernels where
  megatron falls back to its per-tensor loops without apex; kernels.install_grad_clip),
  ``gradient_accumulation_fusion`` (each weight gradient added to its float32 main_grad
  inside the GEMM; kernels.install_wgrad_accumulation), ``tp_comm_overlap`` (none|halves|symm_mem: halves: each
  layer runs its micro batch as two halves, one half's tensor-parallel all-reduces running while
  the other half computes, modeling.HalvesOverlapLayer; symm_mem: with sequence parallelism, its
  gathers and reduce-scatters inside the linear layers' GEMMs on torch's symmetric memory,
  tp_gemm_comm.py),
  ``optimizer_cpu_offload``, ``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``
  (with the offload: megatron's host optimizer a tensor at a time, each tensor's step on the
  host overlapping the gradient and parameter copies of the others, on streams of their own),
  ``offload_pinned_copy`` (with the offload: each parameter copied to the host once, straight
  into pinned memory, where megatron makes three copies; kernels.install_offload_copy)
* ``vendor.device``: any device type (training.accelerator gives the case its calls); the
  switches whose kernels exist on CUDA alone (attention cudnn, fused_elementwise liger) need
  ``cuda`` and name both where they are refused (:func:`check_device`)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from training import settings as common
from training import shapes
from training.settings import Common, SettingsError, option
from training.settings import divides as _divides
from training.shapes import ModelShape

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("sdpa", "cudnn", "local", "te")
FUSED_ELEMENTWISE = ("none", "compile", "liger")  # kernels.FUSED_ELEMENTWISE
FUSED_ROPE = ("none", "compile", "qkv")
FUSED_LINEAR_LOSS = ("none", "chunked")
CROSS_ENTROPY = ("megatron", "fused", "liger")
TRANSFORMER_IMPL = ("auto", "local", "transformer_engine")
TP_COMM_OVERLAP = ("none", "halves", "symm_mem")


#: what the case's model builds (modeling.py), in training/shapes.py's terms: a Llama decoder
LLAMA_FLAGS = shapes.LLAMA


@dataclasses.dataclass(frozen=True)
class Layout:
    """The layout: tp, pp, dp, micro_batch, grad_accum and recompute from the common settings,
    then this case's ``parallel`` switches, each read with its default here."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    grad_accum: int
    recompute: str = option("none", choices=RECOMPUTE)
    recompute_method: str = option("uniform", choices=("uniform", "block"))
    recompute_num_layers: int = option(1, minimum=1)
    sequence_parallel: bool = option(False)
    distributed_optimizer: bool = option(True)
    overlap_grad_reduce: bool = option(False)
    overlap_param_gather: bool = option(False)
    attention: str = option("sdpa", choices=ATTENTION)
    fused_elementwise: str = option("none", choices=FUSED_ELEMENTWISE)
    fused_rope: str = option("none", choices=FUSED_ROPE)
    fused_linear_loss: str = option("none", choices=FUSED_LINEAR_LOSS)
    cross_entropy: str = option("megatron", choices=CROSS_ENTROPY)
    fused_add_norm: bool = option(False)
    transformer_impl: str = option("auto", choices=TRANSFORMER_IMPL)
    fused_adam: bool = option(False)
    fused_grad_clip: bool = option(False)
    gradient_accumulation_fusion: bool = option(False)
    tp_comm_overlap: str = option("none", choices=TP_COMM_OVERLAP)
    optimizer_cpu_offload: bool = option(False)
    optimizer_offload_fraction: float = option(1.0)
    overlap_cpu_optimizer_d2h_h2d: bool = option(False)
    offload_pinned_copy: bool = option(False)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Settings:
    common: Common  # the common train / parallel / data / vendor settings (training/settings.py)
    shape: ModelShape
    layout: Layout


#: this case's own keys of each section, read by their dataclass (tests/test_settings_defaults.py
#: checks them against case.yaml's ``standard``)
OWN = {"parallel": Layout}


def derive_layout(parallel: dict, micro_batch: int, global_batch: int, world_size: int) -> Layout:
    """DP = world / (tp * pp); grad accumulation = global_batch / (micro_batch * dp), exactly
    (training.settings); then this case's layout switches."""
    par = common.read_parallel(parallel, world_size, RECOMPUTE)
    accum = common.grad_accum(global_batch, micro_batch, par.dp)
    given = {"tp": par.tp, "pp": par.pp, "dp": par.dp, "micro_batch": micro_batch, "grad_accum": accum, "recompute": par.recompute}
    return common.read(Layout, parallel, "parallel", **given)


def read_shape(model: dict) -> ModelShape:
    """The model's shape (training/shapes.py), refused where this case's model cannot build it."""
    return shapes.built(model, LLAMA_FLAGS, "the llama3/megatron model")


def check_layout_fits(shape: ModelShape, layout: Layout) -> None:
    fix = "choose another parallel.tp"
    _divides("num_heads over tensor parallelism", layout.tp, shape.num_heads, fix)
    _divides("num_kv_groups over tensor parallelism", layout.tp, shape.num_kv_groups, fix)
    _divides("ffn_hidden_size over tensor parallelism", layout.tp, shape.ffn_hidden_size, fix)
    _divides("vocab_size over tensor parallelism", layout.tp, shape.vocab_size, fix)
    _divides("num_layers over pipeline parallelism", layout.pp, shape.num_layers, "choose another parallel.pp")
    if layout.sequence_parallel and layout.tp == 1:
        raise SettingsError("parallel.sequence_parallel needs parallel.tp > 1")
    if layout.attention == "te" and layout.transformer_impl == "local":
        raise SettingsError("parallel.attention: te needs parallel.transformer_impl auto or transformer_engine")
    if layout.fused_elementwise != "none" and layout.transformer_impl == "transformer_engine":
        raise SettingsError(
            f"parallel.fused_elementwise: {layout.fused_elementwise} replaces megatron's local RMSNorm and SwiGLU; "
            "TransformerEngine brings its own: set parallel.transformer_impl to local (or auto without TransformerEngine) "
            "or parallel.fused_elementwise to none"
        )
    if layout.sequence_parallel and layout.fused_elementwise == "none" and layout.transformer_impl == "local":
        raise SettingsError(
            "parallel.sequence_parallel needs norms that run on a share of the sequence: megatron's torch RMSNorm "
            "wrapper (parallel.fused_elementwise: none with parallel.transformer_impl: local) refuses it; "
            "set parallel.fused_elementwise to compile or liger, or use TransformerEngine"
        )
    if layout.sequence_parallel:
        _divides("seq_length over tensor parallelism (sequence parallel)", layout.tp, shape.seq_length, fix)
    if layout.fused_add_norm:
        _check_add_norm(layout)
    if layout.tp_comm_overlap == "halves":
        _check_halves(layout)
    if layout.tp_comm_overlap == "symm_mem":
        _check_symm_mem(layout)
    if layout.cross_entropy != "megatron" and layout.fused_linear_loss != "none":
        raise SettingsError(
            f"parallel.cross_entropy: {layout.cross_entropy} replaces the cross-entropy after the output layer; "
            f"parallel.fused_linear_loss: {layout.fused_linear_loss} computes the output layer and the loss in one: set one of them off"
        )
    if layout.overlap_param_gather and not layout.distributed_optimizer:
        raise SettingsError("parallel.overlap_param_gather needs parallel.distributed_optimizer: true")
    if layout.optimizer_cpu_offload and not layout.distributed_optimizer:
        raise SettingsError("parallel.optimizer_cpu_offload needs parallel.distributed_optimizer: true")
    if layout.overlap_cpu_optimizer_d2h_h2d and not layout.optimizer_cpu_offload:
        raise SettingsError(
            "parallel.overlap_cpu_optimizer_d2h_h2d overlaps the host optimizer's copies: it needs parallel.optimizer_cpu_offload: true"
        )
    if layout.offload_pinned_copy and not layout.optimizer_cpu_offload:
        raise SettingsError(
            "parallel.offload_pinned_copy changes how the host optimizer's parameter copies are made: "
            "it needs parallel.optimizer_cpu_offload: true"
        )
    if layout.fused_adam and layout.optimizer_cpu_offload:
        raise SettingsError(
            "parallel.fused_adam picks the kernel of the optimizer on the device; with parallel.optimizer_cpu_offload "
            "megatron's host optimizer chooses its own: set one of them to false"
        )


def _check_halves(layout: Layout) -> None:
    """``tp_comm_overlap: halves`` (modeling.HalvesOverlapLayer): each layer runs its micro batch
    as two halves so that one half's tensor-parallel all-reduces run while the other computes."""
    why = "parallel.tp_comm_overlap: halves"
    if layout.tp == 1:
        raise SettingsError(f"{why} overlaps the tensor-parallel all-reduces; with parallel.tp 1 there are none")
    if layout.micro_batch % 2:
        raise SettingsError(f"{why} splits each micro batch in two; train.micro_batch is {layout.micro_batch}, set an even one")
    if layout.sequence_parallel:
        raise SettingsError(f"{why} overlaps the all-reduces of tensor parallelism without parallel.sequence_parallel; set one of them off")
    if layout.recompute == "full":
        raise SettingsError(f"{why} runs its own layer schedule, which full recompute would replay; use recompute none or selective")
    if layout.transformer_impl == "transformer_engine":
        raise SettingsError(
            f"{why} runs megatron's local layers; TransformerEngine brings its own overlap (set transformer_impl local or auto)"
        )


def _check_symm_mem(layout: Layout) -> None:
    """``tp_comm_overlap: symm_mem`` (tp_gemm_comm.py): sequence parallelism's gathers and
    reduce-scatters inside the GEMMs of megatron's local linear layers."""
    why = "parallel.tp_comm_overlap: symm_mem"
    if layout.tp == 1:
        raise SettingsError(f"{why} overlaps the tensor-parallel communication; with parallel.tp 1 there is none")
    if not layout.sequence_parallel:
        raise SettingsError(f"{why} runs the gathers and reduce-scatters of sequence parallelism: set parallel.sequence_parallel: true")
    if layout.transformer_impl == "transformer_engine":
        raise SettingsError(
            f"{why} replaces megatron's local linear layers; TransformerEngine brings its own overlap (set transformer_impl local or auto)"
        )


def _check_add_norm(layout: Layout) -> None:
    """``fused_add_norm`` (modeling.AddNormLayer): the case's own norms add the residual, and the
    layers hand the last sum on to the next."""
    why = "parallel.fused_add_norm"
    if layout.fused_elementwise == "none":
        raise SettingsError(f"{why} runs in the case's own norms: set parallel.fused_elementwise to compile or liger")
    if layout.tp_comm_overlap == "halves":
        raise SettingsError(f"{why} and parallel.tp_comm_overlap: halves each run their own layer: set one of them off")
    if layout.recompute == "full":
        raise SettingsError(
            f"{why} hands each layer's last sum to the next, which full recompute would replay; use recompute none or selective"
        )


def check_device(layout: Layout, device: str) -> None:
    """Switches whose kernels exist on CUDA devices only."""
    if device == "cuda":
        return
    if layout.attention == "cudnn":
        raise SettingsError(
            f"parallel.attention: cudnn runs torch's cuDNN attention kernel, which needs vendor.device: cuda "
            f"(this vendor's device is {device}); use parallel.attention: sdpa"
        )
    if layout.fused_elementwise == "liger":
        raise SettingsError(
            f"parallel.fused_elementwise: liger runs liger-kernel's Triton kernels, which need vendor.device: cuda "
            f"(this vendor's device is {device}); use none or compile"
        )
    if layout.cross_entropy == "liger":
        raise SettingsError(
            f"parallel.cross_entropy: liger runs liger-kernel's Triton kernels, which need vendor.device: cuda "
            f"(this vendor's device is {device}); use megatron or fused"
        )


def check_precision(layout: Layout, precision: str) -> None:
    """Switches made for one precision."""
    if layout.cross_entropy == "fused" and precision != "bf16":
        raise SettingsError(
            f"parallel.cross_entropy: fused is megatron's fused cross-entropy, which hands its gradient back in bf16; "
            f"train.precision is {precision}: use megatron or liger"
        )


def from_config(cfg: dict, world_size: int) -> Settings:
    """Validate the resolved config and derive the run's settings."""
    c = common.from_config(cfg, world_size, recompute=RECOMPUTE)
    if c.train.lr_warmup_steps >= c.train.lr_decay_steps:  # megatron's scheduler asserts it
        raise SettingsError(f"train.lr_warmup_steps ({c.train.lr_warmup_steps}) must be below the decay steps ({c.train.lr_decay_steps})")
    shape = read_shape(cfg["model"])
    layout = derive_layout(c.sections["parallel"], c.train.micro_batch, c.train.global_batch, world_size)
    check_layout_fits(shape, layout)
    check_device(layout, c.device)
    check_precision(layout, c.train.precision)
    return Settings(common=c, shape=shape, layout=layout)
