"""start_task.py --compare: a vendor's run against a reference run, phase by phase, in the
terminal, in Markdown and in an HTML page checked in headless Chromium (as the nightly report
is); and --record-reference's refusals."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from run_benchmarks.planning.registry import ROOT
from tests.case_helpers import start_task
from tests.test_report_browser import assert_loads_offline_with_plots, load_page
from tests.test_results_models import fake_phase, fake_run

LLAVA = "llava_tiny:deepspeed:cpu:1:2"


start = functools.partial(start_task, timeout=120)


def two_phase_run(
    path: Path,
    vendor: str,
    hardware_tps: tuple[float, float],
    loss_scale: float,
    *,
    tp: int = 1,
    data: dict | None = None,
    mem: float = 0.4,
    status: str = "ok",
) -> Path:
    phases = [
        fake_phase("pretrain", tps=hardware_tps[0], loss_scale=loss_scale, mem=mem),
        fake_phase("finetune", tps=hardware_tps[1], loss_scale=loss_scale, mem=mem),
    ]
    run = fake_run([{"status": status, "phases": phases}], run_id=f"llava_tiny_{vendor}", vendor=vendor, case=LLAVA)
    run = run.model_copy(
        update={"model": "llava_tiny", "data": data, "settings": {**run.settings, "parallel": {"tp": tp, "zero": {"stage": 2}}}}
    )
    path.write_text(json.dumps(run.dump()))
    return path


def test_compare_two_runs_table_markdown_and_page(tmp_path):
    vendor = two_phase_run(tmp_path / "vendor.json", "iluvatar", (1500.0, 900.0), 1.01, tp=2, mem=0.6)
    nvidia = two_phase_run(tmp_path / "nvidia.json", "nvidia", (1000.0, 1000.0), 1.0)
    out = tmp_path / "cmp"
    proc = start("--compare", str(vendor), str(nvidia), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (out / "compare.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| pretrain") or line.startswith("| finetune")]
    run, ref = (
        "run 1: iluvatar cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic",
        "reference: nvidia cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic",
    )
    assert rows == [
        f"| pretrain | {run} | PP1DP2TP1 | 1,500.0 | - | 1.500 | 1.5% | 1.2% | 0.60 | - | - | - | - | 1.00% | steps 21-30 | ok |",
        f"| pretrain | {ref} | PP1DP2TP1 | 1,000.0 | - | reference | 1.0% | 0.8% | 0.40 | - | - | - | - | reference |  | reference run (its own rounds: ok) |",
        f"| finetune | {run} | PP1DP2TP1 | 900.0 | - | 0.900 | 0.9% | 0.8% | 0.60 | - | - | - | - | 1.00% | steps 21-30 | ok |",
        f"| finetune | {ref} | PP1DP2TP1 | 1,000.0 | - | reference | 1.0% | 0.8% | 0.40 | - | - | - | - | reference |  | reference run (its own rounds: ok) |",
    ]
    assert "| vendor | iluvatar | nvidia |" in md and "| parallel.tp | 2 | 1 |" in md
    assert "1.500" in proc.stdout and "settings that differ" in proc.stdout  # the same table in the terminal
    assert proc.stdout.strip().splitlines()[-1] == f"comparison: {out / 'compare.md'}, {out / 'compare.html'}"
    page = load_page(out / "compare.html", tmp_path / "profile")
    assert_loads_offline_with_plots(page, plots=6)  # per phase: the loss overlaid, the difference, tokens/p/s
    assert page["title"] == "flagbench compare llava_tiny" and page["tables"] == 3  # runs' data, figures, settings
    assert run in page["text"] and "parallel.tp" in page["text"]


def test_compare_other_data_and_bad_input(tmp_path):
    real = {ph: {"kind": "real", "format": "llava", "fingerprint": f"{ph}0123456789ab"[:16]} for ph in ("pretrain", "finetune")}
    vendor = two_phase_run(tmp_path / "vendor.json", "iluvatar", (1500.0, 900.0), 1.3, data=real)
    nvidia = two_phase_run(tmp_path / "nvidia.json", "nvidia", (1000.0, 1000.0), 1.0)
    proc = start("--compare", str(vendor), str(nvidia), "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert (
        "| pretrain | run 1: iluvatar cpu x2 config_cpux1x2 PP1DP2TP1, data pretrain01234567/finetune01234567 | PP1DP2TP1 | 1,500.0 | - | "
        "1.500 | 1.5% | 1.2% | 0.40 | - | - | - | - | - | other data (pretrain01234567 vs synthetic): loss not compared | ok |" in md
    )  # no MRE across data sets
    failed = two_phase_run(tmp_path / "failed.json", "nvidia", (1000.0, 1000.0), 1.0, status="failed")
    bad = start("--compare", str(vendor), str(failed), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"error: {failed}: no round ran clean (ok or unjudged): round 1 failed; its figures are no results"
    )
    # a run its own loss gate made invalid: no result unless asked for, then shown and marked
    phases = [fake_phase(ph, tps=1200.0, verdict="not aligned", mre=0.031) for ph in ("pretrain", "finetune")]
    run = fake_run([{"status": "invalid", "phases": phases}], run_id="llava_tiny_invalid", vendor="nvidia", case=LLAVA)
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps(run.model_copy(update={"model": "llava_tiny"}).dump()))
    refused = start("--compare", str(invalid), str(nvidia), "--out", str(tmp_path / "z"))
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "round 1 invalid; its figures are no results (--with-invalid shows a run whose loss gate failed, marked so)"
    )
    shown = start("--compare", str(invalid), str(nvidia), "--with-invalid", "--out", str(tmp_path / "w"))
    assert shown.returncode == 0, shown.stderr
    md = (tmp_path / "w" / "compare.md").read_text()
    assert "| 1,200.0 | - | 1.200 |" in md and md.count("| invalid (MRE) |") == 2 and "(1 round(s) that ran through)" in md
    assert "those its own loss gate made invalid included (status says which)" in md
    one = start("--compare", str(vendor))
    assert one.returncode == 2 and "--compare needs at least two results.json files" in one.stderr
    other_model = fake_run()
    (tmp_path / "llama.json").write_text(json.dumps(other_model.dump()))
    mixed = start("--compare", str(tmp_path / "llama.json"), str(nvidia), "--out", str(tmp_path / "y"))
    assert mixed.returncode == 2 and "runs of different models (llama3_tiny, llava_tiny)" in mixed.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_record_reference_refuses_what_cannot_judge(tmp_path):
    failed = two_phase_run(tmp_path / "failed.json", "nvidia", (1000.0, 1000.0), 1.0, status="failed")
    proc = start("--record-reference", str(failed))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {failed}: no round ran through (ok, unjudged or invalid by its own gate): round 1 failed; a failed round is no reference"
    )
    short = fake_run([{"phases": [fake_phase(steps=20)]}])
    (tmp_path / "short.json").write_text(json.dumps(short.dump()))
    proc = start("--record-reference", str(tmp_path / "short.json"))
    assert proc.returncode == 2 and "0 step(s) from step 21 on (none); the loss gate compares at least 5" in proc.stderr
    unchecked = fake_run().model_copy(
        update={"data": {"train": {"kind": "real", "checked": False, "fingerprint": None, "reason": "data_dir is not on this machine"}}}
    )
    (tmp_path / "unchecked.json").write_text(json.dumps(unchecked.dump()))
    proc = start("--record-reference", str(tmp_path / "unchecked.json"))
    assert proc.returncode == 2 and "its data has no fingerprint (data_dir is not on this machine)" in proc.stderr
    # the committed synthetic curve is not replaced unasked
    synthetic = fake_run()
    (tmp_path / "synthetic.json").write_text(json.dumps(synthetic.dump()))
    proc = start("--record-reference", str(tmp_path / "synthetic.json"))
    target = "cases/llama3/megatron/reference/llama3_tiny/standard.json"
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"error: {target}: a reference of this model, recipe and data exists; --replace replaces it"
    )


def test_recorded_curves_name_their_phases_global_batch(tmp_path):
    """Each phase's curve records that phase's global batch (llava: pretrain and finetune train
    at their own), which the gate checks a run against."""
    fp = "feedc0de00000001"
    data = {ph: {"kind": "real", "checked": True, "fingerprint": fp} for ph in ("pretrain", "finetune")}
    paths = [
        two_phase_run(tmp_path / f"run{k}.json", "cpu", (1000.0, 1000.0), scale, data=data) for k, scale in enumerate((1.0, 1.001, 1.002))
    ]
    for path in paths:  # three repeats that differ in rounding, as every recorded reference has
        run = json.loads(path.read_text())
        run["settings"]["train"]["phases"] = {"pretrain": {"global_batch": 32}, "finetune": {"global_batch": 4}}
        path.write_text(json.dumps(run))
    folder = ROOT / "cases/llava/deepspeed/reference/llava_tiny"
    files = {ph: folder / f"standard.{ph}.data-{fp}.json" for ph in ("pretrain", "finetune")}
    try:
        proc = start("--record-reference", *map(str, paths))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = {ph: json.loads(f.read_text()) for ph, f in files.items()}
        assert {ph: (d["phase"], d["global_batch"]) for ph, d in got.items()} == {"pretrain": ("pretrain", 32), "finetune": ("finetune", 4)}
    finally:
        for f in files.values():
            f.unlink(missing_ok=True)


def test_compare_names_the_environment_the_ranks_recorded(tmp_path):
    """Two runs apart only by a variable of the vendor's ``recorded_env`` (an NCCL tuning
    variable): "settings that differ" names it with both values; a variable one run recorded
    unset says so, and a run that recorded no environment at all (older, or a vendor without
    ``recorded_env``) reads "(not recorded)" instead of passing for the same."""
    from run_benchmarks.judging import compare

    def run(name: str, environment: dict | None) -> Path:
        phase = fake_phase()
        if environment is not None:
            phase = phase.model_copy(update={"meta": {"environment": environment}})
        res = fake_run([{"status": "ok", "phases": [phase]}], run_id=name)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(res.dump()))
        return path

    base = {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    tuned = run("tuned", {**base, "NCCL_MAX_CTAS": "16"})
    plain = run("plain", base)
    c = compare.comparison([tuned, plain])
    assert c["differ"] == [["environment NCCL_MAX_CTAS", "16", "(unset)"]]
    c = compare.comparison([tuned, plain, run("old", None)])
    assert ["environment NCCL_MAX_CTAS", "16", "(unset)", "(not recorded)"] in c["differ"]
    assert ["environment NCCL_NVLS_ENABLE", "0", "0", "(not recorded)"] in c["differ"]
    assert compare.comparison([plain, run("same", dict(base))])["differ"] == []
