"""What the baichuan2/deepspeed case reads from the harness's ``resolved.json``.

The common train / parallel / data / vendor keys are read by
``training.settings.from_config`` (their defaults are listed there); the ZeRO
section by the shared loop (``training.deepspeed_loop.zero_section``) and the data
values by ``data.py``.  This module reads the case's own keys, the model shape.
Standard library only, so the host-side tests import it.  Every error names the key.

Keys read (``cfg`` is the resolved.json object):

* the shape, flat in ``model`` (as the harness writes it) or under ``model.shape``:
  ``num_layers, hidden_size, ffn_hidden_size, num_heads, seq_length,
  vocab_size``; optional ``max_position_embeddings`` (4096), ``norm_eps``
  (1e-6), ``z_loss_weight`` (0)
* ``parallel``: ``tp`` and ``pp`` must be 1 (ZeRO data parallel only),
  ``recompute`` (``full`` | ``none``: gradient checkpointing of every decoder
  layer), ``zero``: ``stage`` (0-3), ``overlap_comm``,
  ``contiguous_gradients``, ``reduce_bucket_size``,
  ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``,
  ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
  ``sub_group_size``, ``offload_optimizer`` (``none`` | ``cpu``),
  ``offload_param`` (``none`` | ``cpu``); the three size keys may be null
  (derived from the hidden size h as DeepSpeed's integrations do: h*h,
  0.9*h*h, 10*h); an explicit ``stage`` other than 3 is honoured and shows
  in ``run_meta`` (``zero_stage``) and ``ds_config.json``
* ``data``: ``max_tokens`` besides the common keys
"""

from __future__ import annotations

import dataclasses
from typing import Any

from training import settings as common
from training.settings import SettingsError, option


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model shape, each key with its one default (training.settings.read)."""

    num_layers: int = option(minimum=1)
    hidden_size: int = option(minimum=1)
    ffn_hidden_size: int = option(minimum=1)
    num_heads: int = option(minimum=1)
    seq_length: int = option(minimum=1)
    vocab_size: int = option(minimum=1)
    max_position_embeddings: int = option(4096, minimum=1)
    norm_eps: float = option(1e-6)
    z_loss_weight: float = option(0.0)


@dataclasses.dataclass(frozen=True)
class Settings:
    common: common.Common
    shape: dict[str, Any]


def from_config(cfg: dict[str, Any], world_size: int, phase: str = "train") -> Settings:
    return Settings(common.from_config(cfg, world_size, phase), shape(cfg))


def model_name(cfg: dict[str, Any]) -> str:
    return common.model_name(cfg)


def shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The model shape: flat in ``model`` or nested in ``model.shape``."""
    out = dataclasses.asdict(common.read(Shape, common.shape_source(cfg.get("model") or {}), "model.shape"))
    if out["hidden_size"] % out["num_heads"]:
        raise SettingsError(f"model.hidden_size {out['hidden_size']} is not a multiple of model.num_heads {out['num_heads']}")
    if out["seq_length"] > out["max_position_embeddings"]:
        raise SettingsError(f"model.seq_length {out['seq_length']} exceeds model.max_position_embeddings {out['max_position_embeddings']}")
    return out
