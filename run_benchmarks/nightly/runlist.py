"""The nightly run list: its YAML format as validated models (docs/nightly.md).

Relative paths in a run list are relative to its folder; every error names the file, the
field and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from run_benchmarks.errors import InputError
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.planning.config import Strict, read_yaml, validate


class _Strict(Strict):
    model_config = ConfigDict(populate_by_name=True)  # merged with Strict's: the entries' "set" alias


class Tolerances(_Strict):
    """How far a median may move from the baseline before it is a regression, in percent."""

    throughput_drop_pct: float = Field(5.0, gt=0, lt=100)
    mfu_drop_pct: float = Field(5.0, gt=0, lt=100)
    memory_rise_pct: float = Field(10.0, gt=0)


class CaseTolerances(_Strict):
    throughput_drop_pct: float | None = Field(None, gt=0, lt=100)
    mfu_drop_pct: float | None = Field(None, gt=0, lt=100)
    memory_rise_pct: float | None = Field(None, gt=0)


class RunListEntry(_Strict):
    case: str  # model:framework:hardware:nnodes:nprocs
    vendor: str
    rounds: int = Field(3, ge=1, le=100)
    variant: str | None = None
    recipe: str = "standard"  # start_task.py --recipe
    sets: list[str] = Field([], alias="set")  # start_task.py --set KEY=VALUE
    # start_task.py --reference: the loss curve(s) to judge against instead of the committed one
    # (a run shortened by set: train.global_batch=... has none); relative to the run list's folder
    reference: list[str] = []
    tolerances: CaseTolerances = CaseTolerances()

    @field_validator("reference", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("case")
    @classmethod
    def _case(cls, v: str) -> str:
        try:
            cn = CaseName.parse(v)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        if len(v.split(":")) == 6:
            raise ValueError(f"give the round count as 'rounds:', not as the case name's repeat field ({cn.repeat})")
        return v

    @field_validator("vendor", "variant", "recipe")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        try:
            return None if v is None else check_name(v, "name")
        except InputError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("sets")
    @classmethod
    def _sets(cls, v: list[str]) -> list[str]:
        for text in v:
            try:
                planning.parse_override(text)
            except InputError as exc:
                raise ValueError(str(exc).replace("--set ", "set ")) from None
        return v


class RunList(_Strict):
    """A nightly run list (YAML).  Relative paths are relative to the run list's folder."""

    cases: list[RunListEntry]
    cluster: str | None = None  # cluster YAML as for start_task.py --cluster; none: this host
    log_dir: str = "logs/nightly"
    history_db: str | None = None  # default ~/.local/share/flagbench/history.sqlite
    report_dir: str | None = None  # default <log_dir>/reports
    baseline_runs: int = Field(5, ge=1, le=100)  # the baseline is the median of this many good runs
    tolerances: Tolerances = Tolerances()
    round_timeout_s: float | None = Field(None, gt=0)
    stall_timeout_s: float | None = Field(None, gt=0)  # as start_task.py --stall-timeout
    python: str | None = None  # as start_task.py --python: use this interpreter as is

    @field_validator("cases")
    @classmethod
    def _cases(cls, v: list[RunListEntry]) -> list[RunListEntry]:
        if not v:
            raise ValueError("at least one case is needed")
        seen: dict[tuple[Any, ...], int] = {}
        for i, c in enumerate(v):
            key = (c.case, c.vendor, c.variant, c.recipe, tuple(c.sets))
            if key in seen:
                raise ValueError(f"cases.{i} repeats cases.{seen[key]} ({c.case} on {c.vendor}); raise its 'rounds' instead")
            seen[key] = i
        return v


def parse_runlist(path: Path) -> RunList:
    """Load and validate; errors name the file, the field and what was expected."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping with a 'cases' list at the top level, got {type(data).__name__}")
    return validate(RunList, data, str(path))
