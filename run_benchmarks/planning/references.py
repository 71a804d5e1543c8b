"""A run's references, found and checked while it is planned: which curve judges each phase (the
committed one of its model, phase, recipe and data, or ``--reference`` files), and why a phase will
not be judged (its recipe changed by ``--set``, another global batch, real data with no reference
of its own). The plan holds the outcome (``Plan.references``, :func:`resolve`): after planning
nothing in a run reads a reference file.

Reading and combining curve files is curves.py; the gate that compares a run's curve with its
reference is judging/loss_gate.py; recording a reference, judging/recording.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from run_benchmarks.curve_math import check_curve, compared_steps
from run_benchmarks.errors import InputError
from run_benchmarks.planning import datacheck
from run_benchmarks.planning.config import phase_value
from run_benchmarks.planning.curves import (
    OtherBatch,
    check_reference_data,
    combine,
    committed_path,
    read_reference,
    reference_fingerprint,
    same_training,
)
from run_benchmarks.planning.registry import shown, shown_paths
from run_benchmarks.typed_results import Reference

Plan = Any  # run_benchmarks.planning.plan.Plan, which builds its references with this module


@dataclasses.dataclass(frozen=True)
class PhaseReference:
    """What judges one phase of a plan: its reference curve, or why there is none."""

    curve: Reference | None
    why_none: str | None = None  # no curve: why the phase will not be judged (None: the gate's own reason)


def resolve(plan: Plan) -> dict[str, PhaseReference]:
    """Every phase's reference, read and checked (InputError naming the file for a curve that cannot
    judge the run), with the reason a phase without one will not be judged."""
    curves = load_references(plan)
    return {
        ph: PhaseReference(curves[ph], None if curves[ph] is not None else (not_judged_reason(plan, ph) or no_reference_reason(plan, ph)))
        for ph in plan.phases
    }


def curves_of(references: Mapping[str, PhaseReference]) -> dict[str, Reference | None]:
    """The phases' curves alone (None: no reference)."""
    return {ph: r.curve for ph, r in references.items()}


#: train settings a run may set without leaving its recipe: how long it runs (at least to the
#: reference's last step), its throughput window, its layout's micro batch, what it profiles
CURVE_NEUTRAL = datacheck.CURVE_NEUTRAL


def committed_reference(plan: Plan, phase: str) -> Path | None:
    """The committed reference a phase of ``plan`` is judged against (present or not); None where
    the run's data has no fingerprint (not checked here)."""
    ident = (plan.data or {}).get(phase)
    if ident is not None and not ident.get("fingerprint"):
        return None
    fp = None if ident is None else ident.get("fingerprint")  # a synthetic phase started from other data has its own
    return committed_path(plan.case_dir, plan.case.model, plan.recipe, phase, fp)


def reference_paths(plan: Plan, phase: str = "train") -> list[Path]:
    """The curves a phase is compared with: the ``--reference`` files if given (several: repeats
    of one config, judged against their mean), else the committed reference of its model, phase,
    recipe and data (one for every layout and vendor); none when there is none."""
    if plan.reference:  # --reference: earlier runs or curve files, every phase
        return list(plan.reference)
    path = committed_reference(plan, phase)
    return [path] if path is not None and path.is_file() else []


def recipe_sets(overrides: Sequence[Mapping[str, Any]], phase: str | None = None, train: Mapping[str, Any] | None = None) -> list[str]:
    """The ``--set`` values (``param=value``) among ``overrides`` that change the recipe's curve:
    a train value other than CURVE_NEUTRAL, of ``phase`` (None: of any phase). ``steps`` is neutral
    only where the learning-rate schedule's horizon is pinned (``lr_decay_steps`` set in the run's
    ``train`` settings, of that phase): where the horizon follows the steps, more steps stretch the
    schedule and move every judged step's loss."""
    changed = []
    for o in overrides:
        parts = str(o["param"]).split(".")
        if parts[0] != "train" or ("standard" in o and o.get("value") == o.get("standard")):  # a value the recipe has anyway
            continue
        key = parts[-1] if len(parts) == 4 and parts[1] == "phases" else parts[1] if len(parts) == 2 else None
        if key is not None and len(parts) == 4 and phase is not None and parts[2] != phase:
            continue
        if key == "steps" and not _decay_pinned(train, parts[2] if len(parts) == 4 else phase):
            changed.append(f"{o['param']}={o['value']} (the decay horizon follows the steps: no lr_decay_steps)")
        elif key is None or key not in CURVE_NEUTRAL:
            changed.append(f"{o['param']}={o['value']}")
    return changed


def _decay_pinned(train: Mapping[str, Any] | None, phase: str | None) -> bool:
    """Whether the run's settings set the learning-rate decay horizon themselves (of ``phase``,
    or of every phase); unknown settings count as not pinned."""
    if train is None:
        return False
    if phase is not None:
        return phase_value(dict(train), phase, "lr_decay_steps") is not None
    phases = train.get("phases") or {}
    return train.get("lr_decay_steps") is not None or (bool(phases) and all(p.get("lr_decay_steps") for p in phases.values()))


def recipe_changed(plan: Plan, phase: str) -> str | None:
    """Why a phase's committed reference cannot judge it although one exists: a ``--set`` of a
    train value that changes the curve (its recipe's learning rate, batch, ...); None otherwise."""
    changed = [] if plan.reference else recipe_sets(plan.user_overrides, phase, plan.settings.get("train"))
    if not changed:
        return None
    return f"--set {', '.join(changed)} changes the {plan.recipe} recipe: its reference judges only runs of that recipe"


def judging(plan: Plan) -> list[str]:
    """What will judge each phase, as the plan and --dry-run say it: the reference's file (relative
    to the repository), its repeats and spread; or why no reference will."""
    out = []
    for phase in plan.phases:
        ref = plan.references[phase].curve
        tag = f"reference ({phase}): "
        ident = (plan.data or {}).get(phase) or {}
        hosts = ident.get("on_hosts") and not ident.get("checked")  # fingerprinted on the hosts before training
        if hosts and ref is None and not recipe_changed(plan, phase):
            out.append(tag + "the committed curve of the fingerprint the hosts take before training, if there is one")
            continue
        if ref is None:
            why = _no_data_reference(plan, phase) or recipe_changed(plan, phase) or no_reference_reason(plan, phase)
            if why is None:
                where = committed_reference(plan, phase)
                why = f"none committed ({shown(where)})" if where is not None else "no reference curve"
            out.append(tag + f"none: this run will not be judged ({why})")
            continue
        more = f", the mean of {len(ref.repeats)} runs (spread {100 * ref.spread:.3f}%)" if ref.repeats and ref.spread is not None else ""
        steps = compared_steps(ref)
        then = ", if made on the data the hosts fingerprint before training" if hosts else ""
        out.append(tag + f"{shown_paths(ref.path)}{more}, compared over steps {steps[0]}-{steps[-1]}{then}")
    return out


def load_references(plan: Plan) -> dict[str, Reference | None]:
    """Every phase's reference curve, checked before anything runs: it must judge a run (at
    least 5 finite, non-zero losses from step 21 on) of the same model, phase and global
    batch, from a clean round when it is a results.json. InputError names the file otherwise."""
    out: dict[str, Reference | None] = {}
    for phase in plan.phases:
        paths = [] if recipe_changed(plan, phase) or other_batch_reason(plan, phase) else reference_paths(plan, phase)
        refs = [(path, same_data(plan, phase, _checked_reference(plan, path, phase))) for path in paths]
        kept = [r for _, r in refs if r is not None]
        if kept and len(kept) < len(refs):  # some files made on this run's data, some on other data
            other = next(path for path, r in refs if r is None)
            raise InputError(f"--reference {other}: made on other data than this run's, unlike {kept[0].path}; repeats share their data")
        ref = _mean_of(kept) if kept else None
        out[phase] = None if ref is None else ref.model_copy(update={"path": shown_paths(ref.path)})
    return out


def _mean_of(refs: list[Reference]) -> Reference:
    """Several --reference curves of one phase as one: their per-step mean, with their spread."""
    if len(refs) == 1:
        return refs[0]
    try:
        ref = combine(refs)
        check_curve(ref)
    except ValueError as exc:
        raise InputError(f"--reference {exc}") from None
    return ref


def _checked_reference(plan: Plan, path: Path, phase: str) -> Reference:
    label = "--reference " if plan.reference else "reference curve "
    try:
        ref = read_reference(path, phase)
        check_curve(ref)
        _same_training(plan, path, phase)
    except ValueError as exc:
        raise InputError(f"{label}{exc}") from None
    return ref


def _same_training(plan: Plan, path: Path, phase: str) -> None:
    same_training(path, phase, plan.case.model, phase_value(plan.settings["train"], phase, "global_batch"), plan.recipe)


def other_batch_reason(plan: Plan, phase: str) -> str | None:
    """Why a phase has no committed reference although its config has one: the committed curve
    is of another global batch (a run shortened by ``--set train.global_batch``); None otherwise.
    Such a phase is not judged; an explicit ``--reference`` of another batch is bad input."""
    if plan.reference:
        return None
    for path in reference_paths(plan, phase):
        try:
            _same_training(plan, path, phase)
        except OtherBatch as exc:
            return f"no reference at global batch {exc.ours} (the committed curve {path.name} is of global batch {exc.theirs})"
        except ValueError:
            return None
    return None


def not_judged_reason(plan: Plan, phase: str) -> str | None:
    """Why a phase's committed reference will not judge it (:func:`recipe_changed`,
    :func:`other_batch_reason`); None when it will, or when there is none to say it of. Real data
    with no committed reference at all says that first (:func:`no_reference_reason`)."""
    return _no_data_reference(plan, phase) or recipe_changed(plan, phase) or other_batch_reason(plan, phase)


def _no_data_reference(plan: Plan, phase: str) -> str | None:
    """:func:`no_reference_reason` where the phase's real data has no committed reference (none at
    its path, or no fingerprint to find one by); None for synthetic data or one that exists."""
    if plan.reference:
        return None
    why = no_reference_reason(plan, phase)
    where = committed_reference(plan, phase)
    return why if why and (where is None or not where.is_file()) else None


def same_data(plan: Any, phase: str, ref: Any) -> Any:
    """``ref`` when it was made on the data this phase trains on (or the run's data is unknown), else
    None; InputError (:func:`check_reference_data`) when the run was given it by --reference."""
    if ref is None:
        return None
    ident = (getattr(plan, "data", None) or {}).get(phase)
    if ident is None:  # no check ran (a caller that builds plans itself): as before data had identities
        return ref
    if ident.get("on_hosts") and not ident.get("checked"):  # checked once the hosts fingerprint it (orchestrator.run)
        return ref
    if getattr(plan, "reference", None):
        check_reference_data(ref.path, phase, ident.get("fingerprint"), plan.case.model, ident.get("reason"))
    return ref if reference_fingerprint(ref.path, phase) == ident.get("fingerprint") else None


def no_reference_reason(plan: Any, phase: str) -> str | None:
    """Why a phase on real data has no reference, or None (the gate's own reason stands)."""
    ident = (getattr(plan, "data", None) or {}).get(phase)
    if ident is None or ident.get("fingerprint") == datacheck.SYNTHETIC:
        return None
    fp = ident.get("fingerprint")
    chained = chain_reason(plan, phase, ident)
    if chained:
        return chained
    if not fp and ident.get("on_hosts") and not ident.get("checked"):
        return "its data is fingerprinted on the hosts before training: the committed reference of that fingerprint judges it"
    if not fp:
        return f"no reference for this data (no fingerprint: {ident.get('reason') or 'not checked'})"
    return f"no reference for this data (fingerprint {fp}; start_task.py --record-reference RUN/results.json ... makes one from 3 runs)"


def chain_reason(plan: Any, phase: str, ident: dict[str, Any]) -> str | None:
    """Why a phase that starts from another phase or a checkpoint is not judged: the committed
    reference of its own data and recipe was made from another start. None when there is no such
    reference (the plain "no reference for this data" stands)."""
    starts = ident.get("starts_from") or []
    own = ident.get("own_fingerprint")
    if not starts or own is None:
        return None
    ref = committed_path(plan.case_dir, plan.case.model, plan.recipe, phase, None if own == datacheck.SYNTHETIC else own)
    if not ref.is_file():
        return None
    try:
        rec = json.loads(ref.read_text()).get("data") or {}
    except (OSError, ValueError):
        rec = {}
    theirs = {s.get("phase") or s.get("setting"): s for s in rec.get("starts_from") or []}
    for s in starts:
        if s.get("phase"):
            other = theirs.get(s["phase"], {"fingerprint": datacheck.SYNTHETIC, "recipe": plan.recipe})
            if other.get("fingerprint") != s["fingerprint"]:
                return (
                    f"not judged: the {s['phase']} ran on other data (fingerprint {s['fingerprint']}, "
                    f"the reference's {other.get('fingerprint')})"
                )
            if other.get("recipe") != s["recipe"]:
                return f"not judged: the {s['phase']} ran another recipe ({s['recipe']}, the reference's {other.get('recipe')})"
        elif s["setting"] not in theirs or theirs[s["setting"]].get("content") != s["content"]:
            had = theirs.get(s["setting"], {}).get("content", "none")
            return f"not judged: it starts from {s['setting']} {s['path']} (content {s['content']}, the reference's {had})"
    return None
