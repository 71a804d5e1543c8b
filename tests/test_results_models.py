"""The typed results.json: schema 2 written and read back as it was, schema-1 files still load,
a file that is not a results.json is named with its field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from run_benchmarks import typed_results as tr
from run_benchmarks.errors import InputError
from run_benchmarks.judging import results
from run_benchmarks.planning.registry import ROOT

RUNS = sorted((ROOT / "docs" / "results" / "runs").glob("*.json"))


def fake_phase(
    phase: str = "train",
    tps: float | None = 1000.0,
    verdict: str = "aligned",
    mre: float | None = 0.01,
    steps: int = 30,
    mem: float | None = 0.4,
    loss_scale: float = 1.0,
) -> tr.PhaseResult:
    """A phase as the orchestrator writes it, with ``steps`` step records."""
    recs = [
        tr.Step(step=s, t=1000.0 + s, loss=(7.0 - 0.1 * s) * loss_scale, tokens=1024, step_time_s=1024 / 2 / tps if tps else 1.0, lr=1e-3)
        for s in range(1, steps + 1)
    ]
    return tr.PhaseResult(
        phase=phase,
        steps_run=steps,
        window=tr.Window(first_step=6, last_step=steps, steps=steps - 5, warmup_steps=5),
        tokens_per_gpu_s=tps,
        mfu_6n=None if tps is None else tps / 1e5,
        mfu_palm=None if tps is None else tps / 1.2e5,
        step_time_s=None if tps is None else 1024 / 2 / tps,
        loss_final=recs[-1].loss,
        loss={r.step: r.loss for r in recs},
        gate=tr.LossGate(
            verdict=verdict, mre=mre if verdict != "not judged" else None, reason="MRE" if verdict != "not judged" else "no reference curve"
        ),
        layout="PP1DP2TP1",
        peak_mem_gib=mem,
        steps=recs,
    )


def fake_round(n: int = 1, status: str = "ok", phases: list[tr.PhaseResult] | None = None, error: str | None = None) -> tr.RoundResult:
    phases = phases or [fake_phase()]
    one = phases[0] if len(phases) == 1 else None
    return tr.RoundResult(
        round=n,
        status=status,
        error=error if error is not None else (None if status == "ok" else f"round {n} was {status}"),
        duration_s=12.0,
        layout="PP1DP2TP1",
        tokens_per_gpu_s=one.tokens_per_gpu_s if one else None,
        peak_mem_gib=max((p.peak_mem_gib for p in phases if p.peak_mem_gib is not None), default=None),
        phases=phases,
        reference={p.phase: None for p in phases},
    )


def fake_run(
    rounds: list[dict[str, Any]] | None = None,
    run_id: str = "llama3_tiny_megatron_cpux1x2_20260101-000000-000001",
    *,
    started: str = "2026-01-01T00:00:00+00:00",
    vendor: str = "cpu",
    config_name: str = "config_cpux1x2",
    steps: int = 30,
    case: str = "llama3_tiny:megatron:cpu:1:2",
) -> tr.RunResults:
    """A results.json as the orchestrator writes it; each dict gives fake_round's arguments."""
    rnds = [fake_round(i, **r) for i, r in enumerate(rounds or [{}], 1)]
    phases = [p.phase for p in rnds[0].phases]
    return tr.RunResults(
        run_id=run_id,
        case=f"{case}:{len(rnds)}",
        model=case.split(":")[0],
        framework=case.split(":")[1],
        vendor=vendor,
        hardware="cpu",
        nnodes=1,
        nprocs=2,
        world_size=2,
        config_name=config_name,
        config_file=f"vendors/{vendor}/{config_name}.yaml",
        validated=True,
        launcher="torchrun",
        backend="local",
        runtime="local",
        started=started,
        finished=started,
        system={"host": "testhost", "cpu_count": 2},
        settings={"train": {"steps": steps, "warmup_steps": 5, "precision": "fp32", "global_batch": 8}, "parallel": {"tp": 1}, "data": {}},
        overrides=[],
        user_overrides=[{"param": "train.steps", "value": steps, "standard": 30}],
        model_counts={ph: {"flops_per_token_6n": 1e9, "flops_per_token_palm": 1.2e9} for ph in phases},
        hardware_info={"chip": "cpu", "precision": "fp32", "peak_flops": None},
        rounds=rnds,
    )


def test_schema2_round_trip_keeps_every_record_and_nan(tmp_path):
    run = fake_run([{"status": "failed", "phases": [fake_phase(verdict="not aligned")]}])
    bad = run.rounds[0].phases[0].steps[6].model_copy(update={"loss": math.nan})
    phase = run.rounds[0].phases[0].model_copy(update={"steps": [*run.rounds[0].phases[0].steps[:6], bad]})
    run = run.model_copy(update={"rounds": [run.rounds[0].model_copy(update={"phases": [phase]})]})
    results.write(run, tmp_path)
    text = (tmp_path / "results.json").read_text()
    assert json.loads(text)["schema"] == 2 and "NaN" in text
    back = tr.load(tmp_path / "results.json")
    assert math.isnan(back.rounds[0].phases[0].steps[6].loss)
    assert back.model_dump(exclude={"rounds"}) == run.model_dump(exclude={"rounds"})
    assert [s.step for s in back.rounds[0].phases[0].steps] == list(range(1, 8))
    assert "failed: 1000.0" in (tmp_path / "results.md").read_text()  # a failed round's figure carries its status


RUNS_V1 = [p for p in RUNS if json.loads(p.read_text())["schema"] == 1]
RUNS_V2 = [p for p in RUNS if json.loads(p.read_text())["schema"] == 2]


@pytest.mark.parametrize("path", RUNS_V1, ids=[p.name for p in RUNS_V1])
def test_schema1_files_load(path):
    run = tr.load(path)
    raw = json.loads(path.read_text())
    assert run.schema_ == raw["schema"] == 1
    for rnd, raw_rnd in zip(run.rounds, raw["rounds"]):
        for p, raw_p in zip(rnd.phases, raw_rnd["phases"]):
            assert p.steps == []  # schema 1 kept no per-step records
            assert p.gate.mre == raw_p["loss_mre"] and p.gate.aligned == raw_p["loss_aligned"]
            assert p.gate.compared_steps == raw_p["loss_compared_steps"]
            assert p.tokens_per_gpu_s == raw_p["tokens_per_gpu_s"] and p.loss == {int(k): v for k, v in raw_p["loss"].items()}
    assert results.rows(run)  # the tables read them


@pytest.mark.parametrize("path", RUNS_V2, ids=[p.name for p in RUNS_V2])
def test_schema2_files_load_with_their_step_records(path):
    run = tr.load(path)
    raw = json.loads(path.read_text())
    assert run.schema_ == raw["schema"] == 2
    for rnd in run.rounds:
        for p in rnd.phases:
            assert len(p.steps) == p.steps_run  # every step of the phase kept
            assert p.steps_run > 0 or rnd.status == "failed"  # a round stopped before its first step ran none
            assert {s.step: s.loss for s in p.steps} == p.loss
    assert results.rows(run)


def test_what_is_not_a_results_file_is_named(tmp_path):
    good = fake_run().dump()
    cases = {
        "notjson.json": ("{", "not JSON"),
        "curve.json": (json.dumps({"steps": [1], "loss": [1.0]}), "not a results.json (no 'schema' field)"),
        "newer.json": (json.dumps({**good, "schema": 3}), "schema 3 is newer than this harness's (2)"),
        "status.json": (json.dumps({**good, "rounds": [{**good["rounds"][0], "status": "fine"}]}), "field 'rounds.0.status'"),
        "extra.json": (json.dumps({**good, "tokens": 1}), "field 'tokens': unknown field"),
    }
    for name, (text, fragment) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError) as err:
            tr.load(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: ") and fragment in str(err.value), str(err.value)
    with pytest.raises(InputError, match="cannot be read"):
        tr.load(tmp_path / "missing.json")


def test_tables_mark_rounds_that_are_not_ok():
    run = fake_run(
        [
            {},
            {"status": "unjudged", "phases": [fake_phase(verdict="not judged")]},
            {"status": "invalid", "phases": [fake_phase(verdict="not aligned", mre=0.021)]},
        ]
    )
    rows = results.rows(run)
    tps, loss, status = results.COLUMNS.index("tokens/p/s"), results.COLUMNS.index("loss"), results.COLUMNS.index("status")
    assert [r[tps] for r in rows] == ["1000.0", "unjudged: 1000.0", "invalid: 1000.0"]
    assert [r[loss] for r in rows] == ["aligned (1.00%)", "loss 4.0000; not judged: no reference curve", "NOT aligned (2.10%)"]
    assert [r[status] for r in rows] == ["ok", "unjudged: round 2 was unjudged", "invalid: round 3 was invalid"]
    mem = results.COLUMNS.index("mem in use (GiB)")
    assert rows[0][mem] == "-"  # no monitor device on a CPU
    with_gpu = fake_phase().model_copy(update={"device_mem": tr.DeviceMemory(used_gib=106.06, total_gib=140.4, scope="phase")})
    assert results.rows(fake_run([{"phases": [with_gpu]}]))[0][mem] == "106.06/140"
    spread = results.COLUMNS.index("steps p10-p90")
    assert spread == tps + 1 and rows[0][spread] == "-"  # a file made before the spread was recorded
    sp = tr.Spread(steps=20, median=9533.0, p10=9480.25, p90=9590.0, min=9400.0, max=9611.0)
    assert results.rows(fake_run([{"phases": [fake_phase().model_copy(update={"throughput_spread": sp})]}]))[0][spread] == "9,480.2-9,590.0"


def test_device_memory_per_phase_from_the_monitor():
    from run_benchmarks.judging import metrics

    def sample(t: float, used: list[float]) -> dict:
        return {"t": t, "gpus": [{"index": i, "mem_used_gib": u, "mem_total_gib": 140.0} for i, u in enumerate(used)]}

    samples = [sample(1.0, [10, 5, 120]), sample(2.0, [30, 20, 120]), sample(3.0, [60, 50, 120])]
    nodes = [(samples, {0, 1})]  # GPU 2 is another job's
    assert metrics.device_memory(nodes, (1.5, 2.5)) == tr.DeviceMemory(used_gib=30, total_gib=140, scope="phase")
    # a phase shorter than the sampling interval: the round's peak, said so
    assert metrics.device_memory(nodes, (2.2, 2.4)) == tr.DeviceMemory(used_gib=60, total_gib=140, scope="round")
    assert metrics.device_memory([([{"t": 1.0, "gpus": []}], {0})], None) is None  # a CPU run


def test_gpu_clocks_per_phase_from_the_monitor():
    """The SM clock over a phase's steps: the GPUs the run used, the samples inside the phase, the
    share of them the driver held the clock down, by reason; in results.md under the table."""
    from run_benchmarks.judging import metrics

    def sample(t: float, clocks: list[float], held: list[list[str]]) -> dict:
        gpus = [{"index": i, "sm_clock_mhz": c, "sm_clock_max_mhz": 1980.0, "clock_held": h} for i, (c, h) in enumerate(zip(clocks, held))]
        return {"t": t, "gpus": gpus}

    busy = [["power cap"], ["power cap", "thermal (driver)"], []]
    samples = [sample(1.0, [1980, 1980, 300], [[], [], []]), sample(2.0, [1700, 1750, 1980], busy), sample(3.0, [1800, 1650, 1980], busy)]
    nodes = [(samples, {0, 1})]  # GPU 2 is another job's
    c = metrics.device_clocks(nodes, (1.5, 3.5))
    assert c == tr.DeviceClocks(
        samples=4, sm_median_mhz=1725.0, sm_low_mhz=1650.0, sm_max_mhz=1980.0, held={"power cap": 1.0, "thermal (driver)": 0.5}
    )
    assert metrics.device_clocks(nodes, None) is None and metrics.device_clocks(nodes, (5.0, 6.0)) is None
    assert metrics.device_clocks([([{"t": 2.0, "gpus": [{"index": 0, "mem_used_gib": 3.0}]}], None)], (1.0, 3.0)) is None  # no clocks read
    md = results.markdown(fake_run([{"phases": [fake_phase().model_copy(update={"device_clocks": c})]}]))
    assert (
        "GPU clocks over the phase's steps (NVML):\n- round 1, phase train (4 samples): SM median 1,725 MHz (p10 1,650) of 1,980, "
        "held down by the power cap in 100% of samples, the thermal (driver) in 50% of samples" in md
    )
    assert "GPU clocks" not in results.markdown(fake_run())  # a CPU run, or a file made before clocks were sampled
    assert results.clock_cell(c) == "1,725 (power cap 100%)" and results.clock_cell(None) == "-"  # --compare's "SM MHz"
    assert results.clock_cell(c.model_copy(update={"held": {}})) == "1,725"
    timed = fake_phase().model_copy(
        update={"device_clocks": c, "meta": {"kernel_ceiling": {"tokens_per_gpu_s": 13000.0, "sm_clock_mhz": 1980.0}}}
    )
    assert "the thermal (driver) in 50% of samples; the kernel ceiling was timed at 1,980 MHz\n" in results.markdown(
        fake_run([{"phases": [timed]}])
    )
    held = timed.model_copy(update={"meta": {"kernel_ceiling": {"tokens_per_gpu_s": 12000.0, "sm_clock_mhz": 1500.0, "hold_s": 2.0}}})
    assert "the kernel ceiling was timed at 1,500 MHz, each part after 2 s of its own load" in results.markdown(
        fake_run([{"phases": [held]}])
    )


def test_energy_per_token_over_the_window_from_the_counter_or_the_power_samples():
    """Tokens per joule per device: each used GPU's mean power over the steady window (NVML's energy
    counter's rise where every GPU has one, else the mean of its power samples), tokens/p/s over the
    GPUs' mean; the power limits beside it; None for a CPU run."""
    from run_benchmarks.judging import metrics

    def sample(t, gpus):
        return {"t": t, "gpus": [{"index": i, "power_w": w, "energy_mj": e} for i, (w, e) in enumerate(gpus)]}

    # GPU 0: 500 W by its counter (1,000 J over 2 s), GPU 1: 700 W; GPU 2 another job's
    samples = [sample(0.5, [(1, 0), (1, 0), (9, 0)]), sample(1.0, [(480, 10_000), (690, 20_000), (9, 0)])]
    samples += [sample(2.0, [(520, 510_000), (710, 720_000), (9, 0)]), sample(3.0, [(300, 1_010_000), (600, 1_420_000), (9, 0)])]
    ident = {"gpus": [{"index": 0, "power_limit_w": 700.0}, {"index": 1, "power_limit_w": 700.0}, {"index": 2, "power_limit_w": 300.0}]}
    nodes = [(samples, {0, 1})]
    e = metrics.device_energy(nodes, (1.0, 3.0), 6000.0, [ident])
    assert e == tr.DeviceEnergy(
        source="energy counter", devices=2, samples=6, mean_power_w=600.0, tokens_per_joule=10.0, power_limit_w=[700.0]
    )
    # a card without a counter: the mean of its power samples inside the window
    blind = [{"t": s["t"], "gpus": [{**g, "energy_mj": None} for g in s["gpus"]]} for s in samples]
    p = metrics.device_energy([(blind, {0})], (1.0, 3.0), 5000.0, [None])
    assert p.source == "power samples" and p.mean_power_w == pytest.approx(1300 / 3) and p.power_limit_w == []
    assert metrics.device_energy(nodes, None, 6000.0) is None and metrics.device_energy(nodes, (1.0, 3.0), None) is None
    assert metrics.device_energy([([{"t": 2.0, "host": {}}], None)], (1.0, 3.0), 100.0) is None  # a CPU run
    window = tr.Window(first_step=2, last_step=3, steps=2, warmup_steps=1, excluded=[])
    steps = [tr.Step(step=k, t=float(k), step_time_s=1.0, tokens=8, loss=1.0, lr=1e-3) for k in (1, 2, 3)]
    assert metrics.window_span(steps, window) == (1.0, 3.0)
    md = results.markdown(fake_run([{"phases": [fake_phase().model_copy(update={"device_energy": e})]}]))
    assert (
        "Energy over the tokens/p/s window:\n- round 1, phase train: 10.00 tokens per joule per device: 600 W mean per device over the "
        "window (NVML's energy counter, 2 GPU(s), 6 samples), power limit 700 W" in md
    )
    assert results.energy_cell(e) == "10.00 (600 W, energy counter)" and results.energy_cell(None) == "-"
    assert "Energy over" not in results.markdown(fake_run())


def test_the_run_itself_has_a_status_and_a_cause_also_when_no_round_ran():
    from run_benchmarks.errors import InputError

    rounds = fake_run(
        [
            {"status": "ok"},
            {"status": "invalid", "error": "phase train: loss not aligned: MRE 2.10%\nmore"},
            {"status": "unjudged", "error": "phase train: loss not judged: no reference curve"},
        ]
    ).rounds
    assert tr.run_outcome(rounds[:1], None, 1) == {"status": "ok", "error": None}
    assert tr.run_outcome(rounds, None, 3) == {  # the worst round, each not-ok round's first line
        "status": "invalid",
        "error": "round 2 invalid: phase train: loss not aligned: MRE 2.10%; round 3 unjudged: phase train: loss not judged: no reference curve",
    }
    assert tr.run_outcome([], None, 2) == {"status": "failed", "error": "no round ran"}
    assert tr.run_outcome([], InputError("host h2: docker engine not answering"), 2) == {
        "status": "failed",
        "error": "stopped after 0 of 2 round(s): host h2: docker engine not answering",
    }
    assert tr.run_outcome(rounds[:1], OSError(28, "No space left on device"), 2)["error"] == (
        "stopped after 1 of 2 round(s): OSError: [Errno 28] No space left on device"
    )
    assert tr.run_outcome(rounds[:1], KeyboardInterrupt("SIGTERM"), 3) == {
        "status": "interrupted",
        "error": "interrupted by SIGTERM after 1 of 3 round(s)",
    }
    # a file written before the run ends says so, and an old file without the fields still loads
    assert fake_run().status == "running"


def test_the_terminal_table_prints_an_error_with_brackets_as_it_is():
    from rich.console import Console

    run = fake_run([{"status": "failed", "error": "rank 0: RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:553] Connection reset"}])
    console = Console(width=300, record=True)
    results.print_table(run, console)  # rich markup would refuse the closing-tag-like bracket
    assert "failed: rank 0: RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc" in console.export_text()


def test_allocator_retries_show_beside_the_allocated_peak():
    """A phase whose allocator gave its cache back for want of a free block says how often, in
    results.md's allocated cell and --compare's; none (0, or a file made before the count) says
    nothing."""
    mem = results.COLUMNS.index("mem allocated (GiB)")

    def cell(update: dict) -> str:
        return results.rows(fake_run([{"phases": [fake_phase().model_copy(update=update)]}]))[0][mem]

    assert cell({"peak_mem_gib": 131.68, "reserved_mem_gib": 135.62, "alloc_retries": 3}).endswith("(reserved 135.62, 3 allocator retries)")
    assert cell({"peak_mem_gib": 131.68, "alloc_retries": 1}).endswith("(1 allocator retry)")
    assert "retr" not in cell({"peak_mem_gib": 131.68, "reserved_mem_gib": 135.62, "alloc_retries": 0})
    assert "retr" not in cell({"peak_mem_gib": 131.68}) and fake_phase().alloc_retries is None
    assert results.allocated_cell(118.0, None, None, 2) == "118.00 (2 allocator retries)"
