"""The loss gate and the round statuses as pure functions, on curves written here.

The same rules through start_task.py on real tiny runs are in test_e2e_local.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from run_benchmarks import curve_math
from run_benchmarks.judging import loss_gate, recording, results, rounds
from run_benchmarks.judging.loss_gate import round_status
from run_benchmarks.planning import curves, references
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.typed_results import LossGate, Reference, Repeat

NAN, INF = float("nan"), float("inf")


def curve(scale: float = 1.0, last: int = 30) -> dict[int, float]:
    return {s: (4.0 - s * 0.05) * scale for s in range(1, last + 1)}


def ref(last: int = 30, **changes: float) -> Reference:
    loss = curve(last=last)
    loss.update({int(k.removeprefix("s")): v for k, v in changes.items()})
    return Reference(path="/refs/curve.json", loss=loss)


def test_within_and_beyond_two_percent():
    near = loss_gate.judge_loss(curve(1.019), ref(), warmup_steps=5)
    assert (near.verdict, near.compared_steps, near.first_step, near.last_step) == ("aligned", 10, 21, 30)
    assert near.mre == pytest.approx(0.019) and near.reason == "MRE 1.90% over steps 21-30"
    far = loss_gate.judge_loss(curve(1.021), ref(), warmup_steps=5)
    assert far.verdict == "not aligned" and far.mre == pytest.approx(0.021)
    assert far.reason == "MRE 2.10% over steps 21-30 (at least 2%)"


def test_early_steps_do_not_count():
    got = curve()
    for s in range(1, 21):
        got[s] *= 3
    assert loss_gate.judge_loss(got, ref(), warmup_steps=5).mre == 0


def test_steps_the_reference_has_must_be_in_the_run():
    short = loss_gate.judge_loss(curve(last=25), ref(), warmup_steps=5)
    assert short.verdict == "not judged" and short.reason == "steps 26-30 missing (reference to step 30)"
    assert short.mre is None and short.aligned is None
    holes = curve()
    del holes[22], holes[27]
    assert loss_gate.judge_loss(holes, ref(), warmup_steps=5).reason == "steps 22, 27 missing (reference to step 30)"
    # the run going further than the reference is fine: compared up to the reference's last step
    assert loss_gate.judge_loss(curve(last=40), ref(), warmup_steps=5).compared_steps == 10


def test_nan_or_inf_fails_whether_or_not_the_reference_has_the_step():
    lacks = curve(last=35)
    lacks[33] = NAN  # the reference ends at 30
    g = loss_gate.judge_loss(lacks, ref(), warmup_steps=5)
    assert (g.verdict, g.nonfinite_step, g.reason) == ("not aligned", 33, "loss NaN at step 33")
    early = curve()
    early[7] = INF
    assert loss_gate.judge_loss(early, ref(), warmup_steps=5).reason == "loss inf at step 7"
    # with no reference at all a NaN still fails
    assert loss_gate.judge_loss(lacks, None, warmup_steps=5).nonfinite_step == 33
    status, why = round_status([], {"train": loss_gate.judge_loss(lacks, None, warmup_steps=5)})
    assert status == "failed" and why == ["phase train: loss NaN at step 33"]


def test_too_few_compared_steps_judge_nothing():
    few = Reference(path="/refs/few.json", loss={s: 4.0 for s in range(1, 25)})  # 21-24: four steps
    g = loss_gate.judge_loss(curve(), few, warmup_steps=5)
    assert g.verdict == "not judged" and g.reason == "4 step(s) compared, at least 5 needed"
    with pytest.raises(
        loss_gate.BadReference, match=r"^/refs/few.json: 4 step\(s\) from step 21 on \(steps 21-24\); the loss gate compares at least 5$"
    ):
        curve_math.check_curve(few)
    with pytest.raises(loss_gate.BadReference, match=r"0 step\(s\) from step 21 on \(none\)"):
        curve_math.check_curve(Reference(path="/refs/early.json", loss=curve(last=20)))


@pytest.mark.parametrize("bad", [0.0, NAN, INF])
def test_a_zero_or_nonfinite_reference_loss_is_a_bad_reference(bad):
    r = ref(s24=bad)
    with pytest.raises(loss_gate.BadReference, match=rf"^/refs/curve.json: step 24: reference loss {bad}"):
        loss_gate.judge_loss(curve(), r, warmup_steps=5)
    with pytest.raises(loss_gate.BadReference, match=r"/refs/curve.json: step 24: reference loss"):
        curve_math.check_curve(r)


def test_no_reference_is_not_judged():
    g = loss_gate.judge_loss(curve(), None, warmup_steps=5)
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
    assert loss_gate.step_ranges([26, 27, 28, 29, 30]) == "26-30"
    assert loss_gate.step_ranges([30, 22, 26, 27]) == "22, 26-27, 30"
    assert loss_gate.step_ranges([]) == ""


def _results_file(path, status):
    """A results.json as a reference: one round with ``status`` and a 30-step curve."""
    from tests.test_results_models import fake_run

    path.write_text(json.dumps(fake_run([{"status": status}]).dump()))
    return path


@pytest.mark.parametrize("status, usable", [("ok", True), ("unjudged", True), ("invalid", True), ("failed", False)])
def test_a_reference_run_must_have_run_through(tmp_path, status, usable):
    """A failed round is no reference; an invalid one is (its curve only differed from another)."""
    path = _results_file(tmp_path / "results.json", status)
    if usable:
        r = curves.read_reference(path, "train")
        assert r.path == str(path) and sorted(r.loss) == list(range(1, 31)) and math.isfinite(r.loss[30])
    else:
        with pytest.raises(
            ValueError,
            match=rf"^{path}: no round ran through \(ok, unjudged or invalid by its own gate\): round 1 {status}; a failed round",
        ):
            curves.read_reference(path, "train")


def test_the_rounds_of_a_reference_run_are_its_repeats(tmp_path):
    """A run of several rounds given as the reference: each round that ran through is a repeat, the
    curve their mean and the gate's noise floor their spread; a failed round is left out."""
    from tests.test_results_models import fake_phase, fake_run

    path = tmp_path / "results.json"
    rounds = [
        {"phases": [fake_phase(loss_scale=1.0)]},
        {"status": "failed"},
        {"phases": [fake_phase(loss_scale=1.02)], "status": "invalid"},
    ]
    path.write_text(json.dumps(fake_run(rounds).dump()))
    r = curves.read_reference(path, "train")
    assert [x.path for x in r.repeats] == [f"{path} (round 1)", f"{path} (round 3)"]
    assert r.loss[25] == pytest.approx((r.repeats[0].loss[25] + r.repeats[1].loss[25]) / 2)
    assert r.spread == pytest.approx(0.02)  # round 3 against round 1: 2 %; round 1 against round 3: 0.02/1.02
    short = tmp_path / "short.json"
    short.write_text(json.dumps(fake_run([{}, {"phases": [fake_phase(steps=27)]}]).dump()))
    with pytest.raises(ValueError, match=rf"^{short} \(round 2\): steps 28-30 missing, which another repeat has"):
        curves.read_reference(short, "train")


# --------------------------------------------------------------------------- reference repeats: the gate's noise floor


def repeat(path: str, level: float, last: int = 25, early: float | None = None) -> Repeat:
    """A flat curve at ``level`` from step 1 to ``last`` (``early`` before step 21, when given)."""
    return Repeat(path=path, loss={s: (early if early is not None and s < 21 else level) for s in range(1, last + 1)})


def test_the_mean_of_repeats_and_their_leave_one_out_spread():
    a, b, c = repeat("/runs/a.json", 4.0, early=9.0), repeat("/runs/b.json", 4.2), repeat("/runs/c.json", 4.4)
    r = curves.mean_reference("/runs/a.json; /runs/b.json; /runs/c.json", [a, b, c])
    assert r.loss[21] == pytest.approx(4.2) and r.loss[25] == pytest.approx(4.2) and sorted(r.loss) == list(range(1, 26))
    assert r.loss[1] == pytest.approx((9.0 + 4.2 + 4.4) / 3)  # the early steps are averaged too, but never compared
    # leave one out over steps 21-25: a against (4.2+4.4)/2 = 4.3 -> 0.3/4.3; b against 4.2 -> 0; c against 4.1 -> 0.3/4.1
    assert r.spread == pytest.approx(0.3 / 4.1) and [x.path for x in r.repeats] == ["/runs/a.json", "/runs/b.json", "/runs/c.json"]
    assert curves.repeat_spread([a, b, c]) == pytest.approx(0.3 / 4.1)
    # two repeats: each against the other; the larger of 0.4/4.4 and 0.4/4.0
    assert curves.repeat_spread([a, c]) == pytest.approx(0.1)
    assert curves.repeat_spread([a]) is None
    # several files as one reference: each file's curve is a repeat; one file stays as it is
    one = Reference(path="/runs/a.json", loss=a.loss)
    assert curves.combine([one]) is one and one.spread is None and one.repeats == []
    both = curves.combine([one, Reference(path="/runs/c.json", loss=c.loss)])
    assert both.path == "/runs/a.json; /runs/c.json" and both.spread == pytest.approx(0.1) and both.loss[22] == pytest.approx(4.2)
    # a file that carries repeats brings them, not its mean
    d = repeat("/runs/d.json", 4.3)
    assert len(curves.combine([r, Reference(path=d.path, loss=d.loss)]).repeats) == 4
    # a curve equal at every step to another (a machine that computes alike run after run, run
    # twice) counts once: in the mean, in the spread and among the repeats
    assert [x.path for x in curves.combine([r, one]).repeats] == ["/runs/a.json", "/runs/b.json", "/runs/c.json"]
    twice = curves.mean_reference("/runs/abb", [a, b, repeat("/runs/b2.json", 4.2)])
    assert [x.path for x in twice.repeats] == ["/runs/a.json", "/runs/b.json"] and twice.spread == curves.repeat_spread([a, b])
    assert twice.loss[22] == pytest.approx(4.1)  # not (4.0 + 4.2 + 4.2) / 3
    same = curves.mean_reference("/runs/bb", [b, repeat("/runs/b2.json", 4.2)])  # one curve: judged as one curve
    assert same.repeats == [] and same.spread is None and same.loss == b.loss


def test_the_verdict_switches_off_at_the_tolerance():
    run = {s: 50.5 for s in range(1, 26)}
    at = curves.mean_reference("/runs/ab", [repeat("/runs/a.json", 50.0), repeat("/runs/b.json", 51.0)])  # 1/50: 2 % exactly
    assert at.spread == loss_gate.ALIGN_TOLERANCE
    g = loss_gate.judge_loss(run, at, warmup_steps=5)
    assert (g.verdict, g.aligned, g.mre, g.compared_steps, g.first_step, g.last_step) == ("not judged", None, 0.0, 5, 21, 25)
    assert g.reason == (
        "reference repeats differ by 2.00% among themselves (at least 2%): this batch and length cannot resolve the 2% rule; "
        "MRE 0.00% over steps 21-25"
    )
    assert round_status([], {"train": g}) == ("unjudged", [f"phase train: loss not judged: {g.reason}"])
    # off the mean by up to twice the repeats' spread: still not judged, the reference cannot tell
    assert loss_gate.judge_loss({s: 50.5 * 1.039 for s in range(1, 26)}, at, warmup_steps=5).verdict == "not judged"
    # further than that: not aligned, whatever the tolerance the repeats could resolve
    far = loss_gate.judge_loss({s: 60.0 for s in range(1, 26)}, at, warmup_steps=5)
    assert (far.verdict, far.aligned) == ("not aligned", False) and far.mre == pytest.approx(9.5 / 50.5)
    assert far.reason == (
        "MRE 18.81% over steps 21-25 against the mean of 2 runs, more than 2 times their spread (2.00%): beyond the repeats' own noise"
    )
    assert round_status([], {"train": far})[0] == "invalid"
    below = curves.mean_reference("/runs/ab", [repeat("/runs/a.json", 50.0), repeat("/runs/b.json", 50.99)])
    assert below.spread == pytest.approx(0.0198)
    g = loss_gate.judge_loss(run, below, warmup_steps=5)
    assert g.verdict == "aligned" and g.mre == pytest.approx(0.005 / 50.495)
    assert g.reason == "MRE 0.01% over steps 21-25 against the mean of 2 runs (their spread 1.98%)"
    off = loss_gate.judge_loss({s: 52.0 for s in range(1, 26)}, below, warmup_steps=5)
    assert off.verdict == "not aligned"
    assert off.reason == "MRE 2.98% over steps 21-25 against the mean of 2 runs (their spread 1.98%) (at least 2%)"
    # a NaN still fails the round whatever the reference's spread
    assert loss_gate.judge_loss({**run, 23: NAN}, at, warmup_steps=5).nonfinite_step == 23


def test_a_repeat_lacking_a_compared_step_is_named():
    long, short = repeat("/runs/long.json", 4.0, last=30), repeat("/runs/short.json", 4.1, last=27)
    with pytest.raises(loss_gate.BadReference, match=r"^/runs/short.json: steps 28-30 missing, which another repeat has \(every compared"):
        curves.mean_reference("/runs/both", [long, short])
    holed = repeat("/runs/holed.json", 4.1, last=30)
    del holed.loss[24]
    with pytest.raises(loss_gate.BadReference, match=r"^/runs/holed.json: step 24 missing"):
        curves.combine([Reference(path=long.path, loss=long.loss), Reference(path=holed.path, loss=holed.loss)])
    nan = repeat("/runs/nan.json", 4.1, last=30)
    nan.loss[26] = NAN
    with pytest.raises(loss_gate.BadReference, match=r"^/runs/nan.json: step 26: loss nan"):
        curves.mean_reference("/runs/both", [long, nan])


def jumping(level: float = 4.0, last: int = 30, at: int = 14, to: float = 9.0) -> dict[int, float]:
    """A curve from 8.0 down to ``level`` by step 10 that jumps to ``to`` at step ``at`` and is back at ``level`` after."""
    loss = {s: (8.0 - (8.0 - level) * (s - 1) / 9 if s < 10 else level) for s in range(1, last + 1)}
    loss[at] = to
    return loss


def test_a_jump_of_the_loss_is_found():
    assert loss_gate.loss_jump(curve()) is None
    assert loss_gate.loss_jump(jumping()) == (14, 4.0, 9.0)
    assert loss_gate.loss_jump(jumping(), until=13) is None
    # above the first step's loss but by less than 5 % over the step before: not a jump
    assert loss_gate.loss_jump({1: 10.0, 2: 9.9, 3: 10.3}) is None
    # 5 % up from the step before but still below where the curve began: an ordinary wobble
    assert loss_gate.loss_jump({1: 10.0, 2: 8.0, 3: 8.5}) is None
    assert loss_gate.loss_jump({1: 10.0, 2: 8.0, 3: NAN, 4: 12.0}) == (4, 8.0, 12.0)  # a NaN step is skipped
    assert loss_gate.loss_jump({}) is None and loss_gate.loss_jump({1: 3.0}) is None


def test_a_verdict_after_a_jump_of_the_reference_says_so():
    one = Reference(path="/refs/jump.json", loss=jumping())
    said = "the reference's loss jumps at step 14 (4.00 to 9.00, above its first step's 8.00): runs that differ only by rounding part after such a jump, so this verdict may turn on rounding"
    far = loss_gate.judge_loss({s: v * 1.03 for s, v in jumping().items()}, one, warmup_steps=5)
    assert far.verdict == "not aligned"
    assert (
        far.reason
        == f"MRE 3.00% over steps 21-30 (at least 2%); {said}; repeats of the reference (--reference given several times) measure how far"
    )
    near = loss_gate.judge_loss({s: v * 1.01 for s, v in jumping().items()}, one, warmup_steps=5)
    assert (near.verdict, near.reason) == ("aligned", "MRE 1.00% over steps 21-30")  # an aligned verdict needs no excuse
    note = loss_gate.resolution_note(one)
    assert note == (
        "its loss jumps at step 14 (4.00 to 9.00, above its first step's 8.00); the gate compares steps 21-30, and runs that "
        "differ only by rounding part after such a jump, so a verdict there may turn on rounding; repeats of the reference "
        "(--reference given several times) measure how far"
    )
    assert loss_gate.resolution_note(ref()) is None and loss_gate.resolution_note(None) is None
    # repeats that agree (spread below 2 %) but jump: the verdict stands, with the warning and no advice to repeat
    pair = curves.mean_reference("/runs/ab", [Repeat(path="/runs/a.json", loss=jumping()), Repeat(path="/runs/b.json", loss=jumping(4.04))])
    g = loss_gate.judge_loss({s: 4.3 for s in range(1, 31)}, pair, warmup_steps=5)
    assert g.verdict == "not aligned" and g.reason.endswith(f"(at least 2%); {said}")
    assert loss_gate.resolution_note(pair).endswith("its 2 repeats (spread 1.00%) may not show how far")
    # repeats that cannot resolve 2 %: not judged, and the reason says where they jump
    wide = curves.mean_reference(
        "/runs/ac", [Repeat(path="/runs/a.json", loss=jumping()), Repeat(path="/runs/c.json", loss=jumping(4.2, at=15))]
    )
    g = loss_gate.judge_loss({s: wide.loss[s] if s < 10 else 4.1 for s in range(1, 31)}, wide, warmup_steps=5)
    assert g.verdict == "not judged"
    assert "cannot resolve the 2% rule (their loss jumps at step 14 (4.00 to 9.00, above its first step's 8.00)); MRE" in g.reason
    assert loss_gate.resolution_note(wide).endswith(
        "one within that is not judged; over steps 1-6, where they agree within 2%, a run 2% or more from them is not aligned; "
        "their loss jumps at step 14 (4.00 to 9.00, above its first step's 8.00)"
    )
    # the run jumps where the reference does not: its not-aligned reason names the run's jump
    own = loss_gate.judge_loss(jumping(at=25, to=9.0), Reference(path="/refs/flat.json", loss={**jumping(), 14: 4.0}), warmup_steps=5)
    assert own.verdict == "not aligned" and own.reason.endswith("; the run's loss jumps at step 25 (4.00 to 9.00, above its first step's)")


def test_repeats_that_part_still_judge_the_steps_where_they_agree():
    """Repeats that cannot resolve 2 % from step 21 on (they part after a jump) agree before it;
    over those steps the rule holds: a run 2 % or more off them there is not aligned (the verdict's
    figures are that range's), one within it stays not judged and its reason gives that MRE."""
    a = jumping()
    b = {s: v * (1.001 if s < 14 else 1.2) for s, v in a.items()}  # equal to 0.1 % through step 13, 20 % apart after
    wide = curves.mean_reference("/runs/ab", [Repeat(path="/runs/a.json", loss=a), Repeat(path="/runs/b.json", loss=b)])
    assert loss_gate.cannot_resolve(wide) and loss_gate.agreement_steps(wide) == list(range(1, 14))
    like = {s: wide.loss[s] * (1.004 if s < 14 else 1.05) for s in range(1, 31)}
    g = loss_gate.judge_loss(like, wide, warmup_steps=5)
    assert (g.verdict, g.first_step, g.last_step) == ("not judged", 21, 30)
    assert g.reason.endswith("; over steps 1-13, where the repeats agree within 2%, MRE 0.40%")
    off = {s: wide.loss[s] * (1.03 if s < 14 else 1.05) for s in range(1, 31)}  # 3 % off before they part, 5 % after
    g = loss_gate.judge_loss(off, wide, warmup_steps=5)
    assert (g.verdict, g.compared_steps, g.first_step, g.last_step) == ("not aligned", 13, 1, 13) and g.mre == pytest.approx(0.03)
    assert g.reason.startswith(
        "MRE 3.00% over steps 1-13 (at least 2%), where the reference's 2 repeats agree within 2% of each other: "
        "the run leaves them before they part (from step 21 on they differ by "
    )
    assert round_status([], {"train": g})[0] == "invalid"
    # too few steps of agreement (repeats apart from step 5 on), or none (one curve): no such verdict
    early = {s: v * (1.001 if s < 5 else 1.2) for s, v in a.items()}
    short = curves.mean_reference("/runs/ae", [Repeat(path="/runs/a.json", loss=a), Repeat(path="/runs/e.json", loss=early)])
    assert loss_gate.agreement_steps(short) == [1, 2, 3, 4]
    assert loss_gate.judge_loss({s: short.loss[s] * (1.03 if s < 5 else 1.05) for s in range(1, 31)}, short, 5).verdict == "not judged"
    assert loss_gate.agreement_steps(Reference(path="/refs/one.json", loss=a)) == []


def test_the_committed_baichuan2_curve_jumps_at_step_14():
    """The 4 x H200 standard runs of baichuan2_13b (global batch 64) climb from about 6.8 to 17 at
    step 14, above their first loss of 12.24 (docs/results/history.md): the gate says so before a run."""
    r = curves.read_reference(ROOT / "cases/baichuan2/deepspeed/reference/baichuan2_13b/standard.json")
    assert loss_gate.reference_jump(r).startswith("at step 14 (") and "above its first step's 12.24" in loss_gate.resolution_note(r)


def _repeats_file(tmp_path, spread_off: float):
    """A results.json judged against the mean of two repeats ``spread_off`` apart, as the orchestrator writes it."""
    from tests.test_verify import consistent

    run = consistent()
    p = run.rounds[0].phases[0]
    reps = [
        Repeat(path="/runs/a.json", loss=dict(p.loss)),
        Repeat(path="/runs/b.json", loss={s: v * (1 + spread_off) for s, v in p.loss.items()}),
    ]
    ref = curves.mean_reference("/runs/a.json; /runs/b.json", reps)
    gate = loss_gate.judge_loss(p.loss, ref, 5)
    phase = p.model_copy(update={"gate": gate, "reference": ref})
    rnd = run.rounds[0].model_copy(
        update={"phases": [phase], "status": round_status([], {"train": gate})[0], "loss_mre": gate.mre, "loss_aligned": gate.aligned}
    )
    path = tmp_path / f"repeats-{spread_off}.json"
    path.write_text(json.dumps(run.model_copy(update={"rounds": [rnd]}).dump()))
    return path, gate


def test_verify_recomputes_a_repeats_gate_from_the_file_alone(tmp_path):
    from run_benchmarks import typed_results as tr
    from run_benchmarks.judging import results, verify

    wide, gate = _repeats_file(tmp_path, 0.05)
    assert gate.verdict == "not judged" and gate.reason.startswith("reference repeats differ by 5.00% among themselves")
    assert list(verify.run([wide])) == [(0, f"{wide}: every figure of 1 round(s) matches its records")]
    back = tr.load(wide)
    assert back.rounds[0].status == "unjudged" and back.rounds[0].phases[0].reference.spread == pytest.approx(0.05)
    assert "not judged: reference repeats differ by 5.00%" in results.markdown(back)
    narrow, gate = _repeats_file(tmp_path, 0.01)
    assert gate.verdict == "aligned" and gate.reason.endswith("against the mean of 2 runs (their spread 1.00%)")
    assert "aligned (0.50%, 0.5 x noise; mean of 2 runs, spread 1.00%)" in results.markdown(tr.load(narrow))

    def edited(path, edit, name):
        data = json.loads(path.read_text())
        edit(data["rounds"][0]["phases"][0])
        out = tmp_path / name
        out.write_text(json.dumps(data))
        return [line for code, line in verify.run([out]) if code == 1]

    # a spread claimed below 2 % to get a verdict: the repeats say otherwise, and so does the recomputed verdict
    lines = edited(wide, lambda p: (p["reference"].update(spread=0.01), p["gate"].update(verdict="aligned")), "spread.json")
    assert any(
        ln.startswith(f"{tmp_path / 'spread.json'}: round 1 phase train: reference spread recorded 0.01, recomputed 0.05") for ln in lines
    )
    assert any("loss gate verdict recorded 'aligned', recomputed 'not judged'" in ln for ln in lines), lines
    # a repeat's curve edited: its mean and spread no longer match what was recorded
    lines = edited(narrow, lambda p: p["reference"]["repeats"][1]["loss"].update({"22": 9.0}), "repeat.json")
    assert any("reference loss (the mean of its repeats) recorded" in ln for ln in lines), lines
    assert any("reference spread recorded" in ln for ln in lines), lines
    # a spread on a one-curve reference is no spread
    lines = edited(narrow, lambda p: p["reference"].update(repeats=[], spread=0.01), "single.json")
    assert any("reference spread recorded 0.01, recomputed None" in ln for ln in lines), lines


def _dry(*refs):
    import subprocess
    import sys

    argv = [
        sys.executable,
        str(ROOT / "run_benchmarks" / "start_task.py"),
        "--vendor",
        "cpu",
        "--case_name",
        "llama3_tiny:megatron:cpu:1:2",
    ]
    argv += ["--dry-run", "--json", *(a for r in refs for a in ("--reference", str(r)))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_repeated_reference_on_the_command_line(tmp_path):
    """--reference given twice: both files in the plan; a curve of another phase, or one lacking
    compared steps, is bad input naming the file, before anything runs."""
    from tests.test_results_models import fake_phase, fake_run

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(fake_run().dump()))
    b.write_text(json.dumps(fake_run([{"phases": [fake_phase(loss_scale=1.01)]}]).dump()))
    ok = _dry(a, b)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["reference"] == [str(a), str(b)] and "cannot be resolved" not in ok.stderr  # 1 % apart
    wide = tmp_path / "wide.json"  # 3 % from a: the plan says, before anything runs, what the pair can judge
    wide.write_text(json.dumps(fake_run([{"phases": [fake_phase(loss_scale=1.03)]}]).dump()))
    said = _dry(a, wide)
    assert said.returncode == 0, said.stderr
    assert "reference (train): its 2 repeats differ by 3.00% among themselves, so the 2% rule cannot be resolved: " in said.stderr
    assert "a run more than 6.00% from their mean is not aligned, one within that is not judged" in said.stderr
    other_phase = tmp_path / "sft.json"
    other_phase.write_text(json.dumps({"model": "llama3_tiny", "phase": "sft", "steps": list(range(1, 31)), "loss": [5.0] * 30}))
    short = tmp_path / "short.json"
    short.write_text(json.dumps(fake_run([{"phases": [fake_phase(steps=27)]}]).dump()))
    other_model = tmp_path / "gpt.json"
    other_model.write_text(json.dumps({"model": "gpt3_tiny", "steps": list(range(1, 31)), "loss": [5.0] * 30}))
    for files, message in (
        ((a, other_phase), f"--reference {other_phase}: a curve of phase 'sft', compared with phase 'train'"),
        ((a, short), f"--reference {short}: steps 28-30 missing, which another repeat has"),
        ((other_model, a), f"--reference {other_model}: a curve of 'gpt3_tiny', not of 'llama3_tiny'"),
    ):
        proc = _dry(*files)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_record_a_reference_from_repeats(tmp_path):
    """--record-reference RUN_A RUN_B RUN_C: the mean curve with the runs, their provenance and spread,
    read back as such, at the model's recipe's path; runs of another recipe are refused by name, a
    curve that is not its repeats' mean too; a reference is replaced only with --replace and a why."""
    from run_benchmarks.errors import InputError
    from run_benchmarks.planning.registry import ROOT
    from tests.test_results_models import fake_phase, fake_run

    data = {"train": {"kind": "real", "format": "megatron", "fingerprint": "0123456789abcdef"}}  # a data set of its own: no committed curve
    paths = []
    for i, scale in enumerate((1.0, 1.01, 1.02)):
        config = "config_cpux1x2_TP2" if i == 2 else "config_cpux1x2"  # layouts may differ: one reference judges them all
        run = fake_run([{"phases": [fake_phase(loss_scale=scale)]}], run_id=f"run{i}", config_name=config).model_copy(update={"data": data})
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run.dump()))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(fake_run().model_copy(update={"data": data, "recipe": "short"}).dump()))
    with pytest.raises(InputError, match=rf"^{other}: recipe 'short', but 'standard' in {paths[0]}"):
        recording.record([paths[0], other], "")
    target = ROOT / "cases/llama3/megatron/reference/llama3_tiny/standard.data-0123456789abcdef.json"

    def rounds_run(name: str, scales: tuple[float, ...]) -> Path:
        path = tmp_path / name
        rounds = [{"phases": [fake_phase(loss_scale=x)]} for x in scales]
        path.write_text(json.dumps(fake_run(rounds, run_id="run9").model_copy(update={"data": data}).dump()))
        return path

    # fewer than three curves that differ in rounding make no reference: a spread needs repeats
    for name, scales, distinct in (("two.json", (1.0, 1.01), 2), ("same.json", (1.0, 1.0, 1.0), 1)):
        with pytest.raises(InputError, match=rf"give {distinct} distinct curve\(s\); a reference needs at least 3 repeats"):
            recording.record([rounds_run(name, scales)], "")
    assert not target.exists()
    three = rounds_run("three-rounds.json", (1.0, 1.01, 1.02))  # one run of three rounds: the rounds are the repeats
    try:
        (line,) = recording.record([three], "")
        assert line.endswith("(phase train, recipe standard, 3 run(s), spread 1.493%, steps 1-30)"), line
        doc = json.loads(target.read_text())
        assert [r["path"] for r in doc["repeats"]] == [f"{three} (round {k})" for k in (1, 2, 3)]
        assert [(r["run_id"], r["round"], r["config"]) for r in doc["repeats"]] == [("run9", k, "config_cpux1x2") for k in (1, 2, 3)]
        assert doc["why"].startswith("the first reference of llama3_tiny's standard recipe") and doc["recipe"] == "standard"
        with pytest.raises(InputError, match="a reference of this model, recipe and data exists; --replace replaces it"):
            recording.record(paths, "")
        with pytest.raises(InputError, match="--replace needs --why TEXT"):
            recording.record(paths, "", replace=True)
        (line,) = recording.record(paths, "three runs, two layouts", replace=True)
        assert line.startswith("replaced cases/llama3/megatron/reference/llama3_tiny/standard.data-0123456789abcdef.json (phase train")
        doc = json.loads(target.read_text())
        assert [r["path"] for r in doc["repeats"]] == [str(p) for p in paths] and doc["why"] == "three runs, two layouts"
        assert [r["config"] for r in doc["repeats"]] == ["config_cpux1x2", "config_cpux1x2", "config_cpux1x2_TP2"]
        # leave one out: run0 against 1.015 -> 0.015/1.015, run1 against 1.01 -> 0, run2 against 1.005 -> 0.015/1.005
        assert doc["loss"][0] == pytest.approx(6.9 * 1.01) and doc["spread"] == pytest.approx(0.015 / 1.005)
        back = curves.read_reference(target)
        assert back.spread == doc["spread"] and len(back.repeats) == 3 and back.loss[1] == pytest.approx(6.9 * 1.01)
        doc["loss"][24] += 0.1  # the curve no longer the mean of its repeats
        target.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=rf"^{target}: step 25: loss [\d.]+, but the mean of its repeats is"):
            curves.read_reference(target)
    finally:
        target.unlink(missing_ok=True)


def test_a_curve_of_another_global_batch_judges_nothing(tmp_path):
    """A curve file that names its global batch compares only with runs of that batch: given with
    --reference it is bad input naming the file; committed for the config (baichuan2_13b's H200
    curve, made at the standard 64), a run shortened to 32 is not judged and says why."""
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning.casename import CaseName
    from run_benchmarks.planning.config import ClusterConfig

    other = tmp_path / "gb16.json"
    other.write_text(json.dumps({"model": "llama3_tiny", "global_batch": 16, "steps": list(range(1, 31)), "loss": [5.0] * 30}))
    proc = _dry(other)
    assert proc.returncode == 2 and f"{other}: a curve of global batch 16 there, 8 here" in proc.stderr, proc.stderr
    same = tmp_path / "gb8.json"
    same.write_text(json.dumps({"model": "llama3_tiny", "global_batch": 8, "steps": list(range(1, 31)), "loss": [5.0] * 30}))
    assert _dry(same).returncode == 0

    cn = CaseName.parse("baichuan2_13b:deepspeed:H200:1:4")
    short = planning.build(cn, "nvidia", ClusterConfig(), tmp_path, sets=["train.global_batch=32"])
    assert references.load_references(short) == {"train": None}
    assert short.references["train"].curve is None  # the plan holds what it found
    assert (
        references.not_judged_reason(short, "train")
        == short.references["train"].why_none
        == ("--set train.global_batch=32 changes the standard recipe: its reference judges only runs of that recipe")
    )
    assert references.other_batch_reason(short, "train") == (
        "no reference at global batch 32 (the committed curve standard.json is of global batch 64)"
    )
    standard = planning.build(cn, "nvidia", ClusterConfig(), tmp_path)
    assert references.not_judged_reason(standard, "train") is None
    (ref,) = references.load_references(standard).values()
    assert standard.references["train"].curve == ref and standard.references["train"].why_none is None
    assert ref is not None and ref.path == "cases/baichuan2/deepspeed/reference/baichuan2_13b/standard.json" and len(ref.loss) == 30

    gate = rounds.phase_gate({s: 5.0 for s in range(1, 31)}, None, 5, short.references["train"].why_none)
    assert gate.verdict == "not judged" and gate.reason.startswith("--set train.global_batch=32 changes the standard recipe")


def test_judge_again_offline_against_repeats(tmp_path):
    """start_task.py --judge RUN --reference A --reference B: the run's curves judged again against
    the repeats' mean (the recorded verdict beside), the files left as they are; repeats that
    disagree by 2 % or more judge nothing; no --reference, or one of another batch: exit 2."""
    import subprocess
    import sys

    from run_benchmarks.planning.registry import ROOT
    from tests.test_results_models import fake_phase, fake_run

    def run_file(name, scale, gb=8):
        res = fake_run([{"phases": [fake_phase(loss_scale=scale)]}])
        res.settings["train"]["global_batch"] = gb
        (tmp_path / name).write_text(json.dumps(res.dump()))
        return str(tmp_path / name)

    def judge(*argv):
        cmd = [sys.executable, str(ROOT / "run_benchmarks" / "start_task.py"), "--judge", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)

    run = run_file("run.json", 1.0)
    before = (tmp_path / "run.json").read_bytes()
    near = judge(run, "--reference", run_file("a.json", 1.0), "--reference", run_file("b.json", 1.01))
    assert near.returncode == 0, near.stderr
    out = " ".join(near.stdout.split())
    assert "aligned: MRE" in out and "against the mean of 2 runs (their spread 1.00%)" in out, out
    far = judge(run, "--reference", run_file("c.json", 1.0), "--reference", run_file("d.json", 1.05))
    assert "not judged" in far.stdout and "differ by 5.00% among themselves" in " ".join(far.stdout.split()), far.stdout
    assert (tmp_path / "run.json").read_bytes() == before
    alone = judge(run)
    assert alone.returncode == 2 and "--judge needs at least one --reference FILE" in alone.stderr
    other = run_file("gb16.json", 1.0, gb=16)
    batch = judge(run, "--reference", other)
    assert batch.returncode == 2 and f"--reference {other}: global batch 16 there, 8 here; loss curves compare" in batch.stderr, (
        batch.stderr
    )


def test_every_committed_curve_names_its_model_phase_recipe_and_global_batch():
    """A committed reference says which model, phase, recipe and global batch it was made at, sits
    where the lookup finds it (curves.committed_path), and its global batch is its recipe's:
    a run of another training is then not judged, never judged step by step against it."""
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning import registry

    files = sorted(ROOT.glob("cases/*/*/reference/*/*.json"))
    assert len(files) >= 9
    for f in files:
        doc = json.loads(f.read_text())
        case_dir = f.parents[2]
        entry = next(e for e in registry.cases().values() if e.path == case_dir)
        fp = doc["data"]["fingerprint"]
        assert f == curves.committed_path(case_dir, doc["model"], doc["recipe"], doc["phase"], fp), f
        settings = registry.standard_settings(entry.config, doc["model"], doc["recipe"])
        assert doc["global_batch"] == planning.phase_value(settings["train"], doc["phase"], "global_batch"), f
        assert doc["why"] and curves.read_reference(f, doc["phase"]).loss, f


def test_the_deviation_in_units_of_the_references_noise():
    """Beside the seed rule's verdict, the run's MRE over the repeats' spread (at least the noise
    floor); "numerics differ" on an aligned run more than NUMERICS_DIFFER_UNITS of it away."""
    reps = [Repeat(path=f"/runs/{i}.json", loss={s: 4.0 * (1 + e) for s in range(1, 31)}) for i, e in enumerate((0, 1e-5, 2e-5))]
    ref = curves.mean_reference("/runs/three", reps)
    assert ref.spread is not None and 1e-5 < ref.spread < 2e-5
    near = loss_gate.judge_loss({s: 4.0 * (1 + 1.5e-5) for s in range(1, 31)}, ref, 5)
    assert near.verdict == "aligned" and near.noise_units is not None and near.noise_units < 1 and not near.numerics_differ
    far = loss_gate.judge_loss({s: 4.0 * 1.005 for s in range(1, 31)}, ref, 5)  # 0.5 %: aligned by the 2 % rule
    assert far.verdict == "aligned" and far.numerics_differ and far.noise_units > loss_gate.NUMERICS_DIFFER_UNITS
    assert "numerics differ" in far.reason and "numerics differ" in results.loss_cell(far, ref)
    off = loss_gate.judge_loss({s: 4.0 * 1.05 for s in range(1, 31)}, ref, 5)
    assert off.verdict == "not aligned" and off.noise_units > 1000 and not off.numerics_differ  # the verdict of record stands
    one = loss_gate.judge_loss({s: 4.0 * 1.005 for s in range(1, 31)}, Reference(path="/one.json", loss=curve()), 5)
    assert one.noise_units is None and not one.numerics_differ  # one curve: its noise was never measured
    tight = [Repeat(path=f"/runs/{i}.json", loss={s: 4.0 * (1 + e) for s in range(1, 31)}) for i, e in enumerate((0, 1e-12, 2e-12))]
    floored = loss_gate.judge_loss({s: 4.0 * (1 + 3e-8) for s in range(1, 31)}, curves.mean_reference("/t", tight), 5)
    assert floored.noise_units == pytest.approx(3e-8 / loss_gate.NOISE_FLOOR, rel=1e-3)  # spread below the floor: the floor


def test_more_steps_change_the_recipe_where_the_decay_horizon_follows_them():
    steps = [{"param": "train.steps", "value": 60, "standard": 30}]
    assert references.recipe_sets(steps, "train", {"steps": 60}) == [
        "train.steps=60 (the decay horizon follows the steps: no lr_decay_steps)"
    ]
    assert references.recipe_sets(steps, "train", {"steps": 60, "lr_decay_steps": 300}) == []  # pinned: the schedule stays
    phased = [{"param": "train.phases.finetune.steps", "value": 60, "standard": 30}]
    pinned = {"phases": {"finetune": {"lr_decay_steps": 30}}}
    assert references.recipe_sets(phased, "finetune", pinned) == [] and references.recipe_sets(phased, "finetune", {}) != []
    assert references.recipe_sets([{"param": "train.micro_batch", "value": 2, "standard": 1}], "train", {}) == []
