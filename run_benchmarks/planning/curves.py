"""Reference curves as files: reading one (a committed curve file or an earlier run's
results.json), combining repeats into a mean with its spread, where a committed reference lives,
and the checks that a curve was made of the same model, phase, global batch and data as a run.

A reference is a loss curve made under one recipe on one set of data; it judges every run of
that model, phase, recipe and data, whatever its layout or vendor (the starting weights are
layout-free: training/weights.py). Committed references live at

    cases/<family>/<framework>/reference/<model>/<recipe>[.<phase>][.data-<fingerprint>].json

(``standard.json``, ``short.json``, ``standard.pretrain.json``, ...; the synthetic set has no data
part). A file holds its curve (the per-step mean of its repeats), the repeats themselves with the
command, host, devices, date and code version of each, and their spread (recording.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from run_benchmarks import typed_results
from run_benchmarks.curve_math import ALIGN_FROM_STEP, BadReference, loss_mre, step_ranges
from run_benchmarks.errors import InputError
from run_benchmarks.planning import datacheck, registry
from run_benchmarks.planning.config import phase_value
from run_benchmarks.typed_results import Reference, Repeat


def round_repeats(path: str, rounds: Sequence[Any], phase: str) -> list[Repeat]:
    """The curves of ``phase`` in a run's rounds that ran through (typed RoundResults), each a
    repeat of the run's config: named ``path`` where there is one, ``path (round N)`` where there
    are several. ValueError naming the file and round where a round lacks the phase."""
    repeats = []
    for rnd in rounds:
        curves = {p.phase: p.loss for p in rnd.phases}
        if not curves.get(phase):
            raise ValueError(f"{path}: round {rnd.round} has no loss curve for phase {phase!r} (has {', '.join(curves) or 'none'})")
        repeats.append(Repeat(path=path if len(rounds) == 1 else f"{path} (round {rnd.round})", loss=curves[phase]))
    return repeats


def read_reference(path: Path, phase: str = "train") -> Reference:
    """A loss curve: a committed ``{"steps": [...], "loss": [...]}`` file, or a phase of an earlier
    run's results.json: its rounds that ran through (``ok``, ``unjudged`` as a first reference
    run is, or ``invalid``: a curve that differed from the one it was judged against, which says
    the two differ, not which is right; refusing such runs would keep only the repeats that
    happened to agree and hide the spread). One such round is the curve; several (the case
    name's ``:repeat``, a nightly case's ``rounds``) are repeats of one config, their mean the
    curve and their spread the gate's noise floor (:func:`mean_reference`). ValueError naming
    the file when it is neither, lacks the phase, or has no such round (only failed ones); curve
    files naming another phase or model are checked by the caller.
    """
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if isinstance(data, dict) and "rounds" in data:
        try:
            run = typed_results.parse(data, str(path))
        except InputError as exc:
            raise ValueError(str(exc)) from None
        through = [r for r in run.rounds if r.ran_through]
        if not through:
            statuses = ", ".join(f"round {r.round} {r.status}" for r in run.rounds) or "no round"
            raise ValueError(
                f"{path}: no round ran through (ok, unjudged or invalid by its own gate): {statuses}; a failed round is no reference"
            )
        repeats = round_repeats(str(path), through, phase)
        if len(repeats) == 1:
            return Reference(path=str(path), loss=repeats[0].loss)
        return mean_reference(str(path), repeats)  # BadReference (a ValueError) names the round
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list) or not isinstance(data.get("loss"), list):
        raise ValueError(f'{path}: neither a reference curve ({{"steps": [...], "loss": [...]}}) nor a results.json')
    loss = _curve(data, str(path))
    if data.get("repeats") is None:
        return Reference(path=str(path), loss=loss)
    return _with_repeats(path, data, loss)


def _curve(data: Mapping[str, Any], where: str) -> dict[int, float]:
    """A ``{"steps": [...], "loss": [...]}`` object as step -> loss; ValueError naming ``where``."""
    steps, losses = data.get("steps"), data.get("loss")
    if not isinstance(steps, list) or not isinstance(losses, list):
        raise ValueError(f"{where}: no steps and loss lists")
    if len(steps) != len(losses):
        raise ValueError(f"{where}: {len(steps)} steps but {len(losses)} losses")
    return {int(s): float(v) for s, v in zip(steps, losses)}


def _with_repeats(path: Path, data: Mapping[str, Any], loss: dict[int, float]) -> Reference:
    """A curve file that carries the repeats it is the mean of: the mean and spread recomputed
    from them, and the file's own curve (and spread, if written) checked against those."""
    items = data["repeats"]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: repeats: a list of curves ({{path, steps, loss}}) expected")
    if len(items) == 1:  # one run: the file's curve is that run's, the entry its provenance
        if not isinstance(items[0], dict) or _curve(items[0], f"{path}: repeats[0]") != loss:
            raise ValueError(f"{path}: its one repeat's curve is not the file's curve")
        return Reference(path=str(path), loss=loss)
    repeats = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("path"), str):
            raise ValueError(f"{path}: repeats[{i}]: an object with path, steps and loss expected")
        repeats.append(Repeat(path=item["path"], loss=_curve(item, f"{path}: repeats[{i}] ({item['path']})")))
    try:
        ref = mean_reference(str(path), repeats)
    except BadReference as exc:
        raise ValueError(f"{path}: {exc}") from None
    if sorted(loss) != sorted(ref.loss):
        raise ValueError(f"{path}: its steps ({step_ranges(loss)}) are not those all its repeats have ({step_ranges(ref.loss)})")
    for s, v in ref.loss.items():
        if not math.isclose(loss[s], v, rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(f"{path}: step {s}: loss {loss[s]}, but the mean of its repeats is {v}")
    written = data.get("spread")
    if written is not None and (ref.spread is None or not math.isclose(float(written), ref.spread, rel_tol=1e-9, abs_tol=1e-12)):
        raise ValueError(f"{path}: spread {written} written, {ref.spread} recomputed from its repeats")
    return ref


def mean_reference(path: str, repeats: Sequence[Repeat]) -> Reference:
    """The reference made from two or more repeats of one config: their per-step mean, the
    repeats themselves and their :func:`repeat_spread`, each curve counted once
    (:func:`distinct_curves`; repeats that are all one curve give that curve alone).

    Every step from 21 on that one repeat has must be in every repeat, each a finite loss
    (BadReference naming the repeat and the steps); the mean covers the steps they all have.
    """
    if len(repeats) < 2:
        raise BadReference(f"{path}: a mean of repeats needs at least two curves, got {len(repeats)}")
    compared = sorted({s for r in repeats for s in r.loss if s >= ALIGN_FROM_STEP})
    for r in repeats:
        missing = [s for s in compared if s not in r.loss]
        if missing:
            raise BadReference(
                f"{r.path}: step{'s' if len(missing) > 1 else ''} {step_ranges(missing)} missing, which another repeat has "
                f"(every compared step, from {ALIGN_FROM_STEP} on, must be in every repeat)"
            )
        bad = next((s for s in compared if not math.isfinite(r.loss[s])), None)
        if bad is not None:
            raise BadReference(f"{r.path}: step {bad}: loss {r.loss[bad]} (a repeat needs a finite loss at every compared step)")
    common = set(repeats[0].loss).intersection(*(r.loss for r in repeats[1:]))
    repeats = distinct_curves(repeats)
    if len(repeats) == 1:  # every repeat the same curve: one curve, whose spread nothing measured
        return Reference(path=path, loss={s: repeats[0].loss[s] for s in sorted(common)})
    mean = {s: sum(r.loss[s] for r in repeats) / len(repeats) for s in sorted(common)}
    return Reference(path=path, loss=mean, repeats=list(repeats), spread=repeat_spread(repeats))


def distinct_curves(repeats: Sequence[Repeat]) -> list[Repeat]:
    """The repeats with each curve once: one equal to an earlier repeat at every step (a second
    run on a machine that computes alike run after run) is left out, so that a machine run twice
    neither weighs twice in the mean nor narrows the spread with a copy of itself."""
    kept: list[Repeat] = []
    for r in repeats:
        if not any(r.loss == k.loss for k in kept):
            kept.append(r)
    return kept


def repeat_spread(repeats: Sequence[Repeat]) -> float | None:
    """How far repeats of one config are apart: over the compared steps (from 21 on), the MRE of
    each repeat against the per-step mean of the others (leave one out), the largest of them.
    None for fewer than two curves or no compared step. The repeats must share those steps
    (:func:`mean_reference` checks it)."""
    if len(repeats) < 2:
        return None
    compared = sorted(s for s in repeats[0].loss if s >= ALIGN_FROM_STEP)
    if not compared:
        return None
    worst = 0.0
    for i, r in enumerate(repeats):
        others = [o for j, o in enumerate(repeats) if j != i]
        rest = {s: sum(o.loss[s] for o in others) / len(others) for s in compared}
        try:
            mre, _ = loss_mre(r.loss, rest)
        except BadReference as exc:
            raise BadReference(f"{r.path}: against the mean of the other repeats: {exc}") from None
        worst = max(worst, mre)
    return worst


def combine(references: Sequence[Reference]) -> Reference:
    """One reference from several files' curves of one phase: each file's repeats (or its own
    curve when it has none) averaged per step (:func:`mean_reference`); one file as it is."""
    if len(references) == 1:
        return references[0]
    repeats = [x for r in references for x in (r.repeats or [Repeat(path=r.path, loss=r.loss)])]
    return mean_reference("; ".join(r.path for r in references), repeats)


def load_reference(path: Path, phase: str = "train") -> dict[int, float] | None:
    """The curve of :func:`read_reference` as step -> loss; None when the file is absent."""
    return read_reference(path, phase).loss if path.is_file() else None


def committed_path(case_dir: Path, model: str, recipe: str, phase: str, fingerprint: str | None) -> Path:
    """Where the reference of (model, phase, recipe, data) is committed."""
    name = recipe + ("" if phase == "train" else f".{phase}")
    name += "" if fingerprint in (None, datacheck.SYNTHETIC) else f".data-{fingerprint}"
    return case_dir / "reference" / model / f"{name}.json"


def same_training(path: Path, phase: str, model: str, ours: Any, recipe: str | None = None) -> None:
    """Loss curves compare step by step only for the same model and phase at the same global
    batch: ``path`` (a reference, read by read_reference already) against a run of
    ``model`` whose ``phase`` trains at global batch ``ours``. ValueError naming the file; a
    curve file of another batch raises :class:`OtherBatch`."""
    data = json.loads(path.read_text())
    if "rounds" in data:  # an earlier run: read_reference has parsed it already, so it parses
        run = typed_results.parse(data, str(path))
        if run.model != model:
            raise ValueError(f"{path}: a run of {run.model!r}, not of {model!r}")
        theirs = phase_value(run.settings.get("train") or {}, phase, "global_batch")
        if theirs != ours:
            raise ValueError(
                f"{path}: global batch {theirs} there, {ours} here"
                + ("" if phase == "train" else f" (phase {phase})")
                + "; loss curves compare step by step only at the same global batch"
            )
        return
    # a curve file: it may name its model, phase and global batch
    if data.get("model") is not None and data["model"] != model:
        raise ValueError(f"{path}: a curve of {data['model']!r}, not of {model!r}")
    if recipe is not None and data.get("recipe") is not None and data["recipe"] != recipe:
        raise ValueError(f"{path}: a curve of the {data['recipe']} recipe, not of the {recipe} one")
    if data.get("phase") is not None and data["phase"] != phase:
        raise ValueError(f"{path}: a curve of phase {data['phase']!r}, compared with phase {phase!r}")
    if data.get("global_batch") is not None and data["global_batch"] != ours:
        raise OtherBatch(path, data["global_batch"], ours, phase)


class OtherBatch(ValueError):
    """A reference curve made at another global batch than the run's."""

    def __init__(self, path: Path, theirs: Any, ours: Any, phase: str) -> None:
        self.path, self.theirs, self.ours = path, theirs, ours
        super().__init__(
            f"{path}: a curve of global batch {theirs} there, {ours} here"
            + ("" if phase == "train" else f" (phase {phase})")
            + "; loss curves compare step by step only at the same global batch"
        )


def reference_fingerprint(path: str | Path, phase: str) -> str:
    """The fingerprint of the data a reference was made on: its ``data`` record (a curve file's own,
    a results.json's phase's), the synthetic set when it names none (every curve made before data
    had identities was made on it)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return datacheck.SYNTHETIC
    rec = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(rec, dict) and "rounds" in doc:  # a results.json: phase -> identity
        rec = rec.get(phase)
    if not isinstance(rec, dict):
        return datacheck.SYNTHETIC
    return rec.get("fingerprint") or datacheck.SYNTHETIC


def committed_for(model: str, phase: str, fp: str | None) -> list[Path]:
    """The committed reference curves of ``model``'s ``phase`` made on the data of fingerprint ``fp``."""
    out = []
    for path in sorted(registry.ROOT.glob(f"cases/*/*/reference/{model}/**/*.json")):
        parts = path.stem.split(".")
        named = next((x for x in parts[1:] if not x.startswith("data-")), "train")
        if named == phase and reference_fingerprint(path, phase) == (fp or datacheck.SYNTHETIC):
            out.append(path)
    return out


def check_reference_data(path: str | Path, phase: str, run_fp: str | None, model: str, why: str | None = None) -> None:
    """InputError when the reference at ``path`` (a curve file or a results.json; several joined by
    '; ') was made on other data than the run's ``run_fp``: both fingerprints named, and the
    committed reference of the run's data where there is one. Data without a fingerprint (``why``
    not: a run made before data on the hosts was fingerprinted there) is judged by none."""
    if run_fp is None:
        raise InputError(
            f"--reference {path}: the run's phase {phase} read data without a fingerprint ({why or 'not checked'}): "
            "no reference can judge it"
        )
    for one in str(path).split("; "):
        ref_fp = reference_fingerprint(one, phase)
        if ref_fp == run_fp:
            continue
        ours = committed_for(model, phase, run_fp)
        hint = (
            f"; the committed reference for this data is {ours[0].relative_to(registry.ROOT)}"
            if ours
            else "; no committed reference for this data (start_task.py --record-reference RUN/results.json ... makes one from 3 runs)"
        )
        raise InputError(
            f"--reference {one}: made on other data (fingerprint {ref_fp}) than the run's phase {phase} "
            f"(fingerprint {run_fp}): it cannot judge it{hint}"
        )
