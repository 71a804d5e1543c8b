"""The regression verdict: rolling baseline, tolerances, failures, 'baseline: none'.

Unit tests on figures built here; test_nightly_real.py checks the same on real runs.
"""

from __future__ import annotations

import pytest

from run_benchmarks.nightly import history
from run_benchmarks.nightly.driver import judge
from run_benchmarks.nightly.runlist import Tolerances
from tests.test_history import HW, fake_results, store

TOL = Tolerances(throughput_drop_pct=10, mfu_drop_pct=10, memory_rise_pct=10)


def stats(tps: float | None, mem: float | None = 1.0, mfu: float | None = None, phase: str = "train") -> dict:
    def s(x: float | None) -> dict:
        return {"n": 0 if x is None else 1, "median": x}

    return {phase: {"tokens_per_gpu_s": s(tps), "mfu_6n": s(mfu), "mfu_palm": s(None), "peak_mem_gib": s(mem)}}


def verdict(now: dict, baseline: list[dict], failed: int = 0, not_aligned: dict | None = None, error: str | None = None):
    return judge("llama3_tiny:megatron:cpu:1:2 on cpu (config_cpux1x2)", now, 3, failed, not_aligned or {}, error, baseline, TOL)


def test_no_baseline_is_not_a_failure():
    v = verdict(stats(1.0), [])
    assert v.status == "baseline: none" and v.findings == [] and v.baseline_runs == 0


def test_baseline_is_the_median_of_the_runs_medians():
    v = verdict(stats(100.0), [stats(100.0), stats(300.0), stats(104.0)])
    assert v.baseline["train"]["tokens_per_gpu_s"] == 104.0 and v.status == "pass"


def test_within_tolerance_passes_and_beyond_regresses():
    base = [stats(1000.0), stats(1000.0)]
    assert verdict(stats(901.0), base).status == "pass"  # -9.9 %
    v = verdict(stats(850.0), base)  # -15 %
    assert v.status == "regressed"
    (f,) = v.findings
    assert f["metric"] == "tokens/p/s" and f["baseline"] == 1000.0 and f["now"] == 850.0
    assert f["change"] == pytest.approx(-0.15)
    assert "llama3_tiny:megatron:cpu:1:2" in f["message"] and "850 vs baseline 1000" in f["message"] and "-15.0%" in f["message"]
    assert verdict(stats(2000.0), base).status == "pass"  # faster is never a regression


def test_mfu_drop_and_memory_rise():
    base = [stats(1000.0, mem=10.0, mfu=0.40)]
    v = verdict(stats(1000.0, mem=11.5, mfu=0.30), base)
    assert {f["metric"] for f in v.findings} == {"MFU-6N", "peak memory (GiB)"}
    assert any("30.00% vs baseline 40.00%" in f["message"] for f in v.findings)
    assert verdict(stats(1000.0, mem=9.0, mfu=0.40), base).status == "pass"  # less memory is fine


def test_a_slower_night_names_the_gpus_clock_beside_its_baseline():
    def clocked(tps: float, mhz: float | None) -> dict:
        st = stats(tps)
        st["train"]["sm_clock_mhz"] = {"n": 1, "median": mhz}
        return st

    base = [clocked(1000.0, 1530.0), clocked(1000.0, 1530.0)]
    (f,) = verdict(clocked(850.0, 1420.0), base).findings
    assert f["message"].endswith("tolerance -10%; the GPUs' SM clock 1,420 MHz vs 1,530 in the baseline (-7.2%)")
    # a clock recorded on one side only (a baseline from before clocks were sampled): nothing said
    (f,) = verdict(clocked(850.0, 1420.0), [stats(1000.0), stats(1000.0)]).findings
    assert f["message"].endswith("tolerance -10%")
    (f,) = verdict(clocked(850.0, None), base).findings
    assert "SM clock" not in f["message"]
    # memory findings carry no clock
    v = verdict({"train": {**clocked(1000.0, 1000.0)["train"], "peak_mem_gib": {"n": 1, "median": 2.0}}}, base)
    assert [x["metric"] for x in v.findings] == ["peak memory (GiB)"] and "SM clock" not in v.findings[0]["message"]


def test_unknown_figures_are_not_compared():
    v = verdict(stats(1000.0, mem=None, mfu=None), [stats(1000.0, mem=1.0, mfu=0.4)])
    assert v.status == "pass"


def test_loss_newly_failing_and_failed_rounds():
    base = [stats(1000.0)]
    v = verdict(stats(1000.0), base, not_aligned={"train": "MRE 3.00% over steps 21-30 (at least 2%)"})
    assert [f["metric"] for f in v.findings] == ["loss alignment"]
    assert v.findings[0]["message"] == (
        "llama3_tiny:megatron:cpu:1:2 on cpu (config_cpux1x2): loss no longer aligns with the reference: "
        "MRE 3.00% over steps 21-30 (at least 2%) (baseline: aligned or not judged in the last 1 good runs)"
    )
    v = verdict(stats(1000.0), base, failed=1, error="node0 (localhost): exit status 1; Traceback\nmore")
    assert [f["metric"] for f in v.findings] == ["rounds failed"]
    assert "1 of 3 round(s) failed" in v.findings[0]["message"] and "exit status 1; Traceback" in v.findings[0]["message"]
    # with no history a failed round is still a failure: it is named, the baseline is 'none'
    v = verdict(stats(None), [], failed=3, error="boom")
    assert v.status == "regressed" and "baseline: none" in v.findings[0]["message"]


def test_baseline_takes_the_last_good_runs_of_the_same_identity(tmp_path):
    db = history.connect(tmp_path / "h.sqlite")
    ident = None
    for day, tps in enumerate([500.0, 100.0, 110.0, 120.0, 130.0, 140.0, 150.0], 1):
        run = store(db, fake_results(f"llama3_tiny_megatron_cpux1x2_202601{day:02d}", [tps], started=f"2026-01-{day:02d}T00:00:00+00:00"))
        ident = history.identity_of(db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone())
    # not good (failed round, unaligned loss), other config, other vendor: never in the baseline
    store(db, fake_results("failed", [1.0, None], started="2026-01-20T00:00:00+00:00"))
    store(db, fake_results("unaligned", [2.0], aligned=False, started="2026-01-21T00:00:00+00:00"))
    store(db, fake_results("other_config", [3.0], steps=31, started="2026-01-22T00:00:00+00:00"))
    store(db, fake_results("other_vendor", [4.0], vendor="nvidia", started="2026-01-23T00:00:00+00:00"))
    rows = history.baseline_runs(db, ident, 5)
    assert [history.stats_of(db, r["id"])["train"]["tokens_per_gpu_s"]["median"] for r in rows] == [150.0, 140.0, 130.0, 120.0, 110.0]
    assert ident["hardware_key"] == HW
    v = verdict(stats(100.0), [history.stats_of(db, r["id"]) for r in rows])
    assert v.baseline["train"]["tokens_per_gpu_s"] == 130.0 and v.status == "regressed"  # -23 % against the last five


def test_each_phase_has_its_own_baseline_and_findings():
    """llava: the finetune phase alone slows down; the finding names it, the pretrain phase passes."""

    def two(pre: float, fine: float) -> dict:
        return {**stats(pre, phase="pretrain"), **stats(fine, phase="finetune")}

    v = verdict(two(1000.0, 500.0), [two(1000.0, 1000.0), two(1010.0, 990.0)], not_aligned={"finetune": "MRE 5.00%"})
    assert v.baseline["finetune"]["tokens_per_gpu_s"] == 995.0 and v.baseline["pretrain"]["tokens_per_gpu_s"] == 1005.0
    assert [(f["metric"], f.get("phase")) for f in v.findings] == [("loss alignment", "finetune"), ("tokens/p/s", "finetune")]
    assert v.findings[1]["message"].startswith(
        "llama3_tiny:megatron:cpu:1:2 on cpu (config_cpux1x2) phase finetune: tokens/p/s median 500 vs baseline 995"
    )


def test_a_slower_night_at_its_memory_limit_says_the_allocator_retried():
    """A night whose allocator gave its cache back for want of a free block names how often beside
    a speed finding (and the baseline's count, or that the baseline recorded none); a night
    without retries, or with none recorded, says nothing of it."""

    def with_retries(tps: float, retries: float | None, mhz: float | None = None) -> dict:
        st = stats(tps)
        st["train"]["alloc_retries"] = {"n": 1, "median": retries}
        st["train"]["sm_clock_mhz"] = {"n": 1, "median": mhz}
        return st

    base = [with_retries(1000.0, 0.0, 1530.0), with_retries(1000.0, 0.0, 1530.0)]
    (f,) = verdict(with_retries(850.0, 12.0, 1530.0), base).findings
    assert f["message"].endswith(
        "; the GPUs' SM clock 1,530 MHz vs 1,530 in the baseline (+0.0%); the allocator gave its cache back 12 time(s) for want of a free block (baseline: 0)"
    )
    (f,) = verdict(with_retries(850.0, 3.0), [stats(1000.0), stats(1000.0)]).findings
    assert f["message"].endswith(
        "tolerance -10%; the allocator gave its cache back 3 time(s) for want of a free block (baseline: not recorded)"
    )
    for quiet in (0.0, None):
        (f,) = verdict(with_retries(850.0, quiet), base).findings
        assert "allocator" not in f["message"]


def test_a_finding_names_the_environment_set_otherwise_than_in_the_baseline(tmp_path):
    """The baseline is matched on the config and its settings; a variable of the vendor's
    ``recorded_env`` (NCCL tuning and the like) is neither, so a slower night names the recorded
    variables set otherwise than in the latest baseline run, read from the history; nothing is
    said where they agree or where either run recorded none."""
    from run_benchmarks.typed_results import environment_changes, recorded_environment

    def recorded(run_id: str, env: dict | None):
        res = fake_results(run_id, [100.0])
        if env is not None:
            res.rounds[0].phases[0] = res.rounds[0].phases[0].model_copy(update={"meta": {"environment": env}})
        return res

    db = history.connect(tmp_path / "h.sqlite")
    base_env = {"NCCL_NVLS_ENABLE": "0"}
    run = store(db, recorded("base", base_env))
    (latest,) = history.baseline_runs(db, history.identity_of(db.execute("SELECT * FROM runs WHERE id = ?", (run,)).fetchone()), 3)
    tonight = recorded_environment(recorded("now", {"NCCL_NVLS_ENABLE": "0", "NCCL_MAX_CTAS": "8"}).rounds)
    changes = environment_changes(tonight, history.environment_of(latest))
    assert changes == [("NCCL_MAX_CTAS", "8", None)]
    base = [stats(1000.0), stats(1000.0)]
    judged = lambda env: judge("llama3_tiny:megatron:cpu:1:2 on cpu (config_cpux1x2)", stats(850.0), 3, 0, {}, None, base, TOL, env)
    (f,) = judged(changes).findings
    assert f["message"].endswith(
        "tolerance -10%; the ranks' environment differs from the latest baseline run's: NCCL_MAX_CTAS '8' (baseline: unset)"
    )
    assert "environment" not in judged([]).findings[0]["message"]
    assert environment_changes(recorded_environment(recorded("same", dict(base_env)).rounds), history.environment_of(latest)) == []
    assert environment_changes(None, base_env) == environment_changes(base_env, None) == []
