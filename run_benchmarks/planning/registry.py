"""Finds cases and vendors by name and resolves a case's effective settings.

The registry is the file tree: ``cases/<family>/<framework>/case.yaml`` and
``vendors/<vendor>/vendor.yaml``.  Shared code never branches on a vendor or
case name; it reads their data.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.planning.config import STANDARD_RECIPE, CaseConfig, Recipe, VendorCaseConfig, VendorConfig, load

ROOT = Path(__file__).resolve().parents[2]
CASES_DIR = ROOT / "cases"
VENDORS_DIR = ROOT / "vendors"
META_KEYS = {"description", "validated", "validated_by", "hook"}


@dataclasses.dataclass(frozen=True)
class CaseEntry:
    path: Path  # the case folder
    config: CaseConfig


def cases(cases_dir: Path = CASES_DIR) -> dict[str, CaseEntry]:
    """model name -> case, over every case.yaml."""
    out: dict[str, CaseEntry] = {}
    for yml in sorted(cases_dir.glob("*/*/case.yaml")):
        cfg = load(CaseConfig, yml)
        if (cfg.family, cfg.framework) != (yml.parent.parent.name, yml.parent.name):
            raise InputError(
                f"{yml}: family/framework {cfg.family}/{cfg.framework} do not match the folder {yml.parent.parent.name}/{yml.parent.name}"
            )
        for model in cfg.models:
            if model in out and out[model].config.framework == cfg.framework:
                raise InputError(f"{yml}: model {model!r} is also served by {out[model].path}")
            out.setdefault(model, CaseEntry(yml.parent, cfg))
            out[f"{model}:{cfg.framework}"] = CaseEntry(yml.parent, cfg)
    return out


def vendors(vendors_dir: Path = VENDORS_DIR) -> list[str]:
    return sorted(p.parent.name for p in vendors_dir.glob("*/vendor.yaml"))


def load_vendor(name: str, vendors_dir: Path = VENDORS_DIR) -> VendorConfig:
    check_name(name, "vendor")
    path = vendors_dir / name / "vendor.yaml"
    if not path.is_file():
        raise InputError(f"unknown vendor {name!r}: known vendors are {', '.join(vendors(vendors_dir)) or 'none'}")
    v = load(VendorConfig, path)
    if v.name != name:
        raise InputError(f"{path}: field 'name': {v.name!r} does not match the folder {name!r}")
    return v


def find_case(cn: CaseName, cases_dir: Path = CASES_DIR) -> CaseEntry:
    table = cases(cases_dir)
    entry = table.get(f"{cn.model}:{cn.framework}")
    if entry is None:
        models = sorted(k for k in table if ":" in k)
        if cn.model not in table:
            raise InputError(f"unknown model {cn.model!r}: known are {', '.join(m.replace(':', ' on ') for m in models)}")
        raise InputError(
            f"model {cn.model!r} has no case for framework {cn.framework!r}: it runs on {', '.join(frameworks_serving(cn.model, table))}"
        )
    return entry


def frameworks_serving(model: str, table: dict[str, CaseEntry]) -> list[str]:
    """The frameworks whose case serves ``model``, from a ``cases()`` table."""
    return sorted(k.split(":")[1] for k in table if k.startswith(model + ":"))


def vendor_config_dir(vendor: str, model: str, framework: str, vendors_dir: Path = VENDORS_DIR) -> Path:
    """``vendors/<vendor>/cases/<model>/<framework>/``: where a vendor's configs of one case model live."""
    return vendors_dir / vendor / "cases" / model / framework


def config_stem(cn: CaseName, variant: str | None) -> str:
    """``config_<HW>x<N>x<M>[_<variant>]``, the name of a vendor config without its suffix."""
    return f"config_{cn.size}" + (f"_{check_name(variant, 'variant')}" if variant else "")


def vendor_config_path(vendor: str, cn: CaseName, variant: str | None, vendors_dir: Path = VENDORS_DIR) -> Path:
    """The vendor's config for the case name's model, framework and size (and layout variant)."""
    folder = vendor_config_dir(vendor, cn.model, cn.framework, vendors_dir)
    stem = config_stem(cn, variant)
    path = folder / f"{stem}.yaml"
    if path.is_file():
        return path
    root = vendors_dir.parent
    old = folder.parent / path.name
    if old.is_file():
        raise InputError(
            f"vendor {vendor!r}: {old.relative_to(root)} is in the old layout (no framework folder); "
            f"configs of {cn.model} on {cn.framework} live in {folder.relative_to(root)}/: move it to {path.relative_to(root)}"
        )
    have = sorted(p.stem for p in folder.glob("config_*.yaml")) if folder.is_dir() else []
    stale = sorted(p.name for p in folder.parent.glob("config_*.yaml")) if folder.parent.is_dir() else []
    raise InputError(
        f"vendor {vendor!r} has no {stem} for {cn.model} on {cn.framework} ({path.relative_to(root)} missing); "
        f"configs that exist: {', '.join(have) if have else 'none'}"
        + (
            f"; {folder.parent.relative_to(root)}/ holds {', '.join(stale)} in the old layout: move them into {folder.relative_to(root)}/"
            if stale
            else ""
        )
    )


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def get_path(d: dict[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = d
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
        if not isinstance(cur, dict):
            raise InputError(f"override {dotted!r}: {part!r} is not a section")
    cur[parts[-1]] = value


def allowed(path: str, whitelist: list[str]) -> bool:
    """A path is allowed when it or one of its parent sections is whitelisted."""
    return any(path == w or path.startswith(w + ".") for w in whitelist)


def known_setting(path: str, standard: dict[str, Any], case: CaseConfig) -> bool:
    """Whether ``path`` names a setting of the case: a value of its standard settings, a key a
    vendor may change (or one under such a section), or either of those for one of the case's
    phases (``train.phases.<phase>.<key>`` for ``train.<key>``)."""
    if path in flatten(standard) or allowed(path, case.vendor_may_change):
        return True
    parts = path.split(".")
    if len(parts) > 3 and parts[1] == "phases" and parts[2] in case.phases:
        return known_setting(".".join([parts[0], *parts[3:]]), standard, case)
    return False


def unknown_setting_hint(path: str, standard: dict[str, Any], case: CaseConfig) -> str:
    """The case's settings closest to a name it does not know, for the error message."""
    names = sorted(set(flatten(standard)) | {w for w in case.vendor_may_change})
    close = difflib.get_close_matches(path, names, n=3, cutoff=0.8)
    section = path.split(".")[0]
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"its {section} settings: {', '.join(n for n in names if n.startswith(section + '.'))}"


def standard_settings(case: CaseConfig, model: str, recipe: str = STANDARD_RECIPE) -> dict[str, Any]:
    """The case's standard settings for one model: train, parallel, data; under a named recipe
    (the model's ``recipes``), its train and data values laid over them."""
    std = case.standard.model_dump()
    m = case.models[model]
    out = deep_merge(std, {"train": m.train, "parallel": m.parallel, "data": m.data})
    if recipe != STANDARD_RECIPE:
        r = recipe_of(case, model, recipe)
        out = deep_merge(out, {"train": r.train, "data": r.data})
    return out


def recipe_of(case: CaseConfig, model: str, recipe: str) -> Recipe:
    """A model's named recipe; InputError naming case.yaml and the recipes it has."""
    found = case.models[model].recipes.get(recipe)
    if found is None:
        have = ", ".join([STANDARD_RECIPE, *case.models[model].recipes])
        raise InputError(f"--recipe {recipe!r}: {case.family}/{case.framework}/case.yaml gives {model} no such recipe (it has: {have})")
    return found


def fairness_check(values: dict[str, Any], case: CaseConfig, standard: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """Reject any vendor value the case does not allow; list the overrides applied."""
    overrides = []
    for path, value in sorted(flatten(values).items()):
        if not allowed(path, case.vendor_may_change):
            raise InputError(
                f"{source}: parameter '{path}' may not be changed by a vendor for this case (allowed: {', '.join(case.vendor_may_change)})"
            )
        if value != get_path(standard, path):  # a value equal to the standard overrides nothing
            overrides.append({"param": path, "value": value, "standard": get_path(standard, path)})
    return overrides


def load_vendor_case(path: Path) -> VendorCaseConfig:
    return load(VendorCaseConfig, path)


def counter(case: CaseConfig) -> Callable[..., dict[str, Any]]:
    return _function(case, "flops", case.flops)


def memory_model(case: CaseConfig) -> Callable[..., dict[str, Any]] | None:
    """The case's lower bound of its states' memory (training/memory.py), None when it names none."""
    return _function(case, "memory", case.memory) if case.memory else None


def settings_check(case: CaseConfig) -> Callable[[dict[str, Any], int], Any] | None:
    """The case's own reader of its settings (``fn(resolved, world_size)``, raising
    training.settings.SettingsError), None when it names none."""
    return _function(case, "settings", case.settings) if case.settings else None


def _function(case: CaseConfig, field: str, spec: str) -> Callable[..., dict[str, Any]]:
    module, _, func = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"case {case.family}/{case.framework}: {field} function {spec!r} not found: {exc}") from None


def shown_paths(paths: str) -> str:
    """A reference's ``path`` (several files joined by "; ") with each file :func:`shown`."""
    return "; ".join(shown(p) for p in paths.split("; "))


def shown(path: str | Path) -> str:
    """A path as results and messages name it: relative to the repository where it lies inside."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)
