"""Every name of megatron-core that the llama3 case replaces, in one list, each with the
megatron-core versions it was verified on.

Megatron-core keeps these names private: a release may rename them, drop them or stop
looking them up where the case puts its own. So a patch is applied only through
:func:`replace` (or, for a subclass that overrides megatron's methods, checked by
:func:`require`), and only on a version it lists: on any other the switch that asks for it
is refused, naming the patch, the versions it was verified on and the way back (the switch
off). The switches are off by default, so a run on an unverified version without them
touches nothing here. :func:`applied` is what the run's ``run_meta`` records
(``megatron_patches``). docs/cases/llama3.md lists the patches and what was checked on each
version.

Verified on: 0.16.1 (the CPU environment, vendors/cpu/megatron/requirements.txt; the suite's
tests of each switch) and 0.19.2 (the GPU machines of docs/results; the same tests there).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from typing import Any

CPU = "0.16.1"  # the CPU environment and CI
GPU = "0.19.2"  # the GPU machines (Python 3.12; no wheel of it for the CPU environment's Python 3.11)


@dataclasses.dataclass(frozen=True)
class Patch:
    switch: str  # the setting that turns it on
    module: str  # the megatron-core module whose names it replaces
    names: tuple[str, ...]  # what it replaces there ("Class.method" for an override in a subclass)
    verified: tuple[str, ...]  # megatron-core versions it was verified on
    may_add: tuple[str, ...] = ()  # names megatron's module may lack (it checks for them first)


PATCHES: dict[str, Patch] = {
    "rope_compile": Patch(
        "parallel.fused_rope: compile",
        "megatron.core.models.common.embeddings.rope_utils",
        ("_apply_rotary_pos_emb_bshd",),
        (CPU, GPU),
    ),
    "rope_qkv": Patch(
        "parallel.fused_rope: qkv",
        "megatron.core.transformer.attention",
        ("HAVE_FUSED_QKV_ROPE", "apply_fused_qkv_rotary_pos_emb"),
        (CPU, GPU),
        may_add=("apply_fused_qkv_rotary_pos_emb",),  # TransformerEngine's, imported where TE is
    ),
    "wgrad_accumulation": Patch(
        "parallel.gradient_accumulation_fusion",
        "megatron.core.tensor_parallel.layers",
        ("fused_weight_gradient_mlp_cuda", "_grad_accum_fusion_available"),
        (CPU, GPU),
        may_add=("fused_weight_gradient_mlp_cuda",),  # apex's extension, imported where apex is
    ),
    "grad_clip": Patch(
        "parallel.fused_grad_clip",
        "megatron.core.optimizer.clip_grads",
        ("l2_norm_impl", "multi_tensor_scale_impl"),
        (CPU, GPU),
    ),
    "offload_copy": Patch(
        "parallel.offload_pinned_copy",
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
        ("HybridDeviceOptimizer._get_sub_optimizer_param_groups",),
        (CPU, GPU),
    ),
    "symm_mem_linears": Patch(
        "parallel.tp_comm_overlap: symm_mem",
        "megatron.core.tensor_parallel.layers",
        ("ColumnParallelLinear.forward", "RowParallelLinear.forward"),
        (CPU, GPU),
    ),
}

_ORIGINALS: dict[str, dict[str, Any]] = {}  # patch -> megatron's own values, kept at the first replace
_SUBCLASSED: set[str] = set()  # patches in use through a subclass (:func:`use`)
_MISSING = object()  # a name megatron's module did not have


class UnverifiedMegatron(RuntimeError):
    """A patch asked for on a megatron-core version it was not verified on."""


def version() -> str:
    """The installed megatron-core's version (its package metadata, else its package_info)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        return str(importlib.import_module("megatron.core.package_info").__version__)


def require(key: str, installed: str | None = None) -> Patch:
    """Patch ``key``, refused unless megatron-core (``installed``, default: this one) is a
    version it lists and its module has the names it replaces."""
    patch = PATCHES[key]
    installed = installed or version()
    if installed not in patch.verified:
        raise UnverifiedMegatron(
            f"{patch.switch} replaces megatron-core's {patch.module}.{{{', '.join(patch.names)}}}, verified on megatron-core "
            f"{', '.join(patch.verified)}; this is {installed}: turn the switch off, or verify the patch on {installed} and add "
            f"the version to PATCHES[{key!r}] in cases/llama3/megatron/mcore_patches.py"
        )
    module = importlib.import_module(patch.module)
    for name in patch.names:
        owner, _, attr = name.rpartition(".")
        where = getattr(module, owner, None) if owner else module
        if where is None or not (hasattr(where, attr) or name in patch.may_add):
            raise UnverifiedMegatron(f"{patch.switch}: this megatron-core ({installed}) has no {patch.module}.{name}")
    return patch


def use(key: str) -> None:
    """Patch ``key``, which overrides megatron's methods in a subclass, is in use (after
    :func:`require`)."""
    require(key)
    _SUBCLASSED.add(key)


def replace(key: str, **values: Any) -> None:
    """Set the names of patch ``key`` in its megatron-core module to ``values`` (after
    :func:`require`); megatron's own values are kept for :func:`restore`."""
    patch = require(key)
    if set(values) - set(patch.names):
        raise ValueError(f"patch {key} replaces {', '.join(patch.names)}, not {', '.join(sorted(set(values) - set(patch.names)))}")
    module = importlib.import_module(patch.module)
    _ORIGINALS.setdefault(key, {name: _own(module, name) for name in patch.names})
    for name, value in values.items():
        setattr(*_owner(module, name), value)


def _owner(module: Any, name: str) -> tuple[Any, str]:
    """Where ``name`` lives: the module, or its class for ``Class.attr``; and the attribute."""
    owner, _, attr = name.rpartition(".")
    return (getattr(module, owner) if owner else module), attr


def _own(module: Any, name: str) -> Any:
    """The value ``name`` holds where it lives (a class's own function, not a bound or inherited one)."""
    where, attr = _owner(module, name)
    return vars(where).get(attr, _MISSING)


def original(key: str, name: str) -> Any:
    """Megatron's own value of ``name`` of patch ``key`` (the module's current one when the
    patch was never applied; None where the module had none)."""
    if key in _ORIGINALS:
        value = _ORIGINALS[key][name]
    else:
        value = _own(importlib.import_module(PATCHES[key].module), name)
    return None if value is _MISSING else value


def restore(key: str) -> None:
    """Megatron's own values of patch ``key`` back (nothing when it was never applied)."""
    saved = _ORIGINALS.pop(key, None)
    if saved is None:
        return
    module = importlib.import_module(PATCHES[key].module)
    for name, value in saved.items():
        where, attr = _owner(module, name)
        if value is _MISSING:
            if attr in where.__dict__:
                delattr(where, attr)
        else:
            setattr(where, attr, value)


def applied() -> dict[str, Any]:
    """What run_meta records (``megatron_patches``): the megatron-core version and the patches
    in effect, each with the switch that asked for it."""
    return {
        "megatron_core": version(),
        "applied": {key: PATCHES[key].switch for key in sorted({*_ORIGINALS, *_SUBCLASSED})},
    }
