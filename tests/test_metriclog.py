import io
import json

import pytest

from training import metriclog as ml

META = {k: 1 for k in ml.REQUIRED_META}


def test_round_trip_with_noise():
    buf = io.StringIO()
    log = ml.MetricLogger(run="r1", rank=3, stream=buf)
    log.meta(**META)
    log.step(step=1, loss=2.5, tokens=1024, step_time_s=0.5, lr=1e-4)
    log.peak_memory(10, 20, "cpu")
    log.end("ok", 1)
    text = "torchrun noise\n" + "\n".join("[default3]:" + ln for ln in buf.getvalue().splitlines()) + "\nmore noise\n"
    parsed = ml.parse_lines(text.splitlines(), source="x.log")
    assert not parsed.errors
    assert [r.event for r in parsed.records] == ["meta", "step", "memory", "end"]
    step = parsed.of(ml.EV_STEP)[0]
    assert step.rank == 3 and step.run == "r1" and step.value["loss"] == 2.5
    assert step.caller.startswith("test_metriclog.py:")


def test_bad_lines_are_errors_not_exceptions():
    lines = [
        ml.PREFIX + " {not json",
        ml.PREFIX + " " + json.dumps({"v": 2, "event": "step", "key": "train_step", "value": {}, "rank": 0}),
        ml.PREFIX + " " + json.dumps({"v": 1, "event": "step", "key": "train_step", "value": {"step": 1}, "rank": 0}),
        ml.PREFIX + " " + json.dumps({"v": 1, "event": "bogus", "key": "k", "value": 1, "rank": 0}),
        ml.PREFIX + " " + json.dumps({"v": 1, "event": "meta", "key": "run_meta", "value": {"model": "x"}, "rank": 0}),
        ml.PREFIX + " " + json.dumps([1, 2]),
    ]
    parsed = ml.parse_lines(lines, source="s")
    assert parsed.records == []
    reasons = [e.reason for e in parsed.errors]
    assert len(reasons) == 6
    assert reasons[0].startswith("bad JSON")
    assert "version" in reasons[1]
    assert "lacks loss" in reasons[2]
    assert "unknown event" in reasons[3]
    assert "run_meta lacks" in reasons[4]
    assert parsed.errors[0].lineno == 1


def test_emitter_refuses_incomplete_meta():
    with pytest.raises(ValueError, match="run_meta lacks"):
        ml.MetricLogger(stream=io.StringIO()).meta(model="x")


def test_peak_memory_carries_the_allocators_reserve_and_retries_where_there_are_some():
    """A rank's peak_memory line holds the cache's reserve and its retries when the framework
    reports them; the host takes the largest of each over ranks next to the allocated peak (the
    retries of a rank with none reported count for nothing), None when no rank reported it."""
    from run_benchmarks.judging import metrics

    buf = io.StringIO()
    for rank, (peak, reserved, retries) in enumerate([(100 << 30, 110 << 30, 3), (105 << 30, 108 << 30, 0), (90 << 30, 95 << 30, None)]):
        ml.MetricLogger("r", rank=rank, stream=buf).peak_memory(
            peak, 140 << 30, "NVIDIA H200", reserved_bytes=reserved, alloc_retries=retries
        )
    mem = metrics.memory_summary(ml.parse_lines(buf.getvalue().splitlines()))
    assert (mem["peak_mem_gib"], mem["reserved_mem_gib"], mem["alloc_retries"], mem["total_mem_gib"]) == (105, 110, 3, 140)
    recs = {r.rank: r.value for r in ml.parse_lines(buf.getvalue().splitlines()).of(ml.EV_MEMORY, ml.K_PEAK_MEMORY)}
    assert recs[1]["alloc_retries"] == 0 and "alloc_retries" not in recs[2]  # none is a count too; not reported is absent
    cpu = io.StringIO()
    ml.MetricLogger("r", rank=0, stream=cpu).peak_memory(1 << 30, None, "cpu")
    assert "reserved_bytes" not in cpu.getvalue() and "alloc_retries" not in cpu.getvalue()
    assert metrics.memory_summary(ml.parse_lines(cpu.getvalue().splitlines()))["reserved_mem_gib"] is None
    assert metrics.memory_summary(ml.parse_lines(cpu.getvalue().splitlines()))["alloc_retries"] is None
