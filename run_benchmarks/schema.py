"""The typed records' base and one clear error for a record that does not validate: the field
path as users see it, the file named. Below every stage: planning's configs and the results and
reference records share it."""

from __future__ import annotations

import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from run_benchmarks.errors import InputError

M = TypeVar("M", bound=BaseModel)


class FieldError(ValueError):
    """A validator's error about a field below the one it validates: ``loc`` continues the
    error's location, so the message names that field."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def field_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the dotted field name users see in error messages."""
    return ".".join(str(x) for x in loc) or "(top level)"


def _inner_model(tp: Any) -> type[BaseModel] | None:
    """The model inside an annotation: ``M``, ``M | None``, ``list[M]``, ``dict[str, M]``."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that holds the field at ``loc`` (list indexes and mapping keys skipped)."""
    cur: type[BaseModel] | None = model
    for part in loc:
        if cur is None:
            return None
        fields = {f.alias or n: f for n, f in cur.model_fields.items()}
        if part not in fields:  # an index or a key of the container field before it
            continue
        cur = _inner_model(fields[part].annotation)
    return cur


def problem_line(model: type[BaseModel], err: Any, source: str) -> str:
    below = (err.get("ctx") or {}).get("error")
    if isinstance(below, FieldError):
        err = {**err, "loc": (*err["loc"], *below.loc)}
    if err["type"] == "extra_forbidden":
        parent = _model_at(model, tuple(err["loc"][:-1]))
        names = [f.alias or n for n, f in parent.model_fields.items()] if parent else []
        msg = "unknown field" + (f"; expected one of: {', '.join(names)}" if names else "")
    else:
        got = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            where = f"under '{field_path(err['loc'][:-1])}'" if len(err["loc"]) > 1 else "at the top level"
            msg = f"Field required; add '{err['loc'][-1]}: <value>' {where}"
        elif not isinstance(got, dict) and f"got {got!r}" not in msg:  # a validator's own message names it
            msg += f", got {got!r}"
    return f"{source}: field '{field_path(err['loc'])}': {msg}"


def validate(model: type[M], data: Any, source: str) -> M:
    """``model`` from parsed YAML; one clear InputError naming ``source`` and the field otherwise."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise InputError(problem_line(model, exc.errors()[0], source) + more) from None
