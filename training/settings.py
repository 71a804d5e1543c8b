"""The one settings model of the cases: the common train / parallel / data keys of
``resolved.json``, read, defaulted and checked in one place.

A case's own settings module (``cases/<family>/<framework>/settings.py``) calls
:func:`from_config` and reads only the keys that are its own (model shape, layout
switches of its framework) from :attr:`Common.sections` and :func:`shape_source`.
Every error names the key it is about.  Standard library only, so host-side code
and tests import it anywhere.

Keys read, with their one default (``-``: required):

==========================  =========  ===============================================
``train.steps``             -          optimizer steps of the phase (>= 1)
``train.global_batch``      -          sequences per optimizer step
``train.micro_batch``       1          sequences per micro-batch and data-parallel rank
``train.precision``         bf16       bf16 | fp16 | fp32
``train.lr``                -          peak learning rate
``train.min_lr``            0.0        end of the cosine decay
``train.lr_warmup_steps``   0          linear warmup steps
``train.lr_decay_steps``    steps      cosine horizon (null: the phase's steps)
``train.weight_decay``      0.0
``train.clip_grad``         0.0        global-norm clipping; 0: none
``train.adam_beta1/2``      0.9/0.95   ``train.betas: [b1, b2]`` is read when a beta key
                                       is absent (the two keys come first)
``train.adam_eps``          1e-8
``train.init_std``          0.02
``train.seed``              1234
``train.profile_step``      0          K > 0: profile step K (training/profiling.py)
``train.ceiling_hold_s``    0          seconds each kernel-ceiling part runs before it is
                                       timed (training/ceiling.py: the sustained clock)
``parallel.tp``, ``.pp``    1          ``dp = world / (tp * pp)`` exactly; ``parallel.dp``,
                                       when given, must equal it
``parallel.recompute``      none       one of the case's choices; true/false: full/none
``data.data_dir``           null       null: the case's synthetic data
``data.cache_dir``          null       where synthetic data is written (the harness sets it)
``data.prefix``             null       corpus prefix in data_dir (null: found there)
``data.synthetic_tokens``   null       size of the synthetic corpus (case default)
``data.synthetic``          null       the synthetic corpus's version and parameters
                                       (training/data/synthetic.py; null: version 1)
``data.format``             null       how the host checks the data (docs/datasets.md)
``vendor.device``           cpu        torch's device type of the vendor (cuda, npu, mlu, ...)
``vendor.dist_backend``     gloo/-     the vendor's torch.distributed backend; gloo on a cpu
                                       device, required on any other
==========================  =========  ===============================================

Gradient accumulation is ``global_batch / (micro_batch * dp)``, exactly;
``train.gradient_accumulation_steps`` or ``grad_accum`` (train or parallel), when
given, must equal it.  Phases: a section's ``phases.<phase>`` entry overlays the
section (:func:`phase_sections`), so a phase reads its keys as a single-phase case
does.  The model shape sits under ``model.shape`` (case.yaml) or flat in ``model``
(resolved.json): :func:`shape_source` is the one place that knows.

A section is read into a dataclass by :func:`read`, driven by its fields: the field's type
decides the check, ``dataclasses.field(metadata=...)`` adds ``choices`` or a ``minimum``,
and the field's default (none: the key is required) is the setting's one default in code.
A case's ``settings.py`` declares its own keys that way and keeps :class:`Common` whole
(``Settings.common``) instead of copying its fields.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from typing import Any

from training.data import corpus_spec

#: the "no default" marker of :func:`get`
MISSING: Any = dataclasses.MISSING


class SettingsError(ValueError):
    """A resolved config value the case cannot run with. ``loc`` (the field's path, one key a
    part) and ``reason`` (the message less that path) are set where one field is at fault, so a
    caller that names fields its own way, as planning's case.yaml check does, takes them as they are."""

    def __init__(self, message: str, *, loc: tuple[str, ...] = (), reason: str = "") -> None:
        super().__init__(message)
        self.loc = loc
        self.reason = reason or message


def _bad(where: str, reason: str) -> SettingsError:
    """The error of one field ``where`` (a dotted path) whose value fails ``reason``; the
    field's ``loc`` is set by a caller that knows its parts (a model name may hold a dot)."""
    return SettingsError(f"resolved config: {where} {reason}", reason=reason)


def get(section: dict, key: str, where: str, default: Any = MISSING) -> Any:
    """``section[key]`` when present and not null, else ``default``; no default: an error."""
    if key in section and section[key] is not None:
        return section[key]
    if default is MISSING:
        raise _bad(f"{where}.{key}", "is missing")
    return default


def integer(value: Any, where: str, minimum: int = 0) -> int:
    """A whole number (an integral float passes; a bool does not) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise _bad(where, f"must be an integer, got {value!r}")
    if int(value) < minimum:
        raise _bad(where, f"must be >= {minimum}, got {value!r}")
    return int(value)


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, f"must be a number, got {value!r}")
    return float(value)


def boolean(value: Any, where: str, accept_01: bool = False) -> bool:
    """``true``/``false``; with ``accept_01`` also the integers 0 and 1 (FlagPerf's configs write them)."""
    if accept_01 and isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise _bad(where, f"must be true or false, got {value!r}")
    return value


def choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _bad(where, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


_TYPE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def device_type(value: Any, where: str = "vendor.device") -> str:
    """A device type or collective backend name as vendor.yaml gives it: lower case, any name."""
    if not isinstance(value, str) or not _TYPE_NAME.match(value):
        raise SettingsError(f"resolved config: {where} must be a lower-case name such as cuda, npu, cpu (nccl, hccl, gloo), got {value!r}")
    return value


def divides(what: str, a: int, b: int, fix: str) -> None:
    """``a`` must divide ``b``."""
    if b % a != 0:
        raise SettingsError(f"{what}: {b} is not divisible by {a}; {fix}")


# -- the layout arithmetic, one wording (the host's plan checks say the same) -----------


def data_parallel(world_size: int, tp: int, pp: int) -> int:
    """``dp = world_size / (tp * pp)``, exactly."""
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise SettingsError(f"tp={tp} x pp={pp} does not divide the world size {world_size}")
    return world_size // (tp * pp)


def grad_accum(global_batch: int, micro_batch: int, dp: int) -> int:
    """``global_batch / (micro_batch * dp)``, exactly."""
    if micro_batch < 1 or global_batch % (micro_batch * dp) != 0:
        raise SettingsError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x data-parallel size {dp}")
    return global_batch // (micro_batch * dp)


# -- the shape of a section ---------------------------------------------------------------

SECTIONS = ("train", "parallel", "data")
PRECISIONS = ("bf16", "fp16", "fp32")
#: keys of a case.yaml ``standard`` that the host reads, not the ranks (the steady window,
#: the allocator's variable, how the data is checked before launch and fingerprinted)
HOST_KEYS = {
    "train": ("warmup_steps",),
    "parallel": ("expandable_segments", "pinned_register_threads"),
    "data": ("format", "fingerprint", "max_image_pixels"),
}
BETAS = (0.9, 0.95)  # the default when neither train.adam_beta1/2 nor train.betas is given


def deep_merge(base: dict, over: dict | None) -> dict:
    """``base`` with ``over`` laid on top, nested mappings merged key by key."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def phase_sections(cfg: dict, phase: str = "train") -> dict[str, dict]:
    """``{"train", "parallel", "data"}`` of one phase: each section of the resolved config
    overlaid with its ``phases.<phase>`` entry (the ``phases`` key itself dropped)."""
    out = {}
    for name in SECTIONS:
        sec = cfg.get(name) or {}
        if not isinstance(sec, dict):
            raise SettingsError(f"resolved config: section {name!r} must be a mapping, got {sec!r}")
        sec = dict(sec)
        over = (sec.pop("phases", None) or {}).get(phase) or {}
        out[name] = deep_merge(sec, over)
    return out


def shape_source(model: dict) -> dict:
    """Where the model's shape keys are: ``model.shape`` when it is a mapping, else ``model``
    itself (the harness writes the shape flat into resolved.json)."""
    shape = model.get("shape")
    return shape if isinstance(shape, dict) else model


def shape_ints(model: dict, keys: tuple[str, ...]) -> dict[str, int]:
    """The positive integers ``keys`` of the model's shape (:func:`shape_source`)."""
    src = shape_source(model)
    return {k: integer(get(src, k, "model.shape"), f"model.shape.{k}", 1) for k in keys}


def model_name(cfg: dict) -> str:
    name = (cfg.get("case") or {}).get("model") or (cfg.get("model") or {}).get("name")
    if not name:
        raise SettingsError("resolved config: case.model is missing")
    return str(name)


# -- reading a section into a dataclass, driven by its fields ---------------------------


def option(default: Any = MISSING, *, choices: tuple[str, ...] = (), minimum: int | None = None, accept_01: bool = False) -> Any:
    """A settings field: its default (none: required), the ``choices`` of a string, the
    ``minimum`` of an integer, ``accept_01`` for a boolean written 0/1."""
    return dataclasses.field(default=default, metadata={"choices": choices, "minimum": minimum, "accept_01": accept_01})


def check_value(field: dataclasses.Field, kind: Any, value: Any, where: str) -> Any:
    """``value`` checked and converted as ``field`` (of type ``kind``) declares."""
    meta = field.metadata
    optional = type(None) in typing.get_args(kind)
    if optional and value is None:
        return None
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind) if optional else kind
    if base is bool:
        return boolean(value, where, accept_01=meta.get("accept_01", False))
    if base is int:
        return integer(value, where, meta.get("minimum") or 0)
    if base is float:
        return number(value, where)
    if base is str and meta.get("choices"):
        return choice(value, where, meta["choices"])
    return value


def read(cls: type, section: dict, where: str, **given: Any) -> Any:
    """Dataclass ``cls`` from ``section`` (named ``where`` in errors): each field not ``given``
    is ``section[name]``, absent or null taking the field's default, checked by the field."""
    kinds = typing.get_type_hints(cls)
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name not in given:
            key = f"{where}.{f.name}"
            values[f.name] = check_value(f, kinds[f.name], get(section, f.name, where, f.default), key)
    return cls(**values)


# -- the typed model ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Train:
    """The common ``train`` keys; ``grad_accum``, ``lr_decay_steps`` and the betas are derived
    (:func:`read_train`)."""

    steps: int = option(minimum=1)
    global_batch: int = option(minimum=1)
    micro_batch: int = option(1, minimum=1)
    grad_accum: int = option()
    precision: str = option("bf16", choices=PRECISIONS)
    lr: float = option()
    min_lr: float = option(0.0)
    lr_warmup_steps: int = option(0)
    lr_decay_steps: int = option()
    weight_decay: float = option(0.0)
    clip_grad: float = option(0.0)
    adam_beta1: float = option()
    adam_beta2: float = option()
    adam_eps: float = option(1e-8)
    init_std: float = option(0.02)
    seed: int = option(1234)
    profile_step: int = option(0)
    ceiling_hold_s: float = option(0.0)


@dataclasses.dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int
    dp: int
    recompute: str


@dataclasses.dataclass(frozen=True)
class Data:
    data_dir: str | None
    cache_dir: str | None
    prefix: str | list | None
    synthetic_tokens: int | None
    format: str | None
    synthetic: corpus_spec.Spec = corpus_spec.V1


@dataclasses.dataclass(frozen=True)
class Common:
    """What every case reads from ``resolved.json``, for one phase."""

    model_name: str
    config_name: str
    params_nominal: float
    phase: str
    world_size: int
    train: Train
    parallel: Parallel
    data: Data
    device: str
    dist_backend: str
    output_dir: str | None
    sections: dict[str, dict]  # the phase's train / parallel / data as given: the case's own keys


def adam_betas(train: dict) -> tuple[float, float]:
    """``train.adam_beta1`` / ``adam_beta2`` (the keys every case.yaml states), each falling
    back on ``train.betas: [b1, b2]``, then on :data:`BETAS`."""
    pair = train.get("betas")
    if pair is not None and (not isinstance(pair, (list, tuple)) or len(pair) != 2):
        raise SettingsError(f"resolved config: train.betas must be a pair, got {pair!r}")
    b1 = get(train, "adam_beta1", "train", pair[0] if pair else BETAS[0])
    b2 = get(train, "adam_beta2", "train", pair[1] if pair else BETAS[1])
    return number(b1, "train.adam_beta1"), number(b2, "train.adam_beta2")


def read_train(train: dict, dp: int) -> Train:
    """The common ``train`` keys of one phase, for a data-parallel size ``dp``."""
    steps = integer(get(train, "steps", "train"), "train.steps", 1)
    gb = integer(get(train, "global_batch", "train"), "train.global_batch", 1)
    mb = integer(get(train, "micro_batch", "train", Train.micro_batch), "train.micro_batch", 1)
    accum = grad_accum(gb, mb, dp)
    for key in ("gradient_accumulation_steps", "grad_accum"):
        if train.get(key) is not None and integer(train[key], f"train.{key}", 1) != accum:
            raise SettingsError(
                f"train.{key} is {train[key]} but global batch {gb} / (micro batch {mb} x "
                f"data-parallel size {dp}) = {accum}: the global batch is fixed"
            )
    decay = integer(train.get("lr_decay_steps") or steps, "train.lr_decay_steps", 1)
    b1, b2 = adam_betas(train)
    t = read(Train, train, "train", grad_accum=accum, lr_decay_steps=decay, adam_beta1=b1, adam_beta2=b2)
    if t.profile_step > steps:
        raise SettingsError(f"train.profile_step = {t.profile_step} is beyond the run's {steps} steps")
    if t.ceiling_hold_s < 0:
        raise SettingsError(f"resolved config: train.ceiling_hold_s must be 0 or more seconds, got {t.ceiling_hold_s}")
    return t


def read_parallel(parallel: dict, world_size: int, recompute: tuple[str, ...] = ("none", "full")) -> Parallel:
    """tp, pp, the derived dp and ``recompute`` (one of the case's ``recompute`` choices)."""
    tp = integer(get(parallel, "tp", "parallel", 1), "parallel.tp", 1)
    pp = integer(get(parallel, "pp", "parallel", 1), "parallel.pp", 1)
    dp = data_parallel(world_size, tp, pp)
    if parallel.get("dp") is not None and integer(parallel["dp"], "parallel.dp", 1) != dp:
        raise SettingsError(f"parallel.dp = {parallel['dp']} but world size {world_size} / (tp {tp} x pp {pp}) = {dp}")
    rc = get(parallel, "recompute", "parallel", "none")
    if isinstance(rc, bool):  # FlagPerf's configs write recompute: true/false
        rc = "full" if rc else "none"
    return Parallel(tp=tp, pp=pp, dp=dp, recompute=choice(rc, "parallel.recompute", recompute))


def read_data(data: dict) -> Data:
    syn = data.get("synthetic_tokens")
    return Data(
        data_dir=data.get("data_dir") or None,
        cache_dir=data.get("cache_dir") or None,
        prefix=data.get("prefix") or None,
        synthetic_tokens=None if syn is None else integer(syn, "data.synthetic_tokens", 2),
        format=data.get("format") or None,
        synthetic=synthetic_spec(data),
    )


def synthetic_spec(data: dict) -> corpus_spec.Spec:
    """``data.synthetic`` read (SettingsError naming the key)."""
    try:
        return corpus_spec.read_spec(data.get("synthetic"))
    except ValueError as e:
        raise SettingsError(f"resolved config: {e}") from None


def from_config(cfg: dict, world_size: int, phase: str = "train", recompute: tuple[str, ...] = ("none", "full")) -> Common:
    """The common settings of ``phase`` for a run of ``world_size`` ranks."""
    for section in ("model", "train"):
        if not isinstance(cfg.get(section), dict):
            raise SettingsError(f"resolved config: section {section!r} is missing or not a mapping")
    sections = phase_sections(cfg, phase)
    par = read_parallel(sections["parallel"], world_size, recompute)
    tr = read_train(sections["train"], par.dp)
    for key in ("gradient_accumulation_steps", "grad_accum"):
        given = sections["parallel"].get(key)
        if given is not None and integer(given, f"parallel.{key}", 1) != tr.grad_accum:
            raise SettingsError(
                f"parallel.{key} is {given} but global batch {tr.global_batch} / (micro batch "
                f"{tr.micro_batch} x data-parallel size {par.dp}) = {tr.grad_accum}: the global batch is fixed"
            )
    vendor = cfg.get("vendor") or {}
    device = device_type(get(vendor, "device", "vendor", "cpu"))
    model = cfg["model"]
    return Common(
        model_name=model_name(cfg),
        config_name=str(cfg.get("config_name") or ""),
        params_nominal=number(get(model, "params_nominal", "model"), "model.params_nominal"),
        phase=phase,
        world_size=world_size,
        train=tr,
        parallel=par,
        data=read_data(sections["data"]),
        device=device,
        dist_backend=device_type(get(vendor, "dist_backend", "vendor", "gloo" if device == "cpu" else MISSING), "vendor.dist_backend"),
        output_dir=cfg.get("output_dir"),
        sections=sections,
    )
