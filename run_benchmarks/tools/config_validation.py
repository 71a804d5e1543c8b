"""What validates a vendor config (``validated: true``): a committed run of it, with its layout,
judged aligned by its recipe's committed reference as that reference is now (``flagbench
check`` and tools/vendor_tools.py read it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from run_benchmarks import typed_results as tr
from run_benchmarks.errors import InputError
from run_benchmarks.judging.loss_gate import judge_loss
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning import registry
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.planning.curves import committed_path, read_reference
from run_benchmarks.planning.references import recipe_sets
from run_benchmarks.planning.registry import shown


def same_layout(ours: dict[str, Any], run: dict[str, Any], standard: dict[str, Any]) -> bool:
    """Whether a run's settings (``run``) had the layout of ``ours``: the same parallel values and
    micro batch, where a parallel switch the case gained after the run counts as the run's only at
    the case's ``standard`` value (a switch's standard is what the case did before it had one)."""
    mine, theirs = ours.get("parallel") or {}, run.get("parallel") or {}
    since = {k: v for k, v in mine.items() if k not in theirs}
    if any(k not in (standard.get("parallel") or {}) or standard["parallel"][k] != v for k, v in since.items()):
        return False
    kept = {k: v for k, v in mine.items() if k in theirs}
    return (kept, ours.get("train", {}).get("micro_batch")) == (theirs, run.get("train", {}).get("micro_batch"))


def validation_problem(cfg_path: Path) -> str | None:
    """Why a vendor config's ``validated: true`` does not hold, or None (it holds, or the config
    claims nothing). It holds when ``validated_by`` names a committed results.json of this vendor,
    model and config, run with the config's layout under a recipe whose committed reference judges
    every phase of one of its clean rounds aligned (judged again here, against the reference as it
    is now), and not one of that reference's own repeats. "Not judged" never validates."""
    import re

    vcfg = registry.load_vendor_case(cfg_path)
    if not vcfg.validated:
        return None
    if not vcfg.validated_by:
        return "validated: true needs validated_by: docs/results/runs/<file>.json, a run of this config judged aligned"
    vendor, model, framework = cfg_path.parts[-5], cfg_path.parts[-3], cfg_path.parts[-2]
    found = re.fullmatch(r"config_(\w+?)x(\d+)x(\d+)(?:_(\w+))?", cfg_path.stem)
    if found is None:
        return f"{cfg_path.name}: not a config_<HW>x<nodes>x<procs>[_<variant>] name"
    hw, nnodes, nprocs, _ = found.groups()
    run_path = registry.ROOT / vcfg.validated_by
    if not run_path.is_file():
        return f"validated_by {vcfg.validated_by}: no such file in the repository"
    try:
        res = tr.load(run_path)
    except InputError as exc:
        return f"validated_by {vcfg.validated_by}: {exc}"
    for what, ours, theirs in (("vendor", vendor, res.vendor), ("model", model, res.model), ("config", cfg_path.stem, res.config_name)):
        if ours != theirs:
            return f"validated_by {vcfg.validated_by}: a run of {what} {theirs!r}, not {ours!r}"
    if changed := recipe_sets(res.user_overrides, None, res.settings.get("train")):
        return f"validated_by {vcfg.validated_by}: --set {', '.join(changed)} changes its {res.recipe} recipe"
    cn = CaseName.parse(f"{model}:{framework}:{hw}:{nnodes}:{nprocs}")
    entry = registry.find_case(cn)
    try:
        settings = planning.resolve(cn, registry.load_vendor(vendor), entry, cfg_path, recipe=res.recipe).settings
    except InputError as exc:
        return f"{exc}"
    if not same_layout(settings, res.settings, registry.standard_settings(entry.config, model, res.recipe)):
        return f"validated_by {vcfg.validated_by}: its layout (parallel, micro batch) is not the config's as it stands"
    problems = []
    for rnd in (r for r in res.rounds if r.status == "ok"):
        verdicts = []
        for p in rnd.phases:
            fp = ((res.data or {}).get(p.phase) or {}).get("fingerprint")
            path = committed_path(entry.path, model, res.recipe, p.phase, fp)
            if not path.is_file():
                verdicts.append(f"phase {p.phase}: no committed reference ({shown(path)})")
                continue
            raw = path.read_text()
            doc = json.loads(raw)
            if any(r.get("run_id") == res.run_id or r.get("path", "").startswith(vcfg.validated_by) for r in doc.get("repeats") or []):
                verdicts.append(f"phase {p.phase}: the run is one of {shown(path)}'s own repeats")
                continue
            if res.run_id in raw or Path(vcfg.validated_by).name in raw:  # a reference of one run names it
                verdicts.append(f"phase {p.phase}: the run is the one {shown(path)} was made of")
                continue
            ref = read_reference(path, p.phase)
            gate = judge_loss(p.loss, ref, p.window.warmup_steps)
            if gate.verdict != "aligned":
                verdicts.append(f"phase {p.phase}: {gate.verdict} against {shown(path)} ({gate.reason})")
        if not verdicts:
            return None
        problems.append(f"round {rnd.round}: " + "; ".join(verdicts))
    return f"validated_by {vcfg.validated_by}: not a run judged aligned: " + ("; ".join(problems) or "no round of status ok")
