"""The loss gate and the round statuses as pure functions, on curves written here.

The same rules through start_task.py on real tiny runs are in test_e2e_local.py.
"""

from __future__ import annotations

import json
import math

import pytest

from run_benchmarks import metrics
from run_benchmarks.orchestrator import round_status
from run_benchmarks.typed_results import LossGate, Reference

NAN, INF = float("nan"), float("inf")


def curve(scale: float = 1.0, last: int = 30) -> dict[int, float]:
    return {s: (4.0 - s * 0.05) * scale for s in range(1, last + 1)}


def ref(last: int = 30, **changes: float) -> Reference:
    loss = curve(last=last)
    loss.update({int(k.removeprefix("s")): v for k, v in changes.items()})
    return Reference(path="/refs/curve.json", loss=loss)


def test_within_and_beyond_two_percent():
    near = metrics.judge_loss(curve(1.019), ref(), warmup_steps=5)
    assert (near.verdict, near.compared_steps, near.first_step, near.last_step) == ("aligned", 10, 21, 30)
    assert near.mre == pytest.approx(0.019) and near.reason == "MRE 1.90% over steps 21-30"
    far = metrics.judge_loss(curve(1.021), ref(), warmup_steps=5)
    assert far.verdict == "not aligned" and far.mre == pytest.approx(0.021)
    assert far.reason == "MRE 2.10% over steps 21-30 (at least 2%)"


def test_early_steps_do_not_count():
    got = curve()
    for s in range(1, 21):
        got[s] *= 3
    assert metrics.judge_loss(got, ref(), warmup_steps=5).mre == 0


def test_steps_the_reference_has_must_be_in_the_run():
    short = metrics.judge_loss(curve(last=25), ref(), warmup_steps=5)
    assert short.verdict == "not judged" and short.reason == "steps 26-30 missing (reference to step 30)"
    assert short.mre is None and short.aligned is None
    holes = curve()
    del holes[22], holes[27]
    assert metrics.judge_loss(holes, ref(), warmup_steps=5).reason == "steps 22, 27 missing (reference to step 30)"
    # the run going further than the reference is fine: compared up to the reference's last step
    assert metrics.judge_loss(curve(last=40), ref(), warmup_steps=5).compared_steps == 10


def test_nan_or_inf_fails_whether_or_not_the_reference_has_the_step():
    lacks = curve(last=35)
    lacks[33] = NAN  # the reference ends at 30
    g = metrics.judge_loss(lacks, ref(), warmup_steps=5)
    assert (g.verdict, g.nonfinite_step, g.reason) == ("not aligned", 33, "loss NaN at step 33")
    early = curve()
    early[7] = INF
    assert metrics.judge_loss(early, ref(), warmup_steps=5).reason == "loss inf at step 7"
    # with no reference at all a NaN still fails
    assert metrics.judge_loss(lacks, None, warmup_steps=5).nonfinite_step == 33
    status, why = round_status([], {"train": metrics.judge_loss(lacks, None, warmup_steps=5)})
    assert status == "failed" and why == ["phase train: loss NaN at step 33"]


def test_too_few_compared_steps_judge_nothing():
    few = Reference(path="/refs/few.json", loss={s: 4.0 for s in range(1, 25)})  # 21-24: four steps
    g = metrics.judge_loss(curve(), few, warmup_steps=5)
    assert g.verdict == "not judged" and g.reason == "4 step(s) compared, at least 5 needed"
    with pytest.raises(
        metrics.BadReference, match=r"^/refs/few.json: 4 step\(s\) from step 21 on \(steps 21-24\); the loss gate compares at least 5$"
    ):
        metrics.check_curve(few)
    with pytest.raises(metrics.BadReference, match=r"0 step\(s\) from step 21 on \(none\)"):
        metrics.check_curve(Reference(path="/refs/early.json", loss=curve(last=20)))


@pytest.mark.parametrize("bad", [0.0, NAN, INF])
def test_a_zero_or_nonfinite_reference_loss_is_a_bad_reference(bad):
    r = ref(s24=bad)
    with pytest.raises(metrics.BadReference, match=rf"^/refs/curve.json: step 24: reference loss {bad}"):
        metrics.judge_loss(curve(), r, warmup_steps=5)
    with pytest.raises(metrics.BadReference, match=r"/refs/curve.json: step 24: reference loss"):
        metrics.check_curve(r)


def test_no_reference_is_not_judged():
    g = metrics.judge_loss(curve(), None, warmup_steps=5)
    assert (g.verdict, g.reason) == ("not judged", "no reference curve")


def gate(verdict: str, reason: str = "why") -> LossGate:
    return LossGate(verdict=verdict, reason=reason, mre=0.01 if verdict != "not judged" else None)


def test_round_statuses():
    assert round_status([], {"train": gate("aligned")}) == ("ok", [])
    assert round_status([], {"train": gate("not judged", "no reference curve")}) == (
        "unjudged",
        ["phase train: loss not judged: no reference curve"],
    )
    # a phase not aligned outweighs one not judged; both are named
    status, why = round_status([], {"pretrain": gate("not judged", "steps 26-30 missing"), "finetune": gate("not aligned", "MRE 5.00%")})
    assert status == "invalid" and why == [
        "phase finetune: loss not aligned: MRE 5.00%",
        "phase pretrain: loss not judged: steps 26-30 missing",
    ]
    # every phase is judged: the second phase alone off makes the round invalid
    assert round_status([], {"pretrain": gate("aligned"), "finetune": gate("not aligned", "MRE 3.00%")})[0] == "invalid"
    status, why = round_status(["node0 (localhost): exit status 1"], {"train": gate("aligned")})
    assert status == "failed" and why == ["node0 (localhost): exit status 1"]


def test_step_ranges():
    assert metrics.step_ranges([26, 27, 28, 29, 30]) == "26-30"
    assert metrics.step_ranges([30, 22, 26, 27]) == "22, 26-27, 30"
    assert metrics.step_ranges([]) == ""


def _results_file(path, status):
    """A results.json as a reference: one round with ``status`` and a 30-step curve."""
    from tests.test_results_models import fake_run

    path.write_text(json.dumps(fake_run([{"status": status}]).dump()))
    return path


@pytest.mark.parametrize("status, usable", [("ok", True), ("unjudged", True), ("invalid", False), ("failed", False)])
def test_a_reference_run_must_have_run_clean(tmp_path, status, usable):
    path = _results_file(tmp_path / "results.json", status)
    if usable:
        r = metrics.read_reference(path, "train")
        assert r.path == str(path) and sorted(r.loss) == list(range(1, 31)) and math.isfinite(r.loss[30])
    else:
        with pytest.raises(ValueError, match=rf"^{path}: no round ran clean \(ok or unjudged\): round 1 {status}"):
            metrics.read_reference(path, "train")
