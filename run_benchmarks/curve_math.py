"""The arithmetic of loss curves that both reading a reference and judging a run need: the steps
compared (seed 000: from step 21 on), whether a curve can judge at all, and the mean relative
error of one curve against another. Pure functions of curves; nothing here reads a file."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from run_benchmarks.typed_results import Reference

ALIGN_FROM_STEP = 21  # seed 000: loss compared from step 21 on
MIN_COMPARED_STEPS = 5  # fewer compared steps judge nothing


class BadReference(ValueError):
    """A reference curve that cannot judge a run; the message names the file and the step."""


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
