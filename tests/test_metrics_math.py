"""Metric math against the seeds' own tables."""

import pytest

from run_benchmarks import typed_results as tr
from run_benchmarks.judging import metrics
from training import flops, shapes
from training import metriclog as ml

LLAMA3_8B = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_heads=32, num_kv_groups=8, seq_length=8192, vocab_size=128256)
A100, H100, H100_FP8 = 312e12, 989e12, 1979e12

# seed 000 (llama3_8b, megatron): token/p/s and the MFU column as printed.
SEED000 = [
    ("A100 1x8 PP2DP4TP1", 3698.7, A100, 56.9),
    ("H100 1x8 PP1DP4TP2", 8103, H100, 39.3),
    ("H100 1x8 bf16+fp8 upper", 10486, H100, 50.6),
    ("H100 1x8 bf16+fp8 lower", 10486, H100_FP8, 25.4),
    ("H100 2x8 PP1DP8TP2", 7914, H100, 38.4),
    ("H100 2x8 bf16+fp8 upper", 10280, H100, 49.9),
    ("H100 2x8 bf16+fp8 lower", 10280, H100_FP8, 24.9),
    ("H100 55x8 PP1DP220TP2", 7047, H100, 34.2),
    ("A100 1x8 PP4DP2TP1", 3306.5, A100, 50.0),
    ("A100 1x8 PP2DP2TP2", 3409.2, A100, 52.4),
    ("A100 1x8 PP2DP1TP4", 3006.1, A100, 46.2),
    ("A100 1x8 PP8DP1TP1", 2690.3, A100, 41.4),
    ("A100 1x8 PP1DP1TP8", 2451.2, A100, 37.7),
    ("A100 1x8 PP4DP1TP2", 3042.7, A100, 46.8),
]
# Rows the seed itself gets wrong: 6 x 8e9 x tok/p/s / peak gives another figure.
SEED000_WRONG = {
    "H100 1x8 bf16+fp8 upper": 50.9,  # the seed prints 50.6%
    "A100 1x8 PP4DP2TP1": 50.9,  # the seed prints 50.0%
}


@pytest.mark.parametrize("row, tps, peak, printed", SEED000, ids=[r[0] for r in SEED000])
def test_seed000_mfu_column_reproduced(row, tps, peak, printed):
    got = 100 * flops.mfu(flops.flops_per_token_6n(8e9), tps, peak)
    expected = SEED000_WRONG.get(row, printed)
    assert round(got, 1) == expected, f"{row}: computed {got:.2f}%"
    if row in SEED000_WRONG:
        assert abs(got - printed) > 0.2  # the seed's figure really is off


def test_llama3_8b_counts():
    s = shapes.ModelShape(**LLAMA3_8B)
    counts = flops.param_counts(s)
    assert counts["total"] == 8_030_261_248
    assert counts["embedding"] == 128256 * 4096
    assert counts["non_embedding"] == counts["total"] - counts["embedding"]
    # PaLM's count at seq 8192: 57.9 GFLOP/token, the figure NVIDIA publishes for NeMo
    assert round(flops.flops_per_token_palm(s) / 1e9, 1) == 57.9
    assert flops.decoder_flops({"params_nominal": 8e9, "shape": LLAMA3_8B})["flops_per_token_6n"] == 48e9


def test_unknown_peak_gives_no_mfu():
    assert flops.mfu(48e9, 1000.0, None) is None
    assert flops.mfu(48e9, None, 312e12) is None


def _rec(event, key, value, rank=0):
    return ml.Record(run="r", t=0.0, host="h", rank=rank, event=event, key=key, value=value)


def test_window_excludes_warmup_and_divides_by_world():
    recs = [
        _rec(ml.EV_STEP, ml.K_TRAIN_STEP, {"step": i, "loss": 1.0, "tokens": 8192, "step_time_s": 10.0 if i <= 2 else 1.0, "lr": 0})
        for i in range(1, 7)
    ]
    recs += [r for r in recs]  # duplicates from another log are ignored
    recs.append(_rec(ml.EV_STEP, ml.K_TRAIN_STEP, {"step": 7, "loss": 1.0, "tokens": 8192, "step_time_s": 9.0, "lr": 0, "profiled": True}))
    steps = metrics.step_records(ml.ParsedLog(recs, []), "train")
    assert [s.step for s in steps] == list(range(1, 8)) and steps[-1].profiled
    counts = {"flops_per_token_6n": 48e9, "flops_per_token_palm": 57.9e9}
    m = metrics.figures(steps, warmup_steps=2, world_size=2, counts=counts, peak_flops=312e12)
    assert m["window"].model_dump() == {"first_step": 3, "last_step": 6, "steps": 4, "warmup_steps": 2, "excluded": [7]}
    assert m["tokens_per_gpu_s"] == pytest.approx(8192 / 2)  # the profiled step 7 is not in the window
    assert m["mfu_6n"] == pytest.approx(48e9 * 4096 / 312e12)
    assert m["steps_run"] == 7
    # every window step ran at 4096 tokens/p/s: no spread (the warm-up's and the profiled step's times are not in it)
    assert m["throughput_spread"].model_dump() == {"steps": 4, "median": 4096, "p10": 4096, "p90": 4096, "min": 4096, "max": 4096}


def test_spread_of_the_window_steps():
    # per-step tokens/p/s 100, 200, ..., 1000 (one GPU): percentiles linear between the ordered steps
    sp = metrics.spread([100.0 * i for i in (3, 1, 10, 2, 9, 4, 8, 5, 7, 6)])
    assert (sp.steps, sp.min, sp.max, sp.median) == (10, 100, 1000, 550)
    assert (sp.p10, sp.p90) == (pytest.approx(190), pytest.approx(910))  # 100 + 0.9 * 100, 900 + 0.1 * 100
    one = metrics.spread([5.0])
    assert (one.p10, one.median, one.p90) == (5.0, 5.0, 5.0)
    assert metrics.spread([]) is None
    # a step's own throughput is its tokens over its time, per GPU: a long step with many tokens is not slow
    steps = [
        tr.Step(step=i, t=float(i), loss=1.0, tokens=tok, step_time_s=sec, lr=0.0)
        for i, (tok, sec) in enumerate([(100, 1.0), (300, 1.0), (200, 2.0), (400, 1.0)], start=1)
    ]
    m = metrics.figures(
        steps, warmup_steps=1, world_size=2, counts={"flops_per_token_6n": 1.0, "flops_per_token_palm": 1.0}, peak_flops=None
    )
    assert m["tokens_per_gpu_s"] == pytest.approx(900 / 4 / 2)  # the window's tokens over its time
    assert (m["throughput_spread"].min, m["throughput_spread"].median, m["throughput_spread"].max) == (50, 150, 200)


def test_memory_takes_peak_over_ranks():
    parsed = ml.ParsedLog(
        [
            _rec(ml.EV_MEMORY, ml.K_PEAK_MEMORY, {"peak_bytes": 2 * metrics.GIB, "total_bytes": 80 * metrics.GIB, "device": "cuda:0"}, 0),
            _rec(ml.EV_MEMORY, ml.K_PEAK_MEMORY, {"peak_bytes": 3 * metrics.GIB, "total_bytes": 80 * metrics.GIB, "device": "cuda:1"}, 1),
        ],
        [],
    )
    mem = metrics.memory_summary(parsed)
    assert mem["peak_mem_gib"] == 3 and mem["total_mem_gib"] == 80
