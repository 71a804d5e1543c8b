"""The model shape: one schema for case.yaml's model blocks, the FLOPs counters and the ranks.

A shape is a frozen dataclass with a default for every architecture flag, as torchtitan's model
flavors have. A case.yaml states its family's flags once, in ``shape_defaults``, and each model
block only what differs: its sizes. Planning reads every block through :func:`from_block`
(an unknown key or a bad value names the model and the key), and writes the whole shape, each
field resolved, into resolved.json; the ranks read it back with :func:`read`.

:class:`ModelShape` is a decoder-only transformer; :class:`LlavaShape` adds the vision tower and
the stated assumptions behind llava's palm FLOPs. Standard library only: the host side and every
framework environment import it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from training.settings import SettingsError, check_value, get, option, shape_source

#: the projections ``ModelShape.bias`` can name: attention's query, key, value and output, and
#: every linear of the MLP (its experts' too)
BIASED = ("q", "k", "v", "o", "mlp")
NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("silu", "gelu")
#: rope: rotary (base ``rope_base``); alibi: linear biases of the scores; learned: a table of
#: ``seq_length`` positions added to the embeddings (GPT-3)
POSITIONS = ("rope", "alibi", "learned")
#: linear: a plain output projection; normhead: Baichuan2's, its rows normalised
OUTPUT_LAYERS = ("linear", "normhead")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer; the defaults are a Llama-style decoder."""

    num_layers: int = option(minimum=1)
    hidden_size: int = option(minimum=1)
    num_heads: int = option(minimum=1)
    seq_length: int = option(minimum=1)
    vocab_size: int = option(minimum=1)
    ffn_hidden_size: int = option(minimum=1)
    num_kv_groups: int | None = option(None, minimum=1)  # none: multi-head attention (groups == heads)
    gated_mlp: bool = option(True)  # SwiGLU: three matrices; a plain MLP: two
    hidden_act: str = option("silu", choices=ACTIVATIONS)
    tied_embeddings: bool = option(False)
    bias: bool | tuple[str, ...] = option(False)  # linear biases: all (true), none, or of the named projections (Qwen2: [q, k, v])
    norm: str = option("rmsnorm", choices=NORMS)  # rmsnorm: weight only; layernorm: weight + bias
    norm_eps: float = option(1e-5)
    position_embedding: str = option("rope", choices=POSITIONS)
    rope_base: float = option(10000.0)
    max_position_embeddings: int | None = option(None, minimum=1)  # none: seq_length
    output_layer: str = option("linear", choices=OUTPUT_LAYERS)
    z_loss_weight: float = option(0.0)  # Baichuan2's max-z auxiliary loss (0: none)
    num_experts: int = option(0)  # > 0: each layer's MLP is that many experts behind a router (no bias)
    moe_top_k: int = option(0)  # experts each token passes (1 .. num_experts)
    moe_ffn_hidden_size: int | None = option(None, minimum=1)  # an expert's FFN width (none: ffn_hidden_size)

    def __post_init__(self) -> None:
        if not isinstance(self.bias, bool):
            parts = tuple(self.bias) if isinstance(self.bias, (list, tuple)) else ()
            unknown = sorted(set(map(str, parts)) - set(BIASED))
            if unknown or not parts:
                raise SettingsError(f"bias: true, false or a list of {', '.join(BIASED)}; got {self.bias!r}")
            object.__setattr__(self, "bias", parts)
        if self.num_kv_groups is None:
            object.__setattr__(self, "num_kv_groups", self.num_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.hidden_size % self.num_heads:
            raise SettingsError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_groups:
            raise SettingsError(f"num_heads {self.num_heads} does not split evenly into num_kv_groups {self.num_kv_groups}")
        if self.seq_length > self.max_position_embeddings:
            raise SettingsError(f"seq_length {self.seq_length} exceeds max_position_embeddings {self.max_position_embeddings}")
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise SettingsError(f"moe_top_k must be 1..num_experts ({self.num_experts}), got {self.moe_top_k}")

    def biased(self, part: str) -> bool:
        """Whether projection ``part`` (one of :data:`BIASED`) has a bias."""
        return self.bias is True or (not isinstance(self.bias, bool) and part in self.bias)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_groups(self) -> int:
        return int(self.num_kv_groups or self.num_heads)

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding == "learned"

    def as_dict(self) -> dict[str, Any]:
        """The whole shape, every field resolved (what resolved.json holds)."""
        out = dataclasses.asdict(self)
        if isinstance(self.bias, tuple):
            out["bias"] = list(self.bias)
        return out

    def differs(self, flags: dict[str, Any], family: str) -> list[str]:
        """The ``flags`` this shape does not have, each as ``key is X, <family> has Y``: a case's
        model code refuses a shape its modules do not build."""
        return [f"{k} is {getattr(self, k)!r}, {family} has {v!r}" for k, v in flags.items() if getattr(self, k) != v]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlavaShape(ModelShape):
    """LLaVA: a Llama-style language model, a CLIP vision tower and the projector between."""

    image_token_index: int = option(minimum=0)
    vision_num_layers: int = option(minimum=1)
    vision_hidden_size: int = option(minimum=1)
    vision_ffn_hidden_size: int = option(minimum=1)
    vision_num_heads: int = option(minimum=1)
    image_size: int = option(minimum=1)
    patch_size: int = option(minimum=1)
    #: per phase, the mean sample length and images per sample behind the palm FLOPs
    #: (training.flops_llava): the case's stated assumptions, not a measurement of the run
    palm_assumptions: dict = option()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vision_hidden_size % self.vision_num_heads:
            raise SettingsError(
                f"vision_hidden_size {self.vision_hidden_size} is not a multiple of vision_num_heads {self.vision_num_heads}"
            )
        if self.image_size % self.patch_size:
            raise SettingsError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if not isinstance(self.palm_assumptions, dict) or not self.palm_assumptions:
            raise SettingsError("palm_assumptions: per phase, {mean_seq_length, images_per_sample}")
        for phase, a in self.palm_assumptions.items():
            if not isinstance(a, dict) or set(a) != {"mean_seq_length", "images_per_sample"}:
                raise SettingsError(f"palm_assumptions.{phase}: exactly mean_seq_length and images_per_sample, got {a!r}")


def fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _checked(cls: type, source: dict, loc: tuple[str, ...], names: set[str] | None = None) -> dict[str, Any]:
    """The fields of ``cls`` (those in ``names``, or all) from ``source``, each checked by its
    type and an absent one taking its default; an error carries the field's ``loc``."""
    kinds = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        at = (*loc, f.name)
        try:
            values[f.name] = check_value(f, kinds[f.name], get(source, f.name, ".".join(loc), f.default), ".".join(at))
        except SettingsError as e:
            raise SettingsError(str(e), loc=at, reason=e.reason) from None
    return values


def read(source: dict, cls: type = ModelShape, loc: tuple[str, ...] = ("model", "shape")) -> Any:
    """A shape of ``cls`` from ``source`` (a mapping that may hold other keys, as resolved.json's
    ``model`` does), named ``loc`` in errors: each field checked by its type, an absent one
    taking its default, then the shape's own rules (:meth:`ModelShape.__post_init__`)."""
    values = _checked(cls, source, loc)
    try:
        return cls(**values)
    except SettingsError as e:
        raise SettingsError(f"{'.'.join(loc)}: {e}", loc=loc, reason=str(e)) from None


def typed(shape: Any, cls: type = ModelShape) -> Any:
    """``shape`` when it already is a ``cls``, else the mapping read through it (:func:`read`):
    a missing or bad field is refused, never defaulted by the caller."""
    return shape if isinstance(shape, cls) else read(shape, cls)


#: the flags of a Llama-style decoder (the schema's defaults): what llama3's and llava's language
#: models build, and the megatron scaffold's
LLAMA = {
    "gated_mlp": True,
    "hidden_act": "silu",
    "tied_embeddings": False,
    "bias": False,
    "norm": "rmsnorm",
    "position_embedding": "rope",
    "output_layer": "linear",
    "z_loss_weight": 0.0,
    "num_experts": 0,
}
#: a GPT-2/GPT-3-style decoder: gpt3's, and the paddle and DeepSpeed scaffolds'
GPT = {
    **LLAMA,
    "gated_mlp": False,
    "hidden_act": "gelu",
    "tied_embeddings": True,
    "bias": True,
    "norm": "layernorm",
    "position_embedding": "learned",
}


def built(model: dict, flags: dict[str, Any], family: str, cls: type = ModelShape, multi_head: bool = False) -> Any:
    """The shape in resolved.json's ``model`` (flat, or under ``model.shape``), as a case's ranks
    read it: refused in one message where the case's model code does not build it (a flag other
    than ``flags``; grouped-query attention where the model has ``multi_head`` attention only)."""
    shape = read(shape_source(model), cls)
    wrong = shape.differs(flags, family)
    if multi_head and shape.kv_groups != shape.num_heads:
        wrong.append(f"num_kv_groups is {shape.kv_groups}: {family} has multi-head attention ({shape.num_heads} groups)")
    if wrong:
        raise SettingsError(f"resolved config: model.shape: {'; '.join(wrong)}")
    return shape


def from_block(cls: type, defaults: dict, block: dict, loc: tuple[str, ...]) -> Any:
    """The shape a case.yaml model block (at ``loc``) states: the family's ``defaults`` with the
    block over them. A key that is no field of ``cls``, or a bad default, is named where it is
    written."""
    for at, part in ((("shape_defaults",), defaults), (loc, block)):
        unknown = sorted(set(part) - fields(cls))
        if unknown:
            reason = f"{', '.join(unknown)} is not a field of {cls.__name__} (training/shapes.py)"
            raise SettingsError(f"{'.'.join(at)}: {reason}", loc=at, reason=reason)
    _checked(cls, defaults, ("shape_defaults",), set(defaults) - set(block))
    return read({**defaults, **block}, cls, loc)


#: the schemas a case.yaml's ``shape_schema`` can name
SCHEMAS = {cls.__name__: cls for cls in (ModelShape, LlavaShape)}


def schema(name: str) -> type:
    """The shape class a case.yaml's ``shape_schema`` names."""
    if name not in SCHEMAS:
        reason = f"{name!r} is not one of {', '.join(SCHEMAS)} (training/shapes.py)"
        raise SettingsError(f"shape_schema: {reason}", loc=("shape_schema",), reason=reason)
    return SCHEMAS[name]


def case_shape(case: dict, model: str) -> Any:
    """The shape of ``model`` in a loaded case.yaml mapping: its ``shape_defaults`` with the
    model block's ``shape`` over them, read through its ``shape_schema``."""
    loc = ("models", model, "shape")
    entry = (case.get("models") or {}).get(model)
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), dict):
        raise SettingsError(f"models.{model}.shape: a mapping is needed", loc=loc, reason="a mapping is needed")
    defaults = case.get("shape_defaults") or {}
    if not isinstance(defaults, dict):
        raise SettingsError("shape_defaults: a mapping is needed", loc=("shape_defaults",), reason="a mapping is needed")
    return from_block(schema(str(case.get("shape_schema") or "ModelShape")), defaults, entry["shape"], loc)


def complete(case: dict) -> dict:
    """A copy of a loaded case.yaml mapping with every model's whole shape (:func:`case_shape`)."""
    models = {name: {**entry, "shape": case_shape(case, name).as_dict()} for name, entry in (case.get("models") or {}).items()}
    return {**case, "models": models}
