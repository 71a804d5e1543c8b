"""What the baichuan2/deepspeed case reads from the harness's ``resolved.json``.

The model shape is read and checked here (standard library only, so the
host-side tests import it); the training, parallel and ZeRO values are read
and checked by the shared loop (``training.deepspeed_loop``: ``phase_settings``,
``grad_accum_steps``, ``zero_section``, ``build_ds_config``) and the data
values by ``data.py``.  Every error names the key.

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
  parallel only), ``recompute`` (``full`` | ``none``: gradient checkpointing
  of every decoder layer), ``zero`` (the ZeRO section below)
* ``parallel.zero``: ``stage`` (0-3), ``overlap_comm``,
  ``contiguous_gradients``, ``reduce_bucket_size``,
  ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``,
  ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
  ``sub_group_size``, ``offload_optimizer`` (``none`` | ``cpu``),
  ``offload_param`` (``none`` | ``cpu``); the three size keys may be null
  (derived from the hidden size h as DeepSpeed's integrations do: h*h,
  0.9*h*h, 10*h); an explicit ``stage`` other than 3 is honoured and shows
  in ``run_meta`` (``zero_stage``) and ``ds_config.json``
* ``data``: ``data_dir`` (null: synthetic), ``prefix``, ``max_tokens``,
  ``cache_dir``, ``synthetic_tokens``
* ``vendor``: ``dist_backend`` (gloo | nccl); the device is the one
  DeepSpeed's accelerator picks
"""

from __future__ import annotations

from typing import Any

from training.settings import SettingsError

SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "seq_length", "vocab_size")


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
