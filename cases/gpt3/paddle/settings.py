"""The gpt3/paddle case's settings, read from the harness's ``resolved.json``.

Everything the case reads from the resolved config is read, validated and
derived here (data-parallel width, sharding and dp degrees, gradient
accumulation) before any process group or model exists, and every error names
the key.  Standard library only, so tests can import it anywhere.

Keys read (``cfg`` is the resolved.json object): the common train / parallel /
data / vendor keys through ``training.settings.from_config`` (their defaults are
listed there), and this case's own:

* the shape, under ``model.shape`` or flat in ``model``, read through training/shapes.py's
  ``ModelShape`` (planning writes it whole); its flags must describe GPT-3
  (:data:`GPT3_FLAGS`, and ``num_kv_groups`` equal to ``num_heads``)
* ``train``: ``amp_level`` (O2|O1), ``loss_scale`` (1024, fp16 only),
  ``hidden_dropout`` and ``attention_dropout`` (0.1)
* ``parallel``: ``recompute`` is one of none|full|full_attn|core_attn (or a
  bool); ``sharding_stage`` (0|1|2, also "stage1"/"stage2"),
  ``sharding_degree`` (default: the whole data-parallel width when a stage is
  set), ``use_flash_attention`` (true), ``use_fused_rms_norm``,
  ``fuse_attention_qkv``, ``fuse_attention_ffn``, ``sequence_parallel`` (false)
* ``vendor.device``: torch's device type of the vendor, as paddle names it
  (:func:`paddle_device`: cuda is paddle's ``gpu``, a plug-in's type is its custom
  device's name, e.g. ``npu``, ``mlu``). Paddle's launcher picks the collective library
  for that device itself (nccl on gpu, bkcl on xpu, xccl on a custom device, gloo on the
  CPU); ``vendor.dist_backend`` names torch's and is not passed to paddle.

Parallel layout, in the harness's terms: ``dp = world / (tp * pp)`` is the
data-parallel width; paddle's hybrid topology splits it into
``sharding_degree x dp_degree`` (sharded and plain replicas);
``grad_accum = global_batch / (micro_batch * dp)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from training import settings as common
from training import shapes
from training.settings import Common, SettingsError, option
from training.settings import integer as _int
from training.shapes import ModelShape

AMP_LEVELS = ("O1", "O2")
RECOMPUTE = ("none", "full", "full_attn", "core_attn")
#: what GPT-3 is (PaddleNLP's GPT builds nothing else), in training/shapes.py's terms
GPT3_FLAGS = shapes.GPT


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int  # data-parallel width = sharding_degree * dp_degree
    sharding_stage: int
    sharding_degree: int
    dp_degree: int
    micro_batch: int
    grad_accum: int
    recompute: str
    use_flash_attention: bool = option(True, accept_01=True)  # FlagPerf's configs write 0/1
    use_fused_rms_norm: bool = option(False, accept_01=True)
    fuse_attention_qkv: bool = option(False, accept_01=True)
    fuse_attention_ffn: bool = option(False, accept_01=True)
    sequence_parallel: bool = option(False, accept_01=True)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Own:
    """This case's own ``train`` keys."""

    amp_level: str = option("O2", choices=AMP_LEVELS)
    loss_scale: float = option(1024.0)
    hidden_dropout: float = option(0.1)
    attention_dropout: float = option(0.1)


@dataclasses.dataclass(frozen=True)
class Settings:
    common: Common  # the common train / parallel / data / vendor settings (training/settings.py)
    shape: ModelShape
    layout: Layout
    own: Own
    device: str  # paddle's device name: cpu, gpu (cuda), xpu, or a custom device's (npu, mlu ...)


#: this case's own keys of each section, read by their dataclass (tests/test_settings_defaults.py
#: checks them against case.yaml's ``standard``)
OWN = {"parallel": Layout, "train": Own}


def _sharding_stage(value: Any) -> int:
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("", "none", "stage0"):
            return 0
        if v in ("stage1", "stage2", "stage3"):
            value = int(v[-1])
        else:
            raise SettingsError(f"resolved config: parallel.sharding_stage must be 0, 1 or 2 (or 'stage1'/'stage2'), got {value!r}")
    stage = _int(value, "parallel.sharding_stage")
    if stage == 3:
        raise SettingsError("resolved config: parallel.sharding_stage 3 is not supported by the gpt3/paddle case (use 1 or 2)")
    if stage > 3:
        raise SettingsError(f"resolved config: parallel.sharding_stage must be 0, 1 or 2, got {value!r}")
    return stage


def _shape(model: dict) -> ModelShape:
    return shapes.built(model, GPT3_FLAGS, "GPT-3 (PaddleNLP's GPT)", multi_head=True)


def _layout(c: common.Common, shape: ModelShape) -> Layout:
    par, tp, pp, dp = c.sections["parallel"], c.parallel.tp, c.parallel.pp, c.parallel.dp
    stage = _sharding_stage(par.get("sharding_stage", 0))
    degree_raw = par.get("sharding_degree")
    degree = _int(degree_raw, "parallel.sharding_degree", 1) if degree_raw is not None else (dp if stage else 1)
    if dp % degree:
        raise SettingsError(f"resolved config: parallel.sharding_degree {degree} does not divide the data-parallel width {dp}")
    if stage == 0 and degree > 1:
        raise SettingsError(f"resolved config: parallel.sharding_degree is {degree} but parallel.sharding_stage is 0")
    if stage == 2 and pp > 1:
        raise SettingsError(
            "resolved config: sharding stage 2 with pipeline parallelism is not supported by paddle's hybrid parallel (use stage 1 with pp > 1)"
        )
    if shape.num_heads % tp or shape.vocab_size % tp or shape.ffn_hidden_size % tp:
        raise SettingsError(f"resolved config: parallel.tp {tp} must divide num_heads, vocab_size and ffn_hidden_size")
    if shape.num_layers < pp:
        raise SettingsError(f"resolved config: parallel.pp {pp} exceeds num_layers {shape.num_layers}")
    layout = common.read(
        Layout,
        par,
        "parallel",
        tp=tp,
        pp=pp,
        dp=dp,
        sharding_stage=stage if degree > 1 else 0,
        sharding_degree=degree,
        dp_degree=dp // degree,
        micro_batch=c.train.micro_batch,
        grad_accum=c.train.grad_accum,
        recompute=c.parallel.recompute,
    )
    if layout.sequence_parallel and tp == 1:
        raise SettingsError("resolved config: parallel.sequence_parallel needs tp > 1")
    return layout


def paddle_device(device_type: str) -> str:
    """Paddle's name of the vendor's device type: ``gpu`` for cuda, ``cpu``, and any other type
    as it is (xpu, and a custom device plug-in registers under the name torch's extension uses:
    npu, mlu ...)."""
    return {"cuda": "gpu"}.get(device_type, device_type)


def from_config(cfg: dict, world_size: int) -> Settings:
    """Validate the resolved config for a run of ``world_size`` ranks."""
    c = common.from_config(cfg, world_size, recompute=RECOMPUTE)
    shape = _shape(cfg["model"])
    layout = _layout(c, shape)
    precision = c.train.precision
    device = paddle_device(c.device)
    if device == "cpu" and precision != "fp32":
        # paddle's amp_guard "can only be enabled on CUDAPlace, XPUPlace, and CustomPlace":
        # on the CPU it silently computes in fp32, so a bf16/fp16 label would be false
        raise SettingsError(
            f"resolved config: train.precision {precision} has no effect in paddle on the CPU (AMP runs only on GPU/XPU/custom devices); use fp32"
        )
    return Settings(common=c, shape=shape, layout=layout, own=common.read(Own, c.sections["train"], "train"), device=device)
