"""The conformance check (training/conformance/): llama3_tiny's, baichuan2_tiny's, gpt3_tiny's and llava_tiny's
step against float64 numpy math.

Through ``flagbench conformance`` (the check alone) and through a run: each defect of
examples/defects.py that applies fails, naming the tensor; each correct alternative passes; a
run whose check fails stops before training, its round invalid (exit 1), and results.json and
results.md carry the verdict; a second check of one stack reuses the first's verdict; the
reference imports nothing of the project or the frameworks.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from run_benchmarks.planning.registry import ROOT

CASE = ["--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:1"]


def _check(*extra: str) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "run_benchmarks.cli", "conformance", *CASE, "--json", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    start = p.stdout.index("{")
    return p.returncode, json.loads(p.stdout[start:])


def _fresh_seed() -> str:
    """A seed, part of the check's key: a stack no other test has checked."""
    return str(random.SystemRandom().randrange(10**6, 10**7))


def test_the_reference_loads_numpy_alone():
    """Run as the check runs it (isolated), the reference module brings in no torch, no
    framework and no module of the project: no vendor adapter or hook can reach it."""
    code = (
        "import importlib.util, sys; "
        f"s = importlib.util.spec_from_file_location('r', {str(ROOT / 'training/conformance/reference.py')!r}); "
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in "
        "('torch', 'megatron', 'deepspeed', 'paddle', 'transformers', 'training', 'cases', 'vendors', 'examples')); "
        "print(bad)"
    )
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert p.stdout.strip() == "[]", p.stdout


DEFECTS = [
    ("attention_times_zero", "attention output"),
    ("softmax_scale_x4", "attention output"),
    ("attention_window", "attention output"),
    ("rope_base_off", "attention output"),
    ("frozen_embeddings", "gradient of embedding"),
]


def _checks(command: list[str], hooks: list[str]) -> tuple[int, list[dict]]:
    """One ``flagbench conformance`` with one ``--hook`` per hook (``module:function``; a bare
    name is one of examples/defects.py's): one process, the probes forked from it once its
    imports are made."""
    hooks = [h if ":" in h else f"examples.defects:{h}" for h in hooks]
    cmd = [*command, "--json", "--no-cache", *(a for h in hooks for a in ("--hook", h))]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    verdicts = json.loads(p.stdout[p.stdout.index("[") :])
    assert [v["hook"] for v in verdicts] == hooks, verdicts
    assert all(v["probe_start"] == "forked from the check" for v in verdicts), [v["probe_start"] for v in verdicts]
    return p.returncode, verdicts


@pytest.mark.framework("megatron")
def test_each_defect_fails_and_a_correct_hook_beside_them_passes(megatron_python):
    """Each defect fails, naming the tensor it first shows in; the math-kernel SDPA, checked in
    the same process between them, passes far inside the tolerances: each child applies its own
    hook alone, so nothing of one reaches the next."""
    hooks = [h for h, _ in DEFECTS]
    hooks.insert(2, "examples.alternatives:sdpa_math")
    rc, verdicts = _checks([sys.executable, "-m", "run_benchmarks.cli", "conformance", *CASE], hooks)
    assert rc == 1  # one check failed: the command fails
    fine = verdicts.pop(2)
    assert fine["verdict"] == "passed" and fine["worst"]["error"] < fine["worst"]["tolerance"] / 20, fine
    for (hook, tensor), v in zip(DEFECTS, verdicts):
        assert v["verdict"] == "failed", (hook, v)
        assert v["message"].startswith(tensor) and "differs" in v["message"] and "from the reference" in v["message"], (hook, v["message"])


@pytest.mark.framework("megatron")
def test_correct_alternatives_pass(megatron_python):
    """Each correct alternative setting, checked alone in one process (``--each-set``), passes far
    inside the tolerances: fp32 rounds at about 1e-6. (The math-kernel SDPA hook passes beside the
    defects, above.)"""
    sets = ["parallel.attention=local", "parallel.fused_linear_loss=chunked", "parallel.fused_rope=qkv"]
    cmd = [
        sys.executable,
        "-m",
        "run_benchmarks.cli",
        "conformance",
        *CASE,
        "--json",
        "--no-cache",
        *(a for kv in sets for a in ("--each-set", kv)),
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    verdicts = json.loads(p.stdout[p.stdout.index("[") :])
    assert [v["set"] for v in verdicts] == sets and all(v["probe_start"] == "forked from the check" for v in verdicts), verdicts
    for v in verdicts:
        assert v["verdict"] == "passed" and v["worst"]["error"] < v["worst"]["tolerance"] / 20, v
    assert len({v["key"] for v in verdicts}) == 3  # three stacks: each setting reached the probe


@pytest.mark.framework("megatron")
def test_a_stack_checked_once(megatron_python):
    """The second check of the same stack is the first's verdict; a tensor-parallel layout (the
    probe builds one process at TP1) is the same stack."""
    _check()
    rc, v = _check()
    assert rc == 0 and v["cached"] is True, v
    rc, other = _check("--set", "train.micro_batch=2")  # a layout switch the one-layer probe does not build with
    assert other["cached"] is True and other["key"] == v["key"], other


@pytest.mark.framework("megatron")
def test_a_run_that_fails_the_check_stops_before_training(tmp_path, megatron_python):
    configs = ROOT / "vendors" / "cpu" / "cases" / "llama3_tiny" / "megatron"
    config = configs / "config_cpux1x2_DEFECTfrozen.yaml"
    config.write_text(
        "description: llama3_tiny with its embedding frozen on purpose (tests/test_conformance.py)\n"
        "validated: false\nhook: examples.defects:frozen_embeddings\n"
    )
    try:
        cmd = [sys.executable, "run_benchmarks/start_task.py", "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2"]
        p = subprocess.run(
            [*cmd, "--variant", "DEFECTfrozen", "--set", f"train.seed={_fresh_seed()}", "--log-dir", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        config.unlink()
    assert p.returncode == 1, (p.stdout + p.stderr)[-3000:]
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    res = json.loads((run_dir / "results.json").read_text())
    (rnd,) = res["rounds"]
    assert rnd["status"] == "invalid", rnd["error"]
    assert rnd["error"].startswith("conformance check failed: gradient of embedding"), rnd["error"]
    assert rnd["conformance"]["verdict"] == "failed"
    assert rnd["conformance"]["cached"] is False and rnd["conformance"]["probe_start"] == "forked from the rank", rnd["conformance"]
    assert rnd["phases"] and all(ph["steps_run"] == 0 and ph["loss"] == {} for ph in rnd["phases"]), "no step may run after a failed check"
    assert "Conformance (round 1): failed: gradient of embedding" in (run_dir / "results.md").read_text()
    assert "conformance check failed" in p.stdout + p.stderr


@pytest.mark.framework("megatron")
def test_a_run_forks_its_probe_which_computes_as_the_check_alone(tmp_path, megatron_python):
    """In a run the probe is forked from rank 0 (its imports made): its verdict is the spawned
    probe's of ``flagbench conformance``, to the last bit here."""
    seed = _fresh_seed()
    cmd = [sys.executable, "run_benchmarks/start_task.py", *CASE, "--set", f"train.seed={seed}", "--log-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    (rnd,) = json.loads((run_dir / "results.json").read_text())["rounds"]
    forked = rnd["conformance"]
    assert forked["verdict"] == "passed" and forked["cached"] is False, (forked, (p.stdout + p.stderr)[-2000:])
    assert forked["probe_start"] == "forked from the rank"
    rc, alone = _check("--set", f"train.seed={seed}", "--no-cache")
    assert rc == 0 and alone["probe_start"] == "spawned: run alone" and alone["key"] == forked["key"], alone
    assert alone["worst"] == forked["worst"] and alone["compared"] == forked["compared"]


# --------------------------------------------------------------------------- the other families' probes

FAMILIES = {
    "baichuan2": ["--vendor", "cpu", "--case_name", "baichuan2_tiny:deepspeed:cpu:1:1"],
    "gpt3": ["--vendor", "cpu", "--case_name", "gpt3_tiny:paddle:cpu:1:1"],
    "llava": ["--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2"],
}


def _check_family(family: str, *extra: str) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "run_benchmarks.cli", "conformance", *FAMILIES[family], "--json", "--no-cache", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    return p.returncode, json.loads(p.stdout[p.stdout.index("{") :])


@pytest.mark.framework("paddle")
def test_gpt3_with_fused_qkv_passes(paddle_python):
    """gpt3_tiny with q, k and v as one fused projection: the published math, far inside fp32's
    tolerance (the layer as configured passes beside its defects, below)."""
    rc, v = _check_family("gpt3", "--set", "parallel.fuse_attention_qkv=true")
    assert rc == 0 and v["verdict"] == "passed", v
    assert v["worst"]["error"] < v["worst"]["tolerance"] / 20, v["worst"]


FAMILY_DEFECTS = [
    ("baichuan2", "attention_times_zero"),
    ("baichuan2", "softmax_scale_x4"),
    ("baichuan2", "attention_window"),  # its sdpa gets ALiBi's additive mask, not is_causal
    ("baichuan2", "alibi_slopes_off"),
    ("gpt3", "paddle_attention_times_zero"),
    ("gpt3", "paddle_softmax_scale_x4"),
    ("gpt3", "paddle_attention_window"),
    ("gpt3", "learned_positions_shifted"),
    ("llava", "attention_times_zero"),
    ("llava", "softmax_scale_x4"),
    ("llava", "attention_window"),  # transformers may hand SDPA a mask, not is_causal
    ("llava", "hf_rope_base_off"),
]


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.framework("paddle" if f == "gpt3" else "deepspeed"))
        for f in sorted({f for f, _ in FAMILY_DEFECTS})
    ],
)
def test_each_family_defect_fails(request, family):
    """Each family's layer as configured passes, far inside fp32's tolerance (baichuan2_tiny's
    ALiBi, RMSNorm, SwiGLU and NormHead; gpt3_tiny's learned positions, LayerNorm, GELU, biases
    and tied head on paddle; llava_tiny's CLIP patch embedding and encoder layer, projector, the
    image features in place of the image tokens, one Llama layer and the head, the tower's
    gradients judged too), and every defect that applies to it fails, first at the attention
    output: one process, the unchanged stack checked first."""
    request.getfixturevalue("paddle_python" if family == "gpt3" else "deepspeed_python")
    defects = [h for f, h in FAMILY_DEFECTS if f == family]
    rc, verdicts = _checks(
        [sys.executable, "-m", "run_benchmarks.cli", "conformance", *FAMILIES[family]], ["examples.alternatives:unchanged", *defects]
    )
    assert rc == 1
    intact = verdicts.pop(0)
    assert intact["verdict"] == "passed" and intact["worst"]["error"] < intact["worst"]["tolerance"] / 20, intact
    if family == "llava":
        assert any(r["tensor"].startswith("gradient of v_patch") for r in intact["rows"])
    for hook, v in zip(defects, verdicts):
        assert v["verdict"] == "failed", (hook, v)
        assert v["message"].startswith("attention output") and "differs" in v["message"] and "from the reference" in v["message"], (
            hook,
            v["message"],
        )


def test_hooks_and_settings_are_not_mixed():
    """``--hook`` and ``--each-set`` each make checks of their own: both at once is bad input."""
    cmd = [sys.executable, "-m", "run_benchmarks.cli", "conformance", *CASE, "--hook", "a:b", "--each-set", "parallel.attention=local"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "error: --hook and --each-set: give one of them (each makes checks of its own)"
