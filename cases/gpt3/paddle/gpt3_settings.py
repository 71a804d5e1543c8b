"""The gpt3/paddle case's settings, read from the harness's ``resolved.json``.

Everything the case reads from the resolved config is read, validated and
derived here (data-parallel width, sharding and dp degrees, gradient
accumulation) before any process group or model exists, and every error names
the key.  Standard library only, so tests can import it anywhere.

Keys read (``cfg`` is the resolved.json object):

* ``case.model`` (or ``model.name``), ``config_name``
* ``model.params_nominal`` and the shape, under ``model.shape`` or flat in
  ``model``: ``num_layers, hidden_size, ffn_hidden_size, num_heads,
  seq_length, vocab_size``; optional ``num_kv_groups`` (must equal
  ``num_heads``), ``norm_eps`` (1e-5), ``hidden_act`` (gelu), and the
  ``training.flops.DecoderShape`` flags, which must describe GPT-3
  (``gated_mlp: false, tied_embeddings: true, bias: true, norm: layernorm,
  learned_positions: true``)
* ``train``: ``steps, global_batch, micro_batch, precision`` (fp16|bf16|fp32),
  ``lr, min_lr, lr_warmup_steps, weight_decay, clip_grad, adam_beta1,
  adam_beta2, seed``; optional ``lr_decay_steps`` (default ``steps``),
  ``adam_eps`` (1e-8), ``init_std`` (0.02), ``amp_level`` (O2|O1),
  ``loss_scale`` (1024, fp16 only), ``hidden_dropout`` and
  ``attention_dropout`` (0.1); ``betas: [b1, b2]`` in place of the two beta keys
* ``parallel``: ``tp, pp``; optional ``sharding_stage`` (0|1|2, also
  "stage1"/"stage2"), ``sharding_degree`` (default: the whole data-parallel
  width when a stage is set), ``recompute`` (none|full|full_attn|core_attn, or
  a bool), ``use_flash_attention`` (true), ``use_fused_rms_norm``,
  ``fuse_attention_qkv``, ``fuse_attention_ffn``, ``sequence_parallel``
  (false); ``dp`` and ``grad_accum`` when present must equal the derived values
* ``data``: ``data_dir`` (null: synthetic), ``prefix`` (the corpus prefix in
  data_dir; default: the only ``*_ids.npy``/``*_idx.npz`` pair there),
  ``cache_dir``, ``synthetic_tokens``
* ``vendor``: ``device`` (cpu|cuda|gpu), ``dist_backend``

Parallel layout, in the harness's terms: ``dp = world / (tp * pp)`` is the
data-parallel width; paddle's hybrid topology splits it into
``sharding_degree x dp_degree`` (sharded and plain replicas);
``grad_accum = global_batch / (micro_batch * dp)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from training import settings as common
from training.settings import SettingsError, data_parallel, grad_accum
from training.settings import choice as _choice
from training.settings import get as _get
from training.settings import integer as _int
from training.settings import number as _float

SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "seq_length", "vocab_size")
PRECISIONS = ("fp16", "bf16", "fp32")
AMP_LEVELS = ("O1", "O2")
RECOMPUTE = ("none", "full", "full_attn", "core_attn")
#: what GPT-3 is, in training.flops.DecoderShape's terms
GPT3_FLAGS = {"gated_mlp": False, "tied_embeddings": True, "bias": True, "norm": "layernorm", "learned_positions": True}


@dataclasses.dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    seq_length: int
    vocab_size: int
    norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    def decoder_shape(self) -> dict[str, Any]:
        """The mapping ``training.flops.decoder_shape`` takes for this model."""
        d = {k: getattr(self, k) for k in SHAPE_KEYS}
        return {**d, "num_kv_groups": self.num_heads, **GPT3_FLAGS}


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
    recompute: str = "none"
    use_flash_attention: bool = True
    use_fused_rms_norm: bool = False
    fuse_attention_qkv: bool = False
    fuse_attention_ffn: bool = False
    sequence_parallel: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Settings:
    model_name: str
    config_name: str
    params_nominal: float
    shape: Shape
    layout: Layout
    world_size: int
    steps: int
    global_batch: int
    precision: str
    amp_level: str
    loss_scale: float
    lr: float
    min_lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    init_std: float
    hidden_dropout: float
    attention_dropout: float
    seed: int
    device: str  # "cpu" or "gpu" (paddle's name)
    dist_backend: str
    data_dir: str | None
    data_prefix: str | None
    cache_dir: str | None
    synthetic_tokens: int | None


def _bool(value: Any, where: str) -> bool:
    return common.boolean(value, where, accept_01=True)  # FlagPerf's configs write 0/1


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


def _recompute(value: Any) -> str:
    if isinstance(value, bool):
        return "full" if value else "none"
    return _choice(value, "parallel.recompute", RECOMPUTE)


def _shape(model: dict) -> Shape:
    src = model.get("shape") if isinstance(model.get("shape"), dict) else model
    vals = {k: _int(_get(src, k, "model"), f"model.{k}", 1) for k in SHAPE_KEYS}
    kv = src.get("num_kv_groups")
    if kv is not None and _int(kv, "model.num_kv_groups", 1) != vals["num_heads"]:
        raise SettingsError(f"resolved config: model.num_kv_groups must equal num_heads ({vals['num_heads']}): GPT-3 has multi-head attention")
    for flag, want in GPT3_FLAGS.items():
        if flag in src and src[flag] != want:
            raise SettingsError(f"resolved config: model.{flag} is {src[flag]!r}, but GPT-3 (PaddleNLP's GPT) has {want!r}")
    if vals["hidden_size"] % vals["num_heads"]:
        raise SettingsError(f"resolved config: model.hidden_size {vals['hidden_size']} is not a multiple of num_heads {vals['num_heads']}")
    return Shape(
        **vals,
        norm_eps=_float(src.get("norm_eps", 1e-5), "model.norm_eps"),
        hidden_act=str(src.get("hidden_act", "gelu")),
    )


def _layout(par: dict, train: dict, shape: Shape, world: int) -> Layout:
    tp = _int(par.get("tp", 1), "parallel.tp", 1)
    pp = _int(par.get("pp", 1), "parallel.pp", 1)
    dp = data_parallel(world, tp, pp, "resolved config: tp={tp} x pp={pp} does not divide the world size {world}")
    if par.get("dp") is not None and _int(par["dp"], "parallel.dp", 1) != dp:
        raise SettingsError(f"resolved config: parallel.dp is {par['dp']} but world {world} / (tp {tp} x pp {pp}) = {dp}")
    stage = _sharding_stage(par.get("sharding_stage", 0))
    degree_raw = par.get("sharding_degree")
    degree = _int(degree_raw, "parallel.sharding_degree", 1) if degree_raw is not None else (dp if stage else 1)
    if dp % degree:
        raise SettingsError(f"resolved config: parallel.sharding_degree {degree} does not divide the data-parallel width {dp}")
    if stage == 0 and degree > 1:
        raise SettingsError(f"resolved config: parallel.sharding_degree is {degree} but parallel.sharding_stage is 0")
    if stage == 2 and pp > 1:
        raise SettingsError("resolved config: sharding stage 2 with pipeline parallelism is not supported by paddle's hybrid parallel (use stage 1 with pp > 1)")
    if shape.num_heads % tp or shape.vocab_size % tp or shape.ffn_hidden_size % tp:
        raise SettingsError(f"resolved config: parallel.tp {tp} must divide num_heads, vocab_size and ffn_hidden_size")
    if shape.num_layers < pp:
        raise SettingsError(f"resolved config: parallel.pp {pp} exceeds num_layers {shape.num_layers}")
    gb = _int(_get(train, "global_batch", "train"), "train.global_batch", 1)
    mb = _int(_get(train, "micro_batch", "train"), "train.micro_batch", 1)
    accum = grad_accum(gb, mb, dp, "resolved config: train.global_batch {gb} is not a multiple of micro_batch {mb} x data-parallel width {dp}")
    for key in ("grad_accum", "gradient_accumulation_steps"):
        for section, name in ((par, "parallel"), (train, "train")):
            if section.get(key) is not None and _int(section[key], f"{name}.{key}", 1) != accum:
                raise SettingsError(f"resolved config: {name}.{key} is {section[key]} but global_batch {gb} / (micro_batch {mb} x dp {dp}) = {accum}")
    sp = _bool(par.get("sequence_parallel", False), "parallel.sequence_parallel")
    if sp and tp == 1:
        raise SettingsError("resolved config: parallel.sequence_parallel needs tp > 1")
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        sharding_stage=stage if degree > 1 else 0,
        sharding_degree=degree,
        dp_degree=dp // degree,
        micro_batch=mb,
        grad_accum=accum,
        recompute=_recompute(par.get("recompute", "none")),
        use_flash_attention=_bool(par.get("use_flash_attention", True), "parallel.use_flash_attention"),
        use_fused_rms_norm=_bool(par.get("use_fused_rms_norm", False), "parallel.use_fused_rms_norm"),
        fuse_attention_qkv=_bool(par.get("fuse_attention_qkv", False), "parallel.fuse_attention_qkv"),
        fuse_attention_ffn=_bool(par.get("fuse_attention_ffn", False), "parallel.fuse_attention_ffn"),
        sequence_parallel=sp,
    )


def from_config(cfg: dict, world_size: int) -> Settings:
    """Validate the resolved config for a run of ``world_size`` ranks."""
    for key in ("model", "train", "parallel"):
        if not isinstance(cfg.get(key), dict):
            raise SettingsError(f"resolved config: '{key}' must be a mapping")
    model, train, par = cfg["model"], cfg["train"], cfg["parallel"]
    data = cfg.get("data") or {}
    vendor = cfg.get("vendor") or {}
    shape = _shape(model)
    layout = _layout(par, train, shape, world_size)

    precision = _choice(_get(train, "precision", "train"), "train.precision", PRECISIONS)
    device = str(vendor.get("device", "cpu")).lower()
    device = {"cuda": "gpu"}.get(device, device)
    if device not in ("cpu", "gpu"):
        raise SettingsError(f"resolved config: vendor.device must be cpu or cuda, got {vendor.get('device')!r}")
    if device == "cpu" and precision != "fp32":
        # paddle's amp_guard "can only be enabled on CUDAPlace, XPUPlace, and CustomPlace":
        # on the CPU it silently computes in fp32, so a bf16/fp16 label would be false
        raise SettingsError(f"resolved config: train.precision {precision} has no effect in paddle on the CPU (AMP runs only on GPU/XPU/custom devices); use fp32")
    betas = train.get("betas")
    b1 = _float(betas[0], "train.betas[0]") if betas else _float(_get(train, "adam_beta1", "train"), "train.adam_beta1")
    b2 = _float(betas[1], "train.betas[1]") if betas else _float(_get(train, "adam_beta2", "train"), "train.adam_beta2")
    steps = _int(_get(train, "steps", "train"), "train.steps", 1)
    syn = data.get("synthetic_tokens")
    return Settings(
        model_name=str(cfg.get("case", {}).get("model") or model.get("name") or ""),
        config_name=str(cfg.get("config_name", "")),
        params_nominal=_float(_get(model, "params_nominal", "model"), "model.params_nominal"),
        shape=shape,
        layout=layout,
        world_size=world_size,
        steps=steps,
        global_batch=_int(train["global_batch"], "train.global_batch", 1),
        precision=precision,
        amp_level=_choice(train.get("amp_level", "O2"), "train.amp_level", AMP_LEVELS),
        loss_scale=_float(train.get("loss_scale", 1024.0), "train.loss_scale"),
        lr=_float(_get(train, "lr", "train"), "train.lr"),
        min_lr=_float(_get(train, "min_lr", "train"), "train.min_lr"),
        lr_warmup_steps=_int(_get(train, "lr_warmup_steps", "train", 0), "train.lr_warmup_steps"),
        lr_decay_steps=_int(train.get("lr_decay_steps") or steps, "train.lr_decay_steps", 1),
        weight_decay=_float(_get(train, "weight_decay", "train"), "train.weight_decay"),
        clip_grad=_float(_get(train, "clip_grad", "train", 0.0), "train.clip_grad"),
        adam_beta1=b1,
        adam_beta2=b2,
        adam_eps=_float(train.get("adam_eps", 1e-8), "train.adam_eps"),
        init_std=_float(train.get("init_std", 0.02), "train.init_std"),
        hidden_dropout=_float(train.get("hidden_dropout", 0.1), "train.hidden_dropout"),
        attention_dropout=_float(train.get("attention_dropout", 0.1), "train.attention_dropout"),
        seed=_int(_get(train, "seed", "train", 1234), "train.seed"),
        device=device,
        dist_backend=str(vendor.get("dist_backend", "gloo" if device == "cpu" else "nccl")),
        data_dir=data.get("data_dir") or None,
        data_prefix=data.get("prefix") or None,
        cache_dir=data.get("cache_dir") or None,
        synthetic_tokens=_int(syn, "data.synthetic_tokens", 1) if syn is not None else None,
    )
