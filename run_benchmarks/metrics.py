"""Round metrics from parsed metric-log records: throughput, MFU, memory, the loss gate.

Everything here works after a round, on what its ranks wrote: nothing runs per step.
The figures of a phase come from its step records alone (:func:`figures`), so --verify
recomputes them from the records kept in results.json with the same code.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from run_benchmarks import typed_results
from run_benchmarks.errors import InputError
from run_benchmarks.typed_results import DeviceClocks, DeviceMemory, LossGate, Reference, Repeat, Spread, Step, Window
from training import metriclog as ml
from training.flops import mfu

ALIGN_FROM_STEP = 21  # seed 000: loss compared from step 21 on
ALIGN_TOLERANCE = 0.02  # aligned when the mean relative error is below 2 %
MIN_COMPARED_STEPS = 5  # fewer compared steps judge nothing
#: against repeats that differ by the tolerance or more, a run further from their mean than this
#: many times their spread is not aligned: the repeats' own noise does not reach that far
BEYOND_SPREAD = 2.0
#: a curve jumps where its loss climbs back above its first step's loss, rising by at least this
#: fraction from the step before: after such a jump curves that differ only by rounding part
JUMP_RISE = 0.05
GIB = 1024**3


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


def judge_loss(loss: Mapping[int, float], reference: Reference | None, warmup_steps: int) -> LossGate:
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
    if not isinstance(items, list) or len(items) < 2:
        raise ValueError(f"{path}: repeats: a list of at least two curves ({{path, steps, loss}}) expected")
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


# --------------------------------------------------------------------------- figures of a phase


def step_records(parsed: ml.ParsedLog, phase: str) -> list[Step]:
    """The phase's step records, one per step number (the reporting rank's), in step order."""
    by_step: dict[int, Step] = {}
    for r in parsed.of(ml.EV_STEP, ml.K_TRAIN_STEP):
        v = r.value
        if v.get("phase", "train") != phase or int(v["step"]) in by_step:
            continue
        by_step[int(v["step"])] = Step(
            step=int(v["step"]),
            t=r.t,
            loss=float(v["loss"]),
            tokens=float(v["tokens"]),
            step_time_s=float(v["step_time_s"]),
            lr=float(v["lr"]),
            data_s=None if v.get("data_s") is None else float(v["data_s"]),
            profiled=bool(v.get("profiled", False)),
            skipped=bool(v.get("skipped", False)),
        )
    return [by_step[k] for k in sorted(by_step)]


def figures(
    steps: Sequence[Step], warmup_steps: int, world_size: int, counts: Mapping[str, Any], peak_flops: float | None
) -> dict[str, Any]:
    """Everything a phase's step records determine: the window, tokens/p/s, step time, MFU both
    ways, the loss curve. --verify compares a results.json against this."""
    # a profiled step runs under the profiler's cost: never part of the throughput window
    after_warmup = [s for s in steps if s.step > warmup_steps]
    window = [s for s in after_warmup if not s.profiled]
    out: dict[str, Any] = {
        "steps_run": len(steps),
        "window": Window(warmup_steps=warmup_steps),
        "tokens_per_gpu_s": None,
        "step_time_s": None,
        "throughput_spread": None,
        "mfu_6n": None,
        "mfu_palm": None,
        "loss_final": steps[-1].loss if steps else None,
        "loss": {s.step: s.loss for s in steps},
    }
    if window:
        tokens = sum(s.tokens for s in window)
        seconds = sum(s.step_time_s for s in window)
        tps = tokens / seconds / world_size if seconds > 0 else None
        out["window"] = Window(
            first_step=window[0].step,
            last_step=window[-1].step,
            steps=len(window),
            warmup_steps=warmup_steps,
            excluded=[s.step for s in after_warmup if s.profiled],
        )
        out["tokens_per_gpu_s"] = tps
        out["step_time_s"] = seconds / len(window)
        out["throughput_spread"] = spread([s.tokens / s.step_time_s / world_size for s in window if s.step_time_s > 0])
        out["mfu_6n"] = mfu(counts["flops_per_token_6n"], tps, peak_flops)
        out["mfu_palm"] = mfu(counts["flops_per_token_palm"], tps, peak_flops)
    return out


def spread(values: Sequence[float]) -> Spread | None:
    """Median, 10th and 90th percentiles (linear between the ordered values), lowest and highest of
    ``values``; None for none."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        p10 = p90 = xs[0]
    else:
        deciles = statistics.quantiles(xs, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return Spread(steps=len(xs), median=statistics.median(xs), p10=p10, p90=p90, min=xs[0], max=xs[-1])


def step_breakdowns(parsed: ml.ParsedLog, phase: str, window_step_time_s: float | None) -> dict[str, dict[str, Any]]:
    """rank -> training.profiling.breakdown() of its profiled step, set against an ordinary step.

    The profiler slows the host, so its step idles more than the others: the busy time
    measured under it, set against an ordinary step of the window, estimates the true idle.
    """
    out = {str(r.rank): dict(r.value) for r in parsed.of(ml.EV_INFO, ml.K_STEP_BREAKDOWN) if r.value.get("phase", "train") == phase}
    if window_step_time_s is not None:
        for b in out.values():
            b["window_step_time_s"] = window_step_time_s
            b["idle_estimate_s"] = max(0.0, window_step_time_s - float(b["busy_s"]))
    return out


def phase_span(steps: Sequence[Step]) -> tuple[float, float] | None:
    """Wall-clock start of the phase's first step to the end of its last."""
    if not steps:
        return None
    return min(s.t - s.step_time_s for s in steps), max(s.t for s in steps)


# --------------------------------------------------------------------------- memory


def memory_summary(parsed: ml.ParsedLog, phase: str | None = None) -> dict[str, Any]:
    """The allocator's peak over ranks (``peak_memory`` records), of one phase if given, the most
    its cache reserved on any rank and the most cache flushes for want of a free block on any rank
    (``alloc_retries``; each where reported), and the device total the framework reported."""
    per_rank: dict[int, dict[str, Any]] = {}
    for r in parsed.of(ml.EV_MEMORY, ml.K_PEAK_MEMORY):
        if phase is not None and r.value.get("phase", "train") != phase:
            continue
        cur = per_rank.get(r.rank)
        if cur is None or r.value["peak_bytes"] > cur["peak_bytes"]:
            per_rank[r.rank] = r.value
    if not per_rank:
        return {"peak_mem_gib": None, "reserved_mem_gib": None, "alloc_retries": None, "total_mem_gib": None, "per_rank_gib": {}}
    peak = max(v["peak_bytes"] for v in per_rank.values())
    totals = [v["total_bytes"] for v in per_rank.values() if v.get("total_bytes")]
    reserved = [v["reserved_bytes"] for v in per_rank.values() if v.get("reserved_bytes") is not None]
    retries = [v["alloc_retries"] for v in per_rank.values() if v.get("alloc_retries") is not None]
    return {
        "peak_mem_gib": peak / GIB,
        "reserved_mem_gib": (max(reserved) / GIB) if reserved else None,
        "alloc_retries": max(retries) if retries else None,
        "total_mem_gib": (max(totals) / GIB) if totals else None,
        "per_rank_gib": {str(k): v["peak_bytes"] / GIB for k, v in sorted(per_rank.items())},
    }


def read_monitor(path: Path) -> list[dict[str, Any]]:
    """A node's monitor samples (monitors.MonitorThread's JSON lines); none when it wrote none."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by the monitor's stop
            continue
    return out


MonitorNodes = Sequence[tuple[list[dict[str, Any]], set[int] | None]]


def used_gpu_samples(nodes: MonitorNodes, span: tuple[float, float] | None) -> Iterator[dict[str, Any]]:
    """Each GPU sample of the GPUs the run used (``nodes``: per node, its monitor samples and the
    GPU indices its ranks used, None: all), of the samples inside ``span`` (every sample without one)."""
    for samples, gpus in nodes:
        for s in samples:
            if span is not None and not span[0] <= float(s.get("t", 0)) <= span[1]:
                continue
            for g in s.get("gpus") or []:
                if gpus is None or int(g.get("index", -1)) in gpus:
                    yield g


def device_memory(nodes: MonitorNodes, span: tuple[float, float] | None) -> DeviceMemory | None:
    """Device memory in use on the busiest GPU the run used, as the monitor saw it.

    ``nodes``: per node, its monitor samples and the GPU indices its ranks used (None: all).
    Over the samples inside ``span`` (a phase) when there are any, else over the round.
    None when no monitor read a device (a CPU run).
    """

    def peak(within: tuple[float, float] | None) -> tuple[float, float | None] | None:
        found = [
            (float(g["mem_used_gib"]), g.get("mem_total_gib")) for g in used_gpu_samples(nodes, within) if g.get("mem_used_gib") is not None
        ]
        return max(found, key=lambda x: x[0], default=None)

    if span is not None and (got := peak(span)) is not None:
        return DeviceMemory(used_gib=got[0], total_gib=got[1], scope="phase")
    got = peak(None)
    return None if got is None else DeviceMemory(used_gib=got[0], total_gib=got[1], scope="round")


def device_clocks(nodes: MonitorNodes, span: tuple[float, float] | None) -> DeviceClocks | None:
    """The SM clock over a phase's steps (``span``), from every sample of every GPU the run used
    (``nodes`` as :func:`device_memory`'s): median, 10th percentile, the devices' maximum, and the
    share of samples the driver held the clock down for each reason. None without a span or
    without clock samples inside it (a CPU run, a monitor that does not read clocks)."""
    if span is None:
        return None
    clocks: list[float] = []
    maxima: list[float] = []
    held: dict[str, int] = {}
    for g in used_gpu_samples(nodes, span):
        if g.get("sm_clock_mhz") is None:
            continue
        clocks.append(float(g["sm_clock_mhz"]))
        if g.get("sm_clock_max_mhz") is not None:
            maxima.append(float(g["sm_clock_max_mhz"]))
        for reason in g.get("clock_held") or []:
            held[reason] = held.get(reason, 0) + 1
    if not clocks:
        return None
    clocks.sort()
    return DeviceClocks(
        samples=len(clocks),
        sm_median_mhz=statistics.median(clocks),
        sm_low_mhz=clocks[int(0.1 * (len(clocks) - 1))],
        sm_max_mhz=max(maxima) if maxima else None,
        held={r: n / len(clocks) for r, n in sorted(held.items())},
    )
