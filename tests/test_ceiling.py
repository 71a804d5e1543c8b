"""The kernel ceiling (training/ceiling.py): the GEMM list a decoder's layout gives, the host's
reading of it (results.json's ceiling figures, the table's "of ceiling" column), and on the CPU
the real thing: ``start_task.py --ceiling`` on the tiny llama3 case, and a short run whose
results.json carries the ceiling its ranks measured before training. The DeepSpeed cases' ceilings
are tests/test_ceiling_deepspeed.py's."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import pytest

from run_benchmarks import typed_results as tr
from run_benchmarks.judging import results
from run_benchmarks.planning import registry
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.tools import ceiling as ceiling_cli
from tests.case_helpers import start_task
from training import ceiling, flops, shapes

LLAMA3_8B = dict(hidden=4096, ffn=14336, heads=32, groups=8, head_dim=128, vocab=128256)


def test_decoder_gemms_are_the_models_linear_layers_per_tp_rank():
    shape = shapes.ModelShape(
        num_layers=32, hidden_size=4096, num_heads=32, seq_length=8192, vocab_size=128256, ffn_hidden_size=14336, num_kv_groups=8
    )
    counts = flops.param_counts(shape)
    linear_per_layer = counts["per_layer"] - 2 * 4096  # without the two norms' weights
    for tp in (1, 2, 4):
        g = {x.name: x for x in ceiling.decoder_gemms(**LLAMA3_8B, tp=tp, tokens=8192)}
        assert (g["qkv"].n, g["qkv"].k) == (6144 // tp, 4096) and (g["attn_proj"].n, g["attn_proj"].k) == (4096, 4096 // tp)
        assert (g["fc1"].n, g["fc2"].k) == (2 * 14336 // tp, 14336 // tp) and g["output"].n == 128256 // tp
        assert not g["output"].per_layer and all(x.per_layer for n, x in g.items() if n != "output")
        # forward + both gradients of every product: 6 FLOPs per weight and token, the model's 6N over TP
        per_token = (32 * sum(x.flops for x in g.values() if x.per_layer) + g["output"].flops) / 8192
        assert per_token == pytest.approx(6 * (32 * linear_per_layer + counts["output"]) / tp, rel=1e-12)
    # causal attention, forward + backward: 3.5 x the forward's 2 products over the causal half
    assert ceiling.causal_attention_flops(1, 32, 8192, 128) == pytest.approx(3.5 * 4 * 32 * 8192**2 * 128 / 2)


def test_efficiency_reads_the_ceiling_from_run_meta():
    meta = {"kernel_ceiling": {"tokens_per_gpu_s": 12000.0}}
    assert ceiling.efficiency(meta, 9000.0) == (12000.0, 0.75)
    assert ceiling.efficiency(meta, None) == (12000.0, None)
    for bad in (
        None,
        {},
        {"kernel_ceiling": None},
        {"kernel_ceiling": {"tokens_per_gpu_s": 0}},
        {"kernel_ceiling": {"tokens_per_gpu_s": "fast"}},
        {"kernel_ceiling": {"tokens_per_gpu_s": True}},
    ):
        assert ceiling.efficiency(bad, 9000.0) == (None, None)


def _phase(**kw):
    gate = {"verdict": "not judged", "reason": "no reference curve"}
    return tr.PhaseResult(phase="train", steps_run=25, window={"warmup_steps": 5}, gate=gate, **kw)


def test_a_phase_takes_its_ceiling_figures_from_its_meta():
    p = _phase(tokens_per_gpu_s=9217.0, meta={"kernel_ceiling": {"tokens_per_gpu_s": 12290.0}})
    assert p.ceiling_tokens_per_gpu_s == 12290.0 and p.ceiling_efficiency == pytest.approx(9217 / 12290)
    assert results.ceiling_cell(p.ceiling_efficiency, p.ceiling_tokens_per_gpu_s) == "75.0% of 12,290"
    again = tr.PhaseResult.model_validate(p.model_dump())  # as written to and read from results.json
    assert (again.ceiling_tokens_per_gpu_s, again.ceiling_efficiency) == (p.ceiling_tokens_per_gpu_s, p.ceiling_efficiency)
    none = _phase(tokens_per_gpu_s=9217.0, meta={"model": "x"})
    assert (none.ceiling_tokens_per_gpu_s, none.ceiling_efficiency) == (None, None)
    assert results.ceiling_cell(None, None) == "-"
    # a results.json written before the ceiling existed still loads, without one
    old = tr.load(ROOT / "docs/results/runs/2026-11-26_llama3_8b_H200x2_compile.json")
    assert old.rounds[0].phases[0].ceiling_tokens_per_gpu_s is None


start = functools.partial(start_task, timeout=600)


@pytest.mark.framework("megatron")
def test_ceiling_alone_on_the_cpu(megatron_python):
    base = ("--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2", "--python", megatron_python, "--ceiling")
    proc = start(*base, "--json", "--set", "parallel.tp=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    c = json.loads(proc.stdout)
    # llama3_tiny: hidden 64, 4 heads of 16, 2 KV groups, ffn 224, vocab 1024, 2 layers, seq 128; TP2 shards
    assert (c["tp"], c["micro_batch"], c["seq_length"], c["layers"], c["device"], c["attention"]) == (2, 1, 128, 2, "cpu", "sdpa")
    assert {k: (v["m"], v["n"], v["k"]) for k, v in c["parts"].items() if k != "attention"} == {
        "qkv": (128, 64, 64),
        "attn_proj": (128, 64, 32),
        "fc1": (128, 224, 64),
        "fc2": (128, 64, 112),
        "output": (128, 512, 64),
    }
    assert c["micro_batch_s"] == pytest.approx(c["gemm_s"] + c["attention_s"])
    assert c["tokens_per_gpu_s"] == pytest.approx(128 / (c["micro_batch_s"] * 2))
    assert all(v["fwd_ms"] > 0 and v["dgrad_ms"] > 0 and v["wgrad_ms"] > 0 for k, v in c["parts"].items() if k != "attention")
    assert c["parts"]["attention"]["fwd_bwd_ms"] > 0
    assert "hold_s" not in c
    text = start(*base)
    assert text.returncode == 0 and "tokens/p/s" in text.stdout and "attention" in text.stdout, text.stdout + text.stderr
    # each part timed after 0.2 s of its own load: recorded, and said in the text
    held = start(*base, "--set", "parallel.tp=2", "--set", "train.ceiling_hold_s=0.2")
    assert held.returncode == 0 and "  timed, each part after 0.2 s of its own load" in held.stdout, held.stdout + held.stderr
    bad = start(*base, "--set", "train.ceiling_hold_s=-1")
    assert bad.returncode != 0 and "train.ceiling_hold_s must be 0 or more seconds, got -1" in bad.stdout + bad.stderr
    # options that do not apply: bad input, nothing runs
    cl = start(*base, "--cluster", "x.yaml")
    assert cl.returncode == 2 and "--cluster does not apply" in cl.stderr


@pytest.mark.framework("megatron")
def test_ceiling_alone_finds_packages_carried_on_pythonpath(megatron_python):
    """A machine's own Python with the frameworks carried on PYTHONPATH (how a GPU machine without
    a built environment runs, docs/gpu-runs.md): --ceiling finds them, as a local round does."""
    import subprocess

    info = subprocess.run(
        [
            megatron_python,
            "-c",
            "import sys, sysconfig; print(sys._base_executable, sysconfig.get_paths()['purelib'], sys.version_info[:2])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    base, site, version = info.stdout.split(maxsplit=2)
    if version.strip() != str(sys.version_info[:2]):  # the harness reads PYTHONPATH too: one Python version for both
        pytest.skip(f"the megatron environment is Python {version.strip()}, this one {sys.version_info[:2]}")
    argv = ("--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:1", "--python", base, "--ceiling", "--json")
    proc = start(*argv, PYTHONPATH=site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["tokens_per_gpu_s"] > 0


def test_a_held_part_is_timed_after_its_own_load():
    """train.ceiling_hold_s: a part's kernels run back to back for about that long (three trials of
    enough calls) between a first timing, which gives the seconds per call, and the one kept."""
    calls = []

    def timed(n):
        calls.append(n)
        return {"fwd_s": 0.001, "dgrad_s": 0.002} if len(calls) < 3 else {"fwd_s": 0.003, "dgrad_s": 0.004}

    assert ceiling.held(timed, 5, 0.0) == {"fwd_s": 0.001, "dgrad_s": 0.002} and calls == [5]
    calls.clear()
    assert ceiling.held(timed, 5, 3.0) == {"fwd_s": 0.003, "dgrad_s": 0.004}
    assert calls == [5, 500, 5]  # 3 s over 3 trials at the slowest product's 2 ms: 500 calls a trial
    calls.clear()
    assert ceiling.held(lambda n: calls.append(n) or 0.5, 5, 1.0) == 0.5 and calls == [5, 5, 5]  # never fewer than repeat


def test_the_ceiling_table_shows_the_clock_each_part_was_timed_at():
    """A ceiling measured on one H200 (2026-11-27, docs/results/probes): each part's SM clock and
    their median in --ceiling's text; a ceiling without clocks (the CPU) shows none."""
    probe = ROOT / "docs/results/probes/2026-11-27_h200x1_ceiling-clocks/llama3_8b_H200x2_ceiling-1.json"
    c = json.loads(probe.read_text())
    text = ceiling_cli.table(c, "llama3_8b:megatron:H200:1:2", 989e12, 6 * 7.5e9)
    assert "  SM clock as the parts were timed: median 1,778 MHz" in text
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines()[5:]}
    assert rows == {"qkv": "1,980", "attn_proj": "1,980", "fc1": "1,575", "fc2": "1,530", "output": "1,440", "attention": "1,980"}
    held = ceiling_cli.table({**c, "hold_s": 2.0}, "llama3_8b:megatron:H200:1:2", 989e12, 6 * 7.5e9)
    assert "  SM clock as the parts were timed: median 1,778 MHz, each part after 2 s of its own load" in held
    for part in c["parts"].values():
        del part["sm_clock_mhz"]
    del c["sm_clock_mhz"]
    assert "SM" not in ceiling_cli.table(c, "llama3_8b:megatron:H200:1:2", 989e12, 6 * 7.5e9)


def test_a_case_that_measures_no_ceiling_is_refused(monkeypatch, capsys):
    """A case.yaml without ``ceiling: true`` (every case here has it now: one read with the
    flag off): bad input, nothing runs."""
    found = registry.find_case

    def without_ceiling(cn, *args):
        entry = found(cn, *args)
        return dataclasses.replace(entry, config=entry.config.model_copy(update={"ceiling": False}))

    monkeypatch.setattr(registry, "find_case", without_ceiling)
    assert ceiling_cli.main(["--vendor", "cpu", "--case_name", "gpt3_tiny:paddle:cpu:1:2"]) == 2
    assert "does not measure a kernel ceiling (no 'ceiling: true' in its case.yaml)" in capsys.readouterr().err


@pytest.mark.framework("megatron")
def test_a_run_records_the_ceiling_its_ranks_measured(megatron_python, tmp_path):
    proc = start(
        "--vendor",
        "cpu",
        "--case_name",
        "llama3_tiny:megatron:cpu:1:2",
        "--python",
        megatron_python,
        "--log-dir",
        str(tmp_path),
        "--set",
        "train.steps=7",
    )
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    res = tr.load(run_dir / "results.json")
    (p,) = res.rounds[0].phases
    assert p.steps_run == 7, proc.stdout + proc.stderr
    c = p.meta["kernel_ceiling"]
    assert c["tp"] == 1 and c["device"] == "cpu" and c["tokens_per_gpu_s"] > 0
    assert p.ceiling_tokens_per_gpu_s == c["tokens_per_gpu_s"] and p.ceiling_efficiency == pytest.approx(
        p.tokens_per_gpu_s / c["tokens_per_gpu_s"]
    )
    raw = json.loads((run_dir / "results.json").read_text())["rounds"][0]["phases"][0]
    assert raw["ceiling_efficiency"] == pytest.approx(p.ceiling_efficiency)  # written, not only derived on reading
    assert "of ceiling" in (run_dir / "results.md").read_text()


def test_a_ceiling_below_the_runs_own_throughput_is_a_failed_measurement():
    """A loaded CPU timed a "ceiling" of 216 tokens/p/s under a run of 4,435: never "2053.4 % of 216"."""
    p = _phase(tokens_per_gpu_s=4435.0, meta={"kernel_ceiling": {"tokens_per_gpu_s": 216.0}})
    cell = results.ceiling_cell(p.ceiling_efficiency, p.ceiling_tokens_per_gpu_s)
    assert cell.startswith("failed: ceiling 216 below the run's own throughput") and "%" not in cell
