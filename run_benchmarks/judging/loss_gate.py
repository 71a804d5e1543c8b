"""The loss gate (seed 000): a phase's loss curve against its reference, aligned when the mean
relative error over the reference's steps from 21 on is under 2 %; against a reference of
repeats, its deviation in units of their spread. And a round's status from its phases' verdicts.

Pure functions of curves (typed_results' Reference and LossGate): nothing here reads a file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from run_benchmarks.curve_math import ALIGN_FROM_STEP, MIN_COMPARED_STEPS, BadReference, compared_steps, loss_mre, step_ranges
from run_benchmarks.typed_results import LossGate, Reference, Status

ALIGN_TOLERANCE = 0.02  # aligned when the mean relative error is below 2 %


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
