"""The baichuan2/deepspeed case's settings, read from the harness's ``resolved.json``.

Everything the case reads from the resolved config is read and checked here,
once, before any process group or model exists; every error names the key.
Standard library only (the host-side tests import it).

Keys read (``cfg`` is the resolved.json object):

* ``case.model`` (or ``model.name``), ``config_name``, ``output_dir``
* ``model.params_nominal`` and the shape, flat in ``model`` (as the harness
  writes it) or under ``model.shape``: ``num_layers, hidden_size,
  ffn_hidden_size, num_heads, seq_length, vocab_size``; optional
  ``max_position_embeddings`` (4096), ``norm_eps`` (1e-6), ``z_loss_weight`` (0)
* ``train``: ``steps, global_batch, micro_batch, precision, lr, min_lr,
  lr_warmup_steps, weight_decay, clip_grad, adam_beta1, adam_beta2, init_std,
  seed``; optional ``lr_decay_steps`` (default ``steps``), ``adam_eps`` (1e-8),
  ``gradient_accumulation_steps`` (null: derived; when set it must equal
  ``global_batch / (micro_batch * dp)``); ``betas: [b1, b2]`` is accepted in
  place of the two beta keys
* ``parallel``: ``tp`` and ``pp`` (must be 1: this case is ZeRO data
  parallel only), ``dp`` (when present, must equal the world size),
  ``recompute`` (``full`` | ``none``: gradient checkpointing of every decoder
  layer), ``zero`` (the ZeRO section below)
* ``parallel.zero``: ``stage`` (0-3), ``overlap_comm``,
  ``contiguous_gradients``, ``reduce_bucket_size``,
  ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``,
  ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
  ``sub_group_size``, ``offload_optimizer`` (``none`` | ``cpu``),
  ``offload_param`` (``none`` | ``cpu``); the three size keys may be null
  (derived from the hidden size h as DeepSpeed's integrations do: h*h,
  0.9*h*h, 10*h)
* ``data``: ``data_dir`` (null: synthetic), ``prefix``, ``max_tokens``,
  ``cache_dir``, ``synthetic_tokens``
* ``vendor``: ``device`` (cpu | cuda), ``dist_backend`` (gloo | nccl)
"""

from __future__ import annotations

import dataclasses
from typing import Any


class SettingsError(ValueError):
    """A resolved config value the case cannot run with."""


SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "seq_length", "vocab_size")
PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "full")
OFFLOAD = ("none", "cpu")


def _req(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section or section[key] is None:
        raise SettingsError(f"resolved config lacks {where}.{key}")
    return section[key]


def model_name(cfg: dict[str, Any]) -> str:
    return str((cfg.get("case") or {}).get("model") or (cfg.get("model") or {}).get("name") or "")


def shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The model shape: flat in ``model`` or nested in ``model.shape``."""
    model = cfg.get("model") or {}
    src = model.get("shape") if isinstance(model.get("shape"), dict) else model
    out: dict[str, Any] = {}
    for key in SHAPE_KEYS:
        value = _req(src, key, "model")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SettingsError(f"model.{key} must be a positive integer, got {value!r}")
        out[key] = value
    if out["hidden_size"] % out["num_heads"]:
        raise SettingsError(f"model.hidden_size {out['hidden_size']} is not a multiple of model.num_heads {out['num_heads']}")
    out["max_position_embeddings"] = int(src.get("max_position_embeddings") or 4096)
    if out["seq_length"] > out["max_position_embeddings"]:
        raise SettingsError(f"model.seq_length {out['seq_length']} exceeds model.max_position_embeddings {out['max_position_embeddings']}")
    out["norm_eps"] = float(src.get("norm_eps", 1e-6))
    out["z_loss_weight"] = float(src.get("z_loss_weight", 0.0) or 0.0)
    return out


@dataclasses.dataclass(frozen=True)
class Train:
    steps: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    dp: int
    precision: str
    lr: float
    min_lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    weight_decay: float
    clip_grad: float
    betas: tuple[float, float]
    adam_eps: float
    init_std: float
    seed: int
    recompute: str


def train(cfg: dict[str, Any], world_size: int) -> Train:
    t = cfg.get("train") or {}
    par = cfg.get("parallel") or {}
    for key in ("tp", "pp"):
        if int(par.get(key, 1) or 1) != 1:
            raise SettingsError(f"parallel.{key} = {par[key]}: this case runs ZeRO data parallelism only (tp = pp = 1)")
    dp = world_size
    if par.get("dp") not in (None, dp):
        raise SettingsError(f"parallel.dp = {par['dp']} but the world size is {world_size} (tp = pp = 1)")
    gb = int(_req(t, "global_batch", "train"))
    mb = int(_req(t, "micro_batch", "train"))
    if mb < 1 or gb < 1 or gb % (mb * dp):
        raise SettingsError(f"train.global_batch {gb} is not a multiple of train.micro_batch {mb} x dp {dp}")
    ga = gb // (mb * dp)
    if t.get("gradient_accumulation_steps") not in (None, ga):
        raise SettingsError(
            f"train.gradient_accumulation_steps = {t['gradient_accumulation_steps']} but global_batch {gb} / "
            f"(micro_batch {mb} x dp {dp}) = {ga}: the global batch is fixed"
        )
    precision = str(_req(t, "precision", "train"))
    if precision not in PRECISIONS:
        raise SettingsError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if "betas" in t:
        betas = tuple(float(b) for b in t["betas"])
    else:
        betas = (float(t.get("adam_beta1", 0.9)), float(t.get("adam_beta2", 0.95)))
    if len(betas) != 2:
        raise SettingsError(f"train.betas must hold two values, got {t['betas']!r}")
    steps = int(_req(t, "steps", "train"))
    recompute = str(par.get("recompute", "none") or "none")
    if recompute not in RECOMPUTE:
        raise SettingsError(f"parallel.recompute must be one of {RECOMPUTE}, got {recompute!r}")
    return Train(
        steps=steps,
        global_batch=gb,
        micro_batch=mb,
        grad_accum=ga,
        dp=dp,
        precision=precision,
        lr=float(_req(t, "lr", "train")),
        min_lr=float(t.get("min_lr", 0.0) or 0.0),
        lr_warmup_steps=int(t.get("lr_warmup_steps", 0) or 0),
        lr_decay_steps=int(t.get("lr_decay_steps") or steps),
        weight_decay=float(t.get("weight_decay", 0.0) or 0.0),
        clip_grad=float(t.get("clip_grad", 0.0) or 0.0),
        betas=(betas[0], betas[1]),
        adam_eps=float(t.get("adam_eps", 1e-8)),
        init_std=float(t.get("init_std", 0.02)),
        seed=int(t.get("seed", 1234)),
        recompute=recompute,
    )


def zero_section(cfg: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """DeepSpeed's ``zero_optimization`` section from ``parallel.zero``."""
    z = dict((cfg.get("parallel") or {}).get("zero") or {})
    stage = int(z.pop("stage", 3))
    if stage not in (0, 1, 2, 3):
        raise SettingsError(f"parallel.zero.stage must be 0..3, got {stage}")
    out: dict[str, Any] = {"stage": stage}
    for key in ("overlap_comm", "contiguous_gradients"):
        if key in z:
            out[key] = bool(z.pop(key))
    auto = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, derived in auto.items():
        value = z.pop(key, None)
        if stage == 3 or key == "reduce_bucket_size":
            out[key] = int(derived if value is None else float(value))
    for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"):
        value = z.pop(key, None)
        if value is not None and stage == 3:
            out[key] = int(float(value))
    for key in ("offload_optimizer", "offload_param"):
        device = str(z.pop(key, "none") or "none")
        if device not in OFFLOAD:
            raise SettingsError(f"parallel.zero.{key} must be one of {OFFLOAD}, got {device!r}")
        if device != "none":
            if key == "offload_param" and stage != 3:
                raise SettingsError("parallel.zero.offload_param needs ZeRO stage 3")
            out[key] = {"device": device, "pin_memory": True}
    if z:
        raise SettingsError(f"parallel.zero has keys this case does not know: {', '.join(sorted(z))}")
    return out


def deepspeed_config(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The DeepSpeed config handed to ``deepspeed.initialize``; every value from ``cfg``."""
    t = train(cfg, world_size)
    s = shape(cfg)
    zero = zero_section(cfg, s["hidden_size"])
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.clip_grad,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": zero,
        # the optimizer is torch's AdamW, passed as a client optimizer: no JIT-built DeepSpeed op
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return ds


def lr_at(t: Train, step: int) -> float:
    """Learning rate after ``step`` optimizer steps: linear warmup, then cosine to ``min_lr``."""
    import math

    if t.lr_warmup_steps and step < t.lr_warmup_steps:
        return t.lr * (step + 1) / t.lr_warmup_steps
    span = max(1, t.lr_decay_steps - t.lr_warmup_steps)
    frac = min(1.0, max(0.0, (step - t.lr_warmup_steps) / span))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * frac))
