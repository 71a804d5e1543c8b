"""A hardware vendor's config says ``validated: true`` only where this project ran it as it stands.

Such a config's description names the committed results.json of that run
(``docs/results/runs/<file>.json``), and the file must be a run of this very config: the same
vendor, model, framework, chip, node and process counts and config name; every value the config
sets is the value the run used; and the run's own ``--set`` values either change only its length
and global batch (steps, warm-up, global batch, profiled step: the reductions every GPU run here
makes, listed in its results.json and in docs/results/README.md) or hold what the config holds
now. A config only measured elsewhere (a seed's FlagPerf figure, a probe outside the harness)
stays ``validated: false``. The cpu vendor's configs are exempt: the test suite itself runs them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from run_benchmarks import registry

ROOT = registry.ROOT
RUNS = ROOT / "docs" / "results" / "runs"
NAME = re.compile(r"^config_(?P<chip>.+)x(?P<nnodes>\d+)x(?P<nprocs>\d+)(?:_(?P<variant>.+))?\.yaml$")
RUN_FILE = re.compile(r"runs/([\w.\-]+\.json)")
#: --set keys a validating run may change without changing the config it validates
RUN_LENGTH = re.compile(r"^train\.(?:phases\.\w+\.)?(?:steps|warmup_steps|global_batch|profile_step)$")
SECTIONS = ("train", "parallel", "data")


class _Missing:
    def __repr__(self) -> str:
        return "nothing (not set)"


MISSING = _Missing()


def _get(doc: dict, path: str) -> Any:
    """The value at a dotted path, MISSING where there is none (a null value is a value)."""
    parent, _, last = path.rpartition(".")
    node = registry.get_path(doc, parent) if parent else doc
    return node[last] if isinstance(node, dict) and last in node else MISSING


def validated_configs() -> list[Path]:
    found = []
    for path in sorted(registry.VENDORS_DIR.glob("*/cases/*/*/config_*.yaml")):
        vendor = path.relative_to(registry.VENDORS_DIR).parts[0]
        if vendor != "cpu" and (yaml.safe_load(path.read_text()) or {}).get("validated") is True:
            found.append(path)
    return found


def problems(path: Path, runs: Path = RUNS) -> list[str]:
    """Why ``path`` (a config saying ``validated: true``) is not backed by a recorded run; [] if it is."""
    rel = path.relative_to(registry.VENDORS_DIR)
    vendor, model, framework = rel.parts[0], rel.parts[2], rel.parts[3]
    m = NAME.match(path.name)
    if not m:
        return [f"{path.name}: not a config_<chip>x<nodes>x<procs>[_<variant>].yaml name"]
    doc = yaml.safe_load(path.read_text()) or {}
    named = RUN_FILE.findall(str(doc.get("description") or ""))
    if not named:
        return ["its description names no docs/results/runs/<file>.json of the run that validated it"]
    sets = registry.flatten({sec: doc[sec] for sec in SECTIONS if doc.get(sec)})
    why: list[str] = []
    for name in named:
        file = runs / name
        if not file.is_file():
            why.append(f"{name}: no such file in {runs}")
            continue
        res = json.loads(file.read_text())
        case = str(res.get("case", "")).split(":")
        expect = {
            "vendor": (res.get("vendor"), vendor),
            "model": (res.get("model"), model),
            "framework": (res.get("framework"), framework),
            "chip": (case[2] if len(case) > 2 else None, m["chip"]),
            "nnodes": (res.get("nnodes"), int(m["nnodes"])),
            "nprocs": (res.get("nprocs"), int(m["nprocs"])),
            "config_name": (res.get("config_name"), path.stem),
        }
        wrong = [f"{k} {got!r} (the config: {want!r})" for k, (got, want) in expect.items() if got != want]
        settings = res.get("settings") or {}
        wrong += [f"{k} ran as {_get(settings, k)!r}, the config sets {v!r}" for k, v in sets.items() if _get(settings, k) != v]
        for o in res.get("user_overrides") or []:
            key, value = o["param"], o["value"]
            if not RUN_LENGTH.match(key) and sets.get(key, MISSING) != value:
                wrong.append(f"--set {key}={value!r}, which the config does not hold")
        statuses = [r.get("status") for r in res.get("rounds") or []]
        if not statuses or any(s not in ("ok", "unjudged") for s in statuses):
            wrong.append(f"round status {statuses}")
        if not wrong:
            return []
        why.append(f"{name}: " + "; ".join(wrong))
    return why


@pytest.mark.parametrize("path", validated_configs(), ids=lambda p: str(p.relative_to(registry.VENDORS_DIR)))
def test_a_validated_config_names_the_run_of_it(path: Path) -> None:
    assert problems(path) == [], f"{path.relative_to(ROOT)} says validated: true"


def test_the_check_refuses_what_it_should(tmp_path: Path) -> None:
    """The rule bites: an unnamed run, another config's run, a setting the run did not use, a
    --set of a switch the config does not hold, a failed round."""
    vendor_dir = tmp_path / "vendors" / "nvidia" / "cases" / "llava1.5_7b" / "deepspeed"
    vendor_dir.mkdir(parents=True)
    runs = tmp_path / "runs"
    runs.mkdir()
    run = {
        "vendor": "nvidia",
        "model": "llava1.5_7b",
        "framework": "deepspeed",
        "case": "llava1.5_7b:deepspeed:H200:1:4:1",
        "nnodes": 1,
        "nprocs": 4,
        "config_name": "config_H200x1x4",
        "settings": {"train": {"phases": {"finetune": {"micro_batch": 16}}}, "parallel": {"recompute": "none"}},
        "user_overrides": [{"param": "train.steps", "value": 25}, {"param": "parallel.recompute", "value": "none"}],
        "rounds": [{"status": "ok"}],
    }
    (runs / "r.json").write_text(json.dumps(run))
    cfg = vendor_dir / "config_H200x1x4.yaml"

    def check(description: str, parallel: str = "{recompute: none}") -> list[str]:
        cfg.write_text(
            f"description: {description}\nvalidated: true\ntrain: {{phases: {{finetune: {{micro_batch: 16}}}}}}\nparallel: {parallel}\n"
        )
        old = registry.VENDORS_DIR
        registry.VENDORS_DIR = tmp_path / "vendors"
        try:
            return problems(cfg, runs)
        finally:
            registry.VENDORS_DIR = old

    assert check("run as it stands (docs/results/runs/r.json)") == []
    assert "names no" in check("run on 4 x H200")[0]
    assert "no such file" in check("see runs/missing.json")[0]
    assert "parallel.recompute ran as 'none', the config sets 'full'" in check("runs/r.json", "{recompute: full}")[0]
    assert "parallel.fused_elementwise ran as nothing (not set)" in check("runs/r.json", "{recompute: none, fused_elementwise: compile}")[0]
    run["user_overrides"].append({"param": "parallel.attention", "value": "flex"})
    (runs / "r.json").write_text(json.dumps(run))
    assert "--set parallel.attention='flex'" in check("runs/r.json")[0]
    run["user_overrides"].pop()
    run["config_name"], run["rounds"] = "config_H200x1x4_other", [{"status": "failed"}]
    (runs / "r.json").write_text(json.dumps(run))
    said = check("runs/r.json")[0]
    assert "config_name 'config_H200x1x4_other'" in said and "round status ['failed']" in said
