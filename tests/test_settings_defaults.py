"""One default per setting: the settings reader is driven by the dataclass fields
(training.settings.read), and a case.yaml's ``standard`` states the same keys and values
as the case's own settings dataclasses.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import yaml

from run_benchmarks.planning.registry import CASES_DIR
from training import settings as common
from training.settings import MISSING, SettingsError, option


@dataclasses.dataclass(frozen=True)
class Switches:
    given: int
    depth: int = option(minimum=1)
    mode: str = option("fast", choices=("fast", "safe"))
    flag: bool = option(False)
    legacy_flag: bool = option(True, accept_01=True)
    ratio: float = option(0.5)
    limit: int | None = option(None, minimum=2)


def test_read_takes_each_field_from_the_section():
    sw = common.read(Switches, {"depth": 3, "mode": "safe", "flag": True, "legacy_flag": 0, "ratio": 1, "limit": 4}, "parallel", given=7)
    assert sw == Switches(given=7, depth=3, mode="safe", flag=True, legacy_flag=False, ratio=1.0, limit=4)


def test_an_absent_or_null_key_takes_the_field_default():
    sw = common.read(Switches, {"depth": 2.0, "mode": None}, "parallel", given=0)
    assert sw == Switches(given=0, depth=2, mode="fast", flag=False, legacy_flag=True, ratio=0.5, limit=None)
    assert isinstance(sw.depth, int)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "parallel.depth is missing"),
        ({"depth": 0}, "parallel.depth must be >= 1, got 0"),
        ({"depth": 1, "mode": "slow"}, "parallel.mode must be one of fast, safe, got 'slow'"),
        ({"depth": 1, "flag": 1}, "parallel.flag must be true or false, got 1"),
        ({"depth": 1, "ratio": "x"}, "parallel.ratio must be a number, got 'x'"),
        ({"depth": 1, "limit": 1}, "parallel.limit must be >= 2, got 1"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(section, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        common.read(Switches, section, "parallel", given=0)


def common_keys() -> dict[str, set[str]]:
    """What training/settings.py reads of each section."""
    accum = {"gradient_accumulation_steps", "grad_accum"}
    return {
        "train": {f.name for f in dataclasses.fields(common.Train)} | accum | {"betas"},
        "parallel": {f.name for f in dataclasses.fields(common.Parallel)} | accum,
        "data": {f.name for f in dataclasses.fields(common.Data)},
    }


def cases_with_own_readers() -> list[tuple[str, dict, dict]]:
    out = []
    for path in sorted(CASES_DIR.glob("*/*/case.yaml")):
        family, framework = path.parent.parent.name, path.parent.name
        module = importlib.import_module(f"cases.{family}.{framework}.settings")
        if hasattr(module, "OWN"):
            out.append((f"{family}/{framework}", yaml.safe_load(path.read_text())["standard"], module.OWN))
    return out


CASES = cases_with_own_readers()


def test_the_readers_cases_are_found():
    assert {"llama3/megatron", "gpt3/paddle"} <= {name for name, _, _ in CASES}


@pytest.mark.parametrize(("name", "standard", "own"), CASES, ids=[c[0] for c in CASES])
def test_case_standard_states_each_own_default(name, standard, own):
    """Each key a case reads with its dataclass is in case.yaml ``standard`` with the field's default."""
    for section, cls in own.items():
        for f in dataclasses.fields(cls):
            if f.default is MISSING or not f.metadata:  # required, or given by the common settings (no option())
                continue
            assert f.name in standard[section], f"{name}: case.yaml standard.{section} lacks {f.name} ({cls.__name__})"
            assert standard[section][f.name] == f.default, (
                f"{name}: case.yaml standard.{section}.{f.name} is {standard[section][f.name]!r}, {cls.__name__}.{f.name} defaults to {f.default!r}"
            )


@pytest.mark.parametrize(("name", "standard", "own"), CASES, ids=[c[0] for c in CASES])
def test_case_standard_has_no_key_nobody_reads(name, standard, own):
    known = common_keys()
    for section, cls in own.items():
        known[section] |= {f.name for f in dataclasses.fields(cls)}
    for section, keys in standard.items():
        unread = set(keys) - known.get(section, set()) - set(common.HOST_KEYS.get(section, ()))
        assert not unread, f"{name}: case.yaml standard.{section} has keys no settings reader knows: {sorted(unread)}"
