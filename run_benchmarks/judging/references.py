"""References and the loss gate: one module to find, load, check, combine, record and judge.

A reference is a loss curve of nvidia's made under one recipe on one set of data; it judges every
run of that model, phase, recipe and data, whatever its layout or vendor (the starting weights
are layout-free: training/weights.py). Committed references live at

    cases/<family>/<framework>/reference/<model>/<recipe>[.<phase>][.data-<fingerprint>].json

(``standard.json``, ``short.json``, ``standard.pretrain.json``, ...; the synthetic set has no data
part). A file holds its curve (the per-step mean of its repeats), the repeats themselves with the
command, host, devices, date and code version of each, and their spread (``record``). It changes
only in a commit of its own that says why (tests/test_reference_governance.py); git keeps its
earlier versions readable (``git log -p -- <file>``).

The gate (seed 000): a run's loss at the reference's steps from 21 on, mean relative error under 2 %.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from run_benchmarks.errors import InputError
from run_benchmarks.judging import typed_results
from run_benchmarks.judging import typed_results as tr
from run_benchmarks.judging.typed_results import LossGate, Reference, Repeat, Status
from run_benchmarks.planning import datacheck, registry
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName

if TYPE_CHECKING:
    from run_benchmarks.planning.plan import Plan

ALIGN_FROM_STEP = 21  # seed 000: loss compared from step 21 on
ALIGN_TOLERANCE = 0.02  # aligned when the mean relative error is below 2 %
MIN_COMPARED_STEPS = 5  # fewer compared steps judge nothing
#: against repeats that differ by the tolerance or more, a run further from their mean than this
#: many times their spread is not aligned: the repeats' own noise does not reach that far
BEYOND_SPREAD = 2.0
#: a reference is recorded from at least this many repeats whose curves differ in rounding
#: (other layouts or micro batches: on a CPU a run made again as it was is the same curve), so
#: that its spread, the unit of the noise figure, is measured
MIN_REPEATS = 3
#: a curve jumps where its loss climbs back above its first step's loss, rising by at least this
#: fraction from the step before: after such a jump curves that differ only by rounding part
JUMP_RISE = 0.05


class BadReference(ValueError):
    """A reference curve that cannot judge a run; the message names the file and the step."""


# --------------------------------------------------------------------------- the loss gate


def step_ranges(steps: Iterable[int]) -> str:
    """``[22, 26, 27, 28]`` -> ``"22, 26-28"``."""
    out: list[str] = []
    run: list[int] = []
    for s in sorted(steps):
        if run and s != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(s)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def compared_steps(reference: Reference) -> list[int]:
    """The reference's steps the gate compares: from step 21 to its last step."""
    return sorted(s for s in reference.loss if s >= ALIGN_FROM_STEP)


def check_curve(reference: Reference) -> None:
    """A curve that can judge a run: enough steps from 21 on, each a finite, non-zero loss."""
    steps = compared_steps(reference)
    if len(steps) < MIN_COMPARED_STEPS:
        have = f"steps {step_ranges(steps)}" if steps else "none"
        raise BadReference(
            f"{reference.path}: {len(steps)} step(s) from step {ALIGN_FROM_STEP} on ({have}); "
            f"the loss gate compares at least {MIN_COMPARED_STEPS}"
        )
    for s in steps:
        v = reference.loss[s]
        if not math.isfinite(v) or v == 0:
            raise BadReference(f"{reference.path}: step {s}: reference loss {v} (a relative error needs a finite, non-zero loss)")


def loss_mre(loss: Mapping[int, float], reference: Mapping[int, float], from_step: int = ALIGN_FROM_STEP) -> tuple[float, int]:
    """Mean relative error of ``loss`` against ``reference`` over the reference's steps >= from_step.

    Every one of those steps must be in ``loss`` (ValueError naming the missing ones); a
    reference loss of 0 or a non-finite one is a BadReference.
    """
    steps = sorted(s for s in reference if s >= from_step)
    missing = [s for s in steps if s not in loss]
    if missing:
        raise ValueError(f"steps {step_ranges(missing)} missing")
    errs = []
    for s in steps:
        ref = reference[s]
        if not math.isfinite(ref) or ref == 0:
            raise BadReference(f"step {s}: reference loss {ref}")
        errs.append(abs(loss[s] - ref) / abs(ref))
    return (sum(errs) / len(errs) if errs else math.nan), len(steps)


def is_aligned(mre: float | None, tolerance: float = ALIGN_TOLERANCE) -> bool | None:
    return None if mre is None else mre < tolerance


def first_nonfinite(loss: Mapping[int, float], warmup_steps: int) -> int | None:
    """The first step after the warm-up (or from step 21, whichever comes first) whose loss is NaN or inf."""
    after = min(warmup_steps, ALIGN_FROM_STEP - 1)
    return next((s for s in sorted(loss) if s > after and not math.isfinite(loss[s])), None)


def _nonfinite(x: float) -> str:
    return "NaN" if math.isnan(x) else "inf" if x > 0 else "-inf"


def loss_jump(loss: Mapping[int, float], until: int | None = None) -> tuple[int, float, float] | None:
    """The first step (up to ``until``, when given) at which a curve's loss climbs above its first
    step's loss, at least JUMP_RISE above the step before it: ``(step, loss before, loss)``; None
    where the curve has no such step. Non-finite losses are skipped."""
    steps = [s for s in sorted(loss) if math.isfinite(loss[s]) and (until is None or s <= until)]
    if not steps:
        return None
    first = loss[steps[0]]
    for before, s in zip(steps, steps[1:]):
        if loss[s] > first and loss[s] >= loss[before] * (1 + JUMP_RISE):
            return s, loss[before], loss[s]
    return None


def reference_jump(reference: Reference) -> str | None:
    """Where a reference's loss jumps (:func:`loss_jump`) up to its last compared step, said in
    words: the earliest jump of its repeats (of its own curve where it has none); None without one."""
    last = max(reference.loss, default=None)
    curves = [r.loss for r in reference.repeats] or [reference.loss]
    jumps = [(j, c) for c in curves if (j := loss_jump(c, last))]
    if not jumps:
        return None
    (step, before, after), c = min(jumps, key=lambda x: x[0][0])
    return f"at step {step} ({before:.2f} to {after:.2f}, above its first step's {c[min(c)]:.2f})"


def _jump_reason(reference: Reference, loss: Mapping[int, float], steps: Sequence[int]) -> str:
    """What a not-aligned verdict adds where a curve jumps before the end of the compared steps."""
    out = ""
    where = reference_jump(reference)
    if where:
        out += (
            f"; the reference's loss jumps {where}: runs that differ only by rounding part after such a jump, "
            "so this verdict may turn on rounding"
            + ("" if reference.repeats else "; repeats of the reference (--reference given several times) measure how far")
        )
    own = loss_jump(loss, steps[-1])
    if own and not where:
        out += f"; the run's loss jumps at step {own[0]} ({own[1]:.2f} to {own[2]:.2f}, above its first step's)"
    return out


def agreement_steps(reference: Reference) -> list[int]:
    """Where repeats still agree: the reference's steps before 21, from its first on, up to (not
    including) the first at which one repeat lies ALIGN_TOLERANCE or more from the mean of the
    others (leave one out, as :func:`repeat_spread`), or at which a repeat has no finite loss;
    [] for a reference without repeats. Repeats that part after a jump of the loss agree before
    it (baichuan2_13b's through step 13), and there the 2 % rule can be resolved."""
    out: list[int] = []
    n = len(reference.repeats)
    if n < 2:
        return out
    for s in sorted(reference.loss):
        values = [r.loss.get(s) for r in reference.repeats]
        if s >= ALIGN_FROM_STEP or any(v is None or not math.isfinite(v) for v in values):
            break
        total = sum(values)
        others = [(total - v) / (n - 1) for v in values]
        if any(o == 0 or abs(v - o) / abs(o) >= ALIGN_TOLERANCE for v, o in zip(values, others)):
            break
        out.append(s)
    return out


def _agreement(loss: Mapping[int, float], reference: Reference) -> tuple[float, list[int]] | None:
    """The run's MRE over the reference's :func:`agreement_steps`, where there are at least
    MIN_COMPARED_STEPS of them and the run has each; None elsewhere."""
    steps = agreement_steps(reference)
    if len(steps) < MIN_COMPARED_STEPS or any(s not in loss for s in steps):
        return None
    return loss_mre(loss, {s: reference.loss[s] for s in steps}, from_step=steps[0])[0], steps


#: the least spread a reference's repeats count as (docs/metrics.md, deviations in noise units):
#: repeats that agree more closely than rounding moves a run (bit-identical ones on a CPU) do not
#: make every other run's arithmetic a hundred "spreads" away
NOISE_FLOOR = 3e-8
#: a run aligned by the 2 % rule but more than this many noise units from the reference: "numerics
#: differ" (correct alternatives measured within 1.2 units; docs/metrics.md)
NUMERICS_DIFFER_UNITS = 10.0


def noise_units(mre: float | None, reference: Reference | None) -> float | None:
    """``mre`` in units of the reference's noise: its repeats' spread, at least NOISE_FLOOR; None
    where the reference has no repeats (nothing measured its noise) or there is no MRE."""
    if mre is None or reference is None or reference.spread is None:
        return None
    return mre / max(reference.spread, NOISE_FLOOR)


def with_noise(gate: LossGate, reference: Reference | None) -> LossGate:
    """The gate with its deviation in noise units, and the "numerics differ" note on an aligned
    run far outside the reference's noise (the seed rule's verdict stays the verdict)."""
    units = noise_units(gate.mre, reference)
    if units is None:
        return gate
    differ = gate.verdict == "aligned" and units > NUMERICS_DIFFER_UNITS
    reason = gate.reason + (
        f"; numerics differ: {units:.1f} times the reference's noise ({100 * max(reference.spread or 0, NOISE_FLOOR):.3g}%)"
        if differ
        else ""
    )
    return gate.model_copy(update={"noise_units": units, "numerics_differ": differ, "reason": reason})


def judge_loss(loss: Mapping[int, float], reference: Reference | None, warmup_steps: int) -> LossGate:
    """:func:`judge_seed_rule`'s verdict with its deviation in the reference's noise units (:func:`with_noise`)."""
    return with_noise(judge_seed_rule(loss, reference, warmup_steps), reference)


def judge_seed_rule(loss: Mapping[int, float], reference: Reference | None, warmup_steps: int) -> LossGate:
    """One phase's loss curve against its reference: aligned, not aligned or not judged, with why.

    A NaN or inf loss after the warm-up fails (``nonfinite_step``), whether or not the
    reference has that step. Compared are the reference's steps from 21 to its last; each
    must be in the run, at least MIN_COMPARED_STEPS of them; aligned when the MRE < 2 %.
    Against a mean of repeats whose spread is 2 % or more the reference's own noise is as large
    as the tolerance: the MRE is kept and the phase is not judged, unless the MRE is more than
    BEYOND_SPREAD times the spread (not aligned: further from the repeats than they are from each
    other by that margin, as a model that sees the tokens it predicts is), or unless the run is
    2 % or more from their mean over the early steps where the repeats still agree within 2 %
    (:func:`agreement_steps`, at least MIN_COMPARED_STEPS of them: not aligned, the verdict's
    figures those of that range): there the rule can be resolved, and a run whose arithmetic
    differs leaves the repeats before they part.
    """
    bad = first_nonfinite(loss, warmup_steps)
    if bad is not None:
        return LossGate(verdict="not aligned", reason=f"loss {_nonfinite(loss[bad])} at step {bad}", nonfinite_step=bad)
    if reference is None:
        return LossGate(verdict="not judged", reason="no reference curve")
    steps = compared_steps(reference)
    missing = [s for s in steps if s not in loss]
    if missing:
        return LossGate(
            verdict="not judged",
            reason=f"step{'s' if len(missing) > 1 else ''} {step_ranges(missing)} missing (reference to step {steps[-1]})",
        )
    if len(steps) < MIN_COMPARED_STEPS:
        return LossGate(
            verdict="not judged", compared_steps=len(steps), reason=f"{len(steps)} step(s) compared, at least {MIN_COMPARED_STEPS} needed"
        )
    try:
        mre, n = loss_mre(loss, reference.loss)
    except BadReference as exc:
        raise BadReference(f"{reference.path}: {exc}") from None
    over = f"MRE {100 * mre:.2f}% over steps {steps[0]}-{steps[-1]}"
    tol = f"{100 * ALIGN_TOLERANCE:g}%"
    early = _agreement(loss, reference) if cannot_resolve(reference) else None
    if cannot_resolve(reference) and mre > BEYOND_SPREAD * reference.spread:
        verdict = "not aligned"
        reason = (
            f"{over} against the mean of {len(reference.repeats)} runs, more than {BEYOND_SPREAD:g} times "
            f"their spread ({100 * reference.spread:.2f}%): beyond the repeats' own noise"
        )
    elif early is not None and early[0] >= ALIGN_TOLERANCE:  # off the repeats where they still agree
        e_mre, e_steps = early
        reason = (
            f"MRE {100 * e_mre:.2f}% over steps {e_steps[0]}-{e_steps[-1]} (at least {tol}), where the reference's "
            f"{len(reference.repeats)} repeats agree within {tol} of each other: the run leaves them before they part "
            f"(from step {ALIGN_FROM_STEP} on they differ by {100 * reference.spread:.2f}%; {over})"
        )
        return LossGate(
            verdict="not aligned", mre=e_mre, compared_steps=len(e_steps), first_step=e_steps[0], last_step=e_steps[-1], reason=reason
        )
    elif cannot_resolve(reference):  # no verdict within the repeats' own noise
        verdict = "not judged"
        where = reference_jump(reference)
        reason = (
            f"reference repeats differ by {100 * reference.spread:.2f}% among themselves (at least {tol}): "
            f"this batch and length cannot resolve the {tol} rule" + (f" (their loss jumps {where})" if where else "") + f"; {over}"
        )
        if early is not None:
            reason += f"; over steps {early[1][0]}-{early[1][-1]}, where the repeats agree within {tol}, MRE {100 * early[0]:.2f}%"
    else:
        verdict = "aligned" if mre < ALIGN_TOLERANCE else "not aligned"
        if reference.spread is not None:
            over += f" against the mean of {len(reference.repeats)} runs (their spread {100 * reference.spread:.2f}%)"
        reason = over + ("" if verdict == "aligned" else f" (at least {tol})" + _jump_reason(reference, loss, steps))
    return LossGate(verdict=verdict, mre=mre, compared_steps=n, first_step=steps[0], last_step=steps[-1], reason=reason)


def cannot_resolve(reference: Reference | None) -> bool:
    """Whether ``reference`` is repeats whose own spread is the tolerance or more."""
    return reference is not None and reference.spread is not None and reference.spread >= ALIGN_TOLERANCE


def resolution_note(reference: Reference | None) -> str | None:
    """What a reference can judge, said before a run: where it is repeats whose spread is the
    tolerance or more (:func:`judge_loss`), and where its loss jumps (:func:`reference_jump`);
    None for a reference that resolves the rule and has no jump."""
    if reference is None:
        return None
    where = reference_jump(reference)
    tol = f"{100 * ALIGN_TOLERANCE:g}%"
    if cannot_resolve(reference):
        agree = agreement_steps(reference)
        return (
            f"its {len(reference.repeats)} repeats differ by {100 * reference.spread:.2f}% among themselves, so the {tol} rule "
            f"cannot be resolved: a run more than {100 * BEYOND_SPREAD * reference.spread:.2f}% from their mean is not aligned, "
            "one within that is not judged"
            + (
                f"; over steps {agree[0]}-{agree[-1]}, where they agree within {tol}, a run {tol} or more from them is not aligned"
                if len(agree) >= MIN_COMPARED_STEPS
                else ""
            )
            + (f"; their loss jumps {where}" if where else "")
        )
    if not where:
        return None
    steps = compared_steps(reference)
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "its later steps"
    return (
        f"its loss jumps {where}; the gate compares {span}, and runs that differ only by rounding part after such a "
        "jump, so a verdict there may turn on rounding; "
        + (
            f"its {len(reference.repeats)} repeats (spread {100 * reference.spread:.2f}%) may not show how far"
            if reference.repeats
            else "repeats of the reference (--reference given several times) measure how far"
        )
    )


def reference_notes(references: Mapping[str, Reference | None]) -> list[str]:
    """The :func:`resolution_note` of each phase's reference that has one, as start_task.py and a
    run list's --check print them: ``reference (train): ...``."""
    return [f"reference ({phase}): {note}" for phase, ref in references.items() if (note := resolution_note(ref))]


# --------------------------------------------------------------------------- reference curves


def round_status(errors: list[str], gates: dict[str, LossGate], conformance: Mapping[str, Any] | None = None) -> tuple[Status, list[str]]:
    """The round's status and why: invalid where the conformance check failed (the run stopped
    before training, so the errors of its ranks' stop are not the cause), failed (a process or
    protocol error, a NaN/inf loss), invalid (a phase not aligned), unjudged (a phase not judged),
    else ok; each phase's reason named."""
    if conformance and conformance.get("verdict") == "failed":
        return "invalid", [f"conformance check failed: {conformance.get('message')}"]
    lines = list(errors)
    lines += [f"phase {ph}: {g.reason}" for ph, g in gates.items() if g.nonfinite_step is not None]
    lines += [
        f"phase {ph}: loss not aligned: {g.reason}" for ph, g in gates.items() if g.verdict == "not aligned" and g.nonfinite_step is None
    ]
    lines += [
        f"phase {ph}: loss not judged: {g.reason.removeprefix('not judged: ')}" for ph, g in gates.items() if g.verdict == "not judged"
    ]
    verdicts = {g.verdict for g in gates.values()}
    if errors or any(g.nonfinite_step is not None for g in gates.values()):
        return "failed", lines
    if "not aligned" in verdicts:
        return "invalid", lines
    return ("unjudged" if "not judged" in verdicts else "ok"), lines


def round_loss(gates: Sequence[LossGate]) -> tuple[float | None, bool | None]:
    """A round's loss aggregates over its phases: the worst MRE, and aligned True only when every
    phase is, False when one is not, else None (a phase not judged)."""
    mres = [g.mre for g in gates if g.mre is not None]
    flags = [g.aligned for g in gates]
    return (max(mres) if mres else None), (False if False in flags else (True if flags and all(flags) else None))


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


# --------------------------------------------------------------------------- finding and loading


#: train settings a run may set without leaving its recipe: how long it runs (at least to the
#: reference's last step), its throughput window, its layout's micro batch, what it profiles
CURVE_NEUTRAL = datacheck.CURVE_NEUTRAL


def committed_path(case_dir: Path, model: str, recipe: str, phase: str, fingerprint: str | None) -> Path:
    """Where the reference of (model, phase, recipe, data) is committed."""
    name = recipe + ("" if phase == "train" else f".{phase}")
    name += "" if fingerprint in (None, datacheck.SYNTHETIC) else f".data-{fingerprint}"
    return case_dir / "reference" / model / f"{name}.json"


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
        return planning.phase_value(dict(train), phase, "lr_decay_steps") is not None
    phases = train.get("phases") or {}
    return train.get("lr_decay_steps") is not None or (bool(phases) and all(p.get("lr_decay_steps") for p in phases.values()))


def recipe_changed(plan: Plan, phase: str) -> str | None:
    """Why a phase's committed reference cannot judge it although one exists: a ``--set`` of a
    train value that changes the curve (its recipe's learning rate, batch, ...); None otherwise."""
    changed = [] if plan.reference else recipe_sets(plan.user_overrides, phase, plan.settings.get("train"))
    if not changed:
        return None
    return f"--set {', '.join(changed)} changes the {plan.recipe} recipe: its reference judges only runs of that recipe"


def judging(plan: Plan, references: Mapping[str, Reference | None]) -> list[str]:
    """What will judge each phase, as the plan and --dry-run say it: the reference's file (relative
    to the repository), its repeats and spread; or why no reference will."""
    out = []
    for phase in plan.phases:
        ref = references.get(phase)
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


def shown_paths(paths: str) -> str:
    """A reference's ``path`` (several files joined by "; ") with each file :func:`shown`."""
    return "; ".join(shown(p) for p in paths.split("; "))


def shown(path: str | Path) -> str:
    """A path as results and messages name it: relative to the repository where it lies inside."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(registry.ROOT))
    except ValueError:
        return str(p)


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
    same_training(path, phase, plan.case.model, planning.phase_value(plan.settings["train"], phase, "global_batch"), plan.recipe)


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
        theirs = planning.phase_value(run.settings.get("train") or {}, phase, "global_batch")
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


# --------------------------------------------------------------------------- recording


def _rounds_ran_through(res: tr.RunResults, path: Path) -> list[tr.RoundResult]:
    through = [r for r in res.rounds if r.ran_through]
    if not through:
        statuses = ", ".join(f"round {r.round} {r.status}" for r in res.rounds) or "no round"
        raise InputError(
            f"{path}: no round ran through (ok, unjudged or invalid by its own gate): {statuses}; a failed round is no reference"
        )
    return through


def _same_key(first: tr.RunResults, first_path: Path, res: tr.RunResults, path: Path) -> None:
    """Repeats of one reference: the same model, recipe, phases, global batch and data, any layout;
    InputError naming ``path``."""
    pairs = [
        ("model", first.model, res.model),
        ("recipe", first.recipe, res.recipe),
        ("phases", first.phases, res.phases),
        ("global batch", first.settings.get("train", {}).get("global_batch"), res.settings.get("train", {}).get("global_batch")),
        (
            "data",
            {ph: (d or {}).get("fingerprint") for ph, d in (first.data or {}).items()},
            {ph: (d or {}).get("fingerprint") for ph, d in (res.data or {}).items()},
        ),
    ]
    for what, theirs, ours in pairs:
        if theirs != ours:
            raise InputError(
                f"{path}: {what} {ours!r}, but {theirs!r} in {first_path}; a reference's repeats are runs of one recipe and data"
            )


def _provenance(res: tr.RunResults, rnd: tr.RoundResult, path: Path) -> dict[str, Any]:
    """Who made a repeat: its file, run, round, config and layout, command, host, devices, code."""
    identities = [m.get("identity") for m in rnd.monitor.values() if isinstance(m, dict) and m.get("identity")]
    return {
        "path": shown(path),
        "run_id": res.run_id,
        "round": rnd.round,
        "config": res.config_name,
        "layout": rnd.layout,
        "vendor": res.vendor,
        "hardware": f"{res.hardware} x{res.world_size}",
        "date": res.started[:10],
        "code_version": res.code_version,
        "command": res.command,
        "host": res.system.get("host"),
        "devices": [g for ident in identities for g in ident.get("gpus") or []] or rnd.devices,
    }


def _failed_against_model(model: str, rnd: tr.RoundResult, phase: str) -> tr.LossGate | None:
    """The gate of ``phase`` in ``rnd`` where it was judged not aligned against a committed
    reference of ``model`` (by whatever name that reference had then); None otherwise."""
    lineage = f"reference/{model}/"
    for p in rnd.phases:
        if p.phase == phase and p.gate.verdict == "not aligned" and lineage in str(rnd.reference.get(phase) or ""):
            return p.gate
    return None


def _refused_by(target: Path, res: tr.RunResults, path: Path, rnd: tr.RoundResult, phase: str, loss: dict[int, float]) -> str | None:
    """Why a repeat may not enter the reference ``target`` replaces: it was judged not aligned
    against it (as recorded, or judged now against the committed curve)."""
    failed = _failed_against_model(res.model, rnd, phase)
    if failed is not None:
        return f"{path} round {rnd.round} was judged not aligned against {shown(target)} ({failed.reason})"
    try:
        old = read_reference(target, phase)
    except ValueError:
        return None
    gate = judge_loss(loss, old, 0)
    if gate.verdict == "not aligned":
        return f"{path} round {rnd.round} is not aligned with {shown(target)} ({gate.reason})"
    return None


def record(paths: list[Path], why: str, replace: bool = False) -> list[str]:
    """Write the runs' curves as the reference of their model, phase, recipe and data (one file per
    phase, :func:`committed_path`); one line per file.

    Every round that ran through is a repeat (layouts and vendors may differ: the reference judges
    them all); their per-step mean is the curve, with the repeats, their provenance and their
    spread. ``why`` says why the reference is made or changed (its file keeps it). A reference
    already there is replaced only with ``replace``, and never by repeats of which one was judged
    not aligned against it: a reference changes to be right, not to absorb a run."""
    if replace and not why.strip():
        raise InputError("--record-reference --replace needs --why TEXT: why the reference changes (kept in it)")
    runs = [(path, tr.load(path)) for path in paths]
    path, res = runs[0]
    for other, r in runs:
        _same_key(res, path, r, other)
        if changed := recipe_sets(r.user_overrides, None, r.settings.get("train")):
            raise InputError(f"{other}: --set {', '.join(changed)} changes its {r.recipe} recipe: no reference of it")
    through = [(p, r, _rounds_ran_through(r, p)) for p, r in runs]
    try:
        case_dir = registry.find_case(CaseName.parse(res.case)).path
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    out = []
    for phase in res.phases:
        ident = (res.data or {}).get(phase) or {"kind": datacheck.SYNTHETIC, "fingerprint": datacheck.SYNTHETIC}
        fp = ident.get("fingerprint")
        if not fp:
            raise InputError(
                f"{path}: phase {phase}: its data has no fingerprint ({ident.get('reason', 'not checked')}); "
                "run where the data is readable to record a reference for it"
            )
        target = committed_path(case_dir, res.model, res.recipe, phase, fp)
        repeats, made, refused = [], [], []
        for p, r, qs in through:
            for q in qs:
                loss = next((x.loss for x in q.phases if x.phase == phase), None)
                if not loss:
                    raise InputError(f"{p}: round {q.round} has no loss curve for phase {phase!r}")
                if target.is_file():
                    refused.append(_refused_by(target, r, p, q, phase, loss))
                repeats.append(Repeat(path=shown(p) + ("" if len(qs) == 1 else f" (round {q.round})"), loss=loss))
                made.append({**_provenance(r, q, p), "path": repeats[-1].path})
        try:
            curve = mean_reference(shown(path), repeats) if len(repeats) > 1 else Reference(path=shown(path), loss=repeats[0].loss)
            check_curve(curve)
        except ValueError as exc:
            raise InputError(f"phase {phase}: {exc}") from None
        if target.is_file() and not replace:
            raise InputError(f"{shown(target)}: a reference of this model, recipe and data exists; --replace replaces it")
        if any(refused):
            why_not = next(x for x in refused if x)
            raise InputError(f"{why_not}: a reference is not changed to absorb a run that failed against it")
        if len(distinct := distinct_curves(repeats)) < MIN_REPEATS:
            raise InputError(
                f"phase {phase}: {len(repeats)} round(s) give {len(distinct)} distinct curve(s); a reference needs at least "
                f"{MIN_REPEATS} repeats that differ in rounding (other layouts or micro batches: on a CPU a run made again "
                "as it was gives the same curve), so that its spread is measured"
            )
        steps = sorted(curve.loss)
        doc: dict[str, Any] = {
            "model": res.model,
            "phase": phase,
            "recipe": res.recipe,
            "global_batch": planning.phase_value(res.settings.get("train") or {}, phase, "global_batch"),
            "data": {k: v for k, v in ident.items() if k in ("kind", "format", "fingerprint", "own_fingerprint", "starts_from", "sampled")},
            "why": why.strip() or f"the first reference of {res.model}'s {res.recipe} recipe: {len(repeats)} run(s) of {res.config_name}",
            "made": dt.date.today().isoformat(),
            "steps": steps,
            "loss": [curve.loss[s] for s in steps],
        }
        doc["spread"] = curve.spread
        doc["repeats"] = [{**m, "steps": sorted(r.loss), "loss": [r.loss[s] for s in sorted(r.loss)]} for m, r in zip(made, repeats)]
        out.append((target, doc))
    lines = []
    for target, doc in out:  # every phase checked before any file is written
        existed = target.is_file()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc, indent=1) + "\n")
        spread = f", spread {100 * doc['spread']:.3f}%" if "spread" in doc else ""
        lines.append(
            f"{'replaced' if existed else 'wrote'} {shown(target)} (phase {doc['phase']}, recipe {doc['recipe']}, "
            f"{len(doc['repeats'])} run(s){spread}, steps {doc['steps'][0]}-{doc['steps'][-1]})"
        )
    return lines


# --------------------------------------------------------------------------- judging a finished run


def judge_file(path: Path, files: list[Path]) -> list[str]:
    """A finished run judged against ``files`` (a reference made after it ran), written into its
    results.json: each phase's gate and reference, its rounds' status, the run's status, and in
    ``runtime_info.judged_again`` when and against what. The same gate as a live run's, on the
    curve the run recorded. Only rounds that ran through are judged; one line per round."""
    res = tr.load(path)
    _rounds_ran_through(res, path)
    lines, rounds = [], []
    for rnd in res.rounds:
        if not rnd.ran_through:
            rounds.append(rnd)
            continue
        phases, gates = [], {}
        for p in rnd.phases:
            ref = offline_reference(res, p.phase, files)
            gates[p.phase] = judge_loss(p.loss, ref, p.window.warmup_steps)
            phases.append(p.model_copy(update={"gate": gates[p.phase], "reference": ref}))
        status, reasons = round_status([], gates)
        mre, aligned = round_loss(list(gates.values()))
        reference = {**rnd.reference, **{p.phase: p.reference.path for p in phases if p.reference}}
        update = {"phases": phases, "status": status, "error": "\n".join(reasons) or None, "loss_mre": mre, "loss_aligned": aligned}
        rounds.append(rnd.model_copy(update={**update, "reference": reference}))
        lines.append(f"{path}: round {rnd.round} {status}: " + "; ".join(f"{ph} {g.verdict}: {g.reason}" for ph, g in gates.items()))
    again = [*(res.runtime_info.get("judged_again") or []), {"date": dt.date.today().isoformat(), "reference": [shown(f) for f in files]}]
    res = res.model_copy(
        update={
            "rounds": rounds,
            **typed_results.run_outcome(rounds, None, len(rounds)),
            "runtime_info": {**res.runtime_info, "judged_again": again},
        }
    )
    path.write_text(json.dumps(res.dump(), indent=2, default=str) + "\n")
    return lines


def offline_reference(res: tr.RunResults, phase: str, files: list[Path]) -> Reference:
    """``files`` as the reference of a finished run's phase (``--judge``): each checked as a live
    run's --reference is (data first, then model, phase, recipe, global batch), their mean where
    several. InputError naming the file otherwise."""
    ours = planning.phase_value(res.settings.get("train") or {}, phase, "global_batch")
    ident = (res.data or {}).get(phase)
    fp = datacheck.SYNTHETIC if ident is None else ident.get("fingerprint")  # None: not checked, judged by none
    for f in files:  # a curve of other data cannot judge it: both fingerprints named
        check_reference_data(f, phase, fp, res.model, (ident or {}).get("reason"))
    refs = []
    for f in files:
        try:
            ref = read_reference(f, phase)
            check_curve(ref)
            same_training(f, phase, res.model, ours, res.recipe)
        except ValueError as exc:
            raise InputError(f"--reference {exc}") from None
        refs.append(ref)
    try:
        ref = combine(refs)
    except ValueError as exc:
        raise InputError(f"--reference {exc}") from None
    return ref.model_copy(update={"path": shown_paths(ref.path)})


# --------------------------------------------------------------------------- what validates a config


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

    from run_benchmarks.planning.casename import CaseName

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


def absorbed_failures(path: Path) -> list[str]:
    """The repeats of a committed reference that were judged not aligned against a reference of
    the same model (an earlier version of it, by whatever name it had then): a reference made to
    absorb a run that failed against it. Repeats whose results.json is not in the repository are
    not checked."""
    doc = json.loads(path.read_text())
    model, out = doc["model"], []
    for rep in doc.get("repeats") or []:
        file = registry.ROOT / str(rep.get("path", "")).split(" (round ")[0]
        if not file.is_file():
            continue
        res = tr.load(file)
        for rnd in res.rounds:
            if _failed_against_model(model, rnd, doc["phase"]) is not None:
                ref = rnd.reference.get(doc["phase"])
                out.append(f"{shown(path)}: repeat {shown(file)} round {rnd.round} was judged not aligned against {ref}")
    return out


# --------------------------------------------------------------------------- references belong to their data


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


def judge_phase(loss: dict[int, float], reference: Any, warmup: int, plan: Any, phase: str, why_none: str | None = None) -> Any:
    """The loss gate (judge_loss), with the reason a phase has no reference: ``why_none``
    (the caller's: e.g. the committed curve is of another global batch), or real data's own."""
    gate = judge_loss(loss, reference, warmup)
    reason = (why_none or no_reference_reason(plan, phase)) if reference is None else None
    if reason and gate.verdict == "not judged" and gate.nonfinite_step is None:
        gate = gate.model_copy(update={"reason": reason})
    return gate


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
