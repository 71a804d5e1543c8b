"""What the baichuan2/deepspeed case reads from the harness's ``resolved.json``.

The common train / parallel / data / vendor keys are read by
``training.settings.from_config`` (their defaults are listed there); the ZeRO
section by the shared loop (``training.deepspeed_loop.zero_section``) and the data
values by ``data.py``.  This module reads the case's own keys, the model shape.
Standard library only, so the host-side tests import it.  Every error names the key.

Keys read (``cfg`` is the resolved.json object):

* the shape, flat in ``model`` (as the harness writes it) or under ``model.shape``, read
  through training/shapes.py's ``ModelShape`` (planning writes it whole); its flags must be
  :data:`BAICHUAN2_FLAGS`
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
from training import shapes

#: what the case's model builds (model.py), in training/shapes.py's terms
#: (its max-z loss, ``z_loss_weight``, takes any weight)
BAICHUAN2_FLAGS = {
    **{k: v for k, v in shapes.LLAMA.items() if k != "z_loss_weight"},
    "position_embedding": "alibi",
    "output_layer": "normhead",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    common: common.Common
    shape: dict[str, Any]


def from_config(cfg: dict[str, Any], world_size: int, phase: str = "train") -> Settings:
    return Settings(common.from_config(cfg, world_size, phase), shape(cfg))


def model_name(cfg: dict[str, Any]) -> str:
    return common.model_name(cfg)


def shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The model shape (training/shapes.py), flat in ``model`` or nested in ``model.shape``, as
    a mapping; refused where the case's model cannot build it."""
    return shapes.built(cfg.get("model") or {}, BAICHUAN2_FLAGS, "Baichuan2", multi_head=True).as_dict()
