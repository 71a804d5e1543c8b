"""--dry-run plans without executing; --json gives the documented keys."""

import json
import subprocess
import sys

import pytest

from run_benchmarks.planning.registry import ROOT

START = str(ROOT / "run_benchmarks" / "start_task.py")


def dry(*args, cwd):
    proc = subprocess.run([sys.executable, START, *args, "--dry-run", "--json"], capture_output=True, text=True, cwd=cwd, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("hw, peak", [("A100", 312e12), ("H100", 989e12)])
def test_llama3_8b_plan(hw, peak, tmp_path):
    d = dry("--vendor", "nvidia", "--case_name", f"llama3_8b:megatron:{hw}:1:8", "--python", sys.executable, cwd=tmp_path)
    assert d["model"]["params_exact"] == 8_030_261_248
    assert d["model"]["params_nominal"] == 8e9
    assert d["model"]["flops_per_token_6n"] == 48e9
    assert round(d["model"]["flops_per_token_palm"] / 1e9, 1) == 57.9
    assert d["hardware"]["peak_flops"] == peak and d["hardware"]["precision"] == "bf16"
    assert d["config_name"] == f"config_{hw}x1x8"
    assert len(d["nodes"]) == 1
    cmd = d["nodes"][0]["command"]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[-2:] == ["--config", str(tmp_path / "logs" / d["run_id"] / "round1" / "resolved.json")]
    assert d["nodes"][0]["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert d["runtime"] == "local" and d["hosts"] == [{"name": "localhost", "address": "127.0.0.1"}]
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_seed_layouts_are_named(tmp_path):
    base = dry("--vendor", "nvidia", "--case_name", "llama3_8b:megatron:A100:1:8", "--python", sys.executable, cwd=tmp_path)
    assert {o["param"]: o["value"] for o in base["overrides"]}["parallel.pp"] == 2
    variant = dry(
        "--vendor",
        "nvidia",
        "--case_name",
        "llama3_8b:megatron:A100:1:8",
        "--variant",
        "PP4DP2TP1",
        "--python",
        sys.executable,
        cwd=tmp_path,
    )
    assert variant["config_name"] == "config_A100x1x8_PP4DP2TP1"
    assert variant["settings"]["parallel"]["pp"] == 4 and variant["settings"]["parallel"]["tp"] == 1


def test_human_plan_lists_everything(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            START,
            "--vendor",
            "nvidia",
            "--case_name",
            "llama3_8b:megatron:H100:1:8",
            "--dry-run",
            "--python",
            sys.executable,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for fragment in (
        "params exact 8,030,261,248",
        "PaLM 5.791e+10",
        "peak 9.89e+14 FLOP/s",
        "torch.distributed.run",
        "hosts       localhost=127.0.0.1",
    ):
        assert fragment in out, out


def test_expandable_segments_reach_the_ranks_through_the_vendors_allocator_variable(tmp_path):
    """parallel.expandable_segments and parallel.pinned_register_threads set the vendor's
    allocator_env for every rank before it starts; off, the variable is left to the environment;
    a vendor's own options in it are kept; a thread count that is not one is refused."""
    from run_benchmarks.errors import InputError
    from run_benchmarks.planning import plan, registry

    on = dry(
        "--vendor",
        "nvidia",
        "--case_name",
        "llama3_8b:megatron:H200:1:2",
        "--python",
        sys.executable,
        "--set",
        "parallel.expandable_segments=true",
        cwd=tmp_path,
    )
    assert on["nodes"][0]["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert {o["param"]: o["value"] for o in on["user_overrides"]} == {"parallel.expandable_segments": True}
    off = dry("--vendor", "nvidia", "--case_name", "llama3_8b:megatron:H200:1:2", "--python", sys.executable, cwd=tmp_path)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in off["nodes"][0]["env"]
    nvidia = registry.load_vendor("nvidia")
    theirs = nvidia.model_copy(update={"env": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:False"}})
    assert plan.allocator_options(theirs, {"expandable_segments": True}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"
    }
    assert plan.allocator_options(theirs, {}) == {}
    register = "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
    assert plan.allocator_options(theirs, {"expandable_segments": True, "pinned_register_threads": 16}) == {
        "PYTORCH_CUDA_ALLOC_CONF": f"max_split_size_mb:512,expandable_segments:True,{register}"
    }
    assert plan.allocator_options(nvidia, {"pinned_register_threads": 16}) == {"PYTORCH_CUDA_ALLOC_CONF": register}
    for bad in (-1, 65, 2.5, True, "8"):
        with pytest.raises(InputError, match=r"config_x\.yaml: parallel\.pinned_register_threads must be a whole number from 0"):
            plan.allocator_options(nvidia, {"pinned_register_threads": bad}, "config_x.yaml")
    pinned = dry(
        "--vendor",
        "nvidia",
        "--case_name",
        "llama3_8b:megatron:H200:1:1",
        "--python",
        sys.executable,
        "--set",
        "parallel.pinned_register_threads=16",
        cwd=tmp_path,
    )
    assert pinned["nodes"][0]["env"]["PYTORCH_CUDA_ALLOC_CONF"] == register
    assert list(tmp_path.iterdir()) == []


def test_a_list_set_on_the_command_line_reaches_the_resolved_config(tmp_path):
    """--set takes a YAML list of scalars (ZeRO-3's leaf module classes), recorded as the user's override."""
    on = dry(
        "--vendor",
        "nvidia",
        "--case_name",
        "llava1.5_7b:deepspeed:H200:1:2",
        "--python",
        sys.executable,
        "--set",
        "parallel.phases.finetune.zero.leaf_modules=[LlamaDecoderLayer, CLIPEncoderLayer]",
        cwd=tmp_path,
    )
    assert {o["param"]: (o["value"], o["standard"]) for o in on["user_overrides"]} == {
        "parallel.phases.finetune.zero.leaf_modules": (["LlamaDecoderLayer", "CLIPEncoderLayer"], [])
    }
    assert on["settings"]["parallel"]["phases"]["finetune"]["zero"]["leaf_modules"] == ["LlamaDecoderLayer", "CLIPEncoderLayer"]


@pytest.mark.parametrize(
    "vendor, case, value, said",
    [
        ("cpu", "llama3_tiny:megatron:cpu:1:2", "true", "vendor 'cpu' declares no allocator_env in vendors/cpu/vendor.yaml"),
        ("nvidia", "baichuan2_13b:deepspeed:H200:1:4", "maybe", "parallel.expandable_segments must be true or false, got 'maybe'"),
        ("nvidia", "gpt3_6.7B:paddle:A100:1:8", "true", "the gpt3/paddle case"),  # a torch allocator switch: not paddle's
    ],
)
def test_expandable_segments_refused_where_it_cannot_apply(vendor, case, value, said, tmp_path):
    proc = subprocess.run(
        [sys.executable, START, "--vendor", vendor, "--case_name", case, "--set", f"parallel.expandable_segments={value}", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


def test_the_plan_names_the_reference_that_will_judge_each_phase(tmp_path):
    """--dry-run says which committed reference judges a phase (its repeats and spread), or that
    none will, and why: none committed for the recipe, or a --set that changes the recipe."""
    short = dry("--vendor", "nvidia", "--case_name", "llama3_8b:megatron:H200:1:1", "--recipe", "short", cwd=tmp_path)
    (line,) = short["judged_by"]
    assert line.startswith("reference (train): cases/llama3/megatron/reference/llama3_8b/short.json, the mean of 3 runs")
    assert short["recipe"] == "short" and short["settings"]["train"]["lr"] == 3e-6 and short["user_overrides"] == []
    standard = dry("--vendor", "nvidia", "--case_name", "llama3_8b:megatron:H200:1:2", cwd=tmp_path)
    assert standard["judged_by"] == [
        "reference (train): none: this run will not be judged (none committed (cases/llama3/megatron/reference/llama3_8b/standard.json))"
    ]
    changed = dry(
        "--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2", "--set", "train.phases.finetune.lr=0.1", "--json", cwd=tmp_path
    )
    assert changed["judged_by"][0].startswith("reference (pretrain): cases/llava/deepspeed/reference/llava_tiny/standard.pretrain.json")
    assert changed["judged_by"][1] == (
        "reference (finetune): none: this run will not be judged (--set train.phases.finetune.lr=0.1 changes the standard recipe: "
        "its reference judges only runs of that recipe)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "run_benchmarks/start_task.py",
            "--vendor",
            "cpu",
            "--case_name",
            "llama3_tiny:megatron:cpu:1:2",
            "--recipe",
            "short",
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "gives llama3_tiny no such recipe (it has: standard, attention)" in proc.stderr, proc.stderr


def test_start_task_and_a_run_list_build_one_frozen_plan_alike(tmp_path):
    """One function builds the plan for start_task.py and for a nightly run list: the same case
    planned both ways has the same settings, data, references and command; the plan cannot be
    changed once built, and each round's nodes and interpreter belong to the round's own plan."""
    import dataclasses

    from run_benchmarks.nightly import driver
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning.casename import CaseName
    from run_benchmarks.planning.config import ClusterConfig

    ref = ROOT / "cases/llama3/megatron/reference/llama3_tiny/standard.json"
    runlist = tmp_path / "night.yaml"
    runlist.write_text(
        f"cases:\n  - {{case: 'llama3_tiny:megatron:cpu:1:2', vendor: cpu, rounds: 1, sets: ['train.steps=24'], reference: {ref}}}\n"
    )
    (night,) = driver.prepare(runlist, log_dir=str(tmp_path / "logs")).jobs
    argv = ["--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2:1", "--set", "train.steps=24", "--reference", str(ref)]
    here = dry(*argv, "--log-dir", str(tmp_path / "logs"), cwd=tmp_path)
    there = night.plan.to_json()
    for key in ("settings", "data", "reference", "overrides", "user_overrides", "memory", "config_file", "recipe"):
        assert there[key] == here[key], key
    assert there["command"] == ["run_benchmarks/start_task.py", *argv]  # the command that plans it again
    assert here["nodes"] and here["python"] and there["nodes"] == [] and there["python"] == ""  # rounds own them

    plan = planning.build(CaseName.parse("llama3_tiny:megatron:cpu:1:2"), "cpu", ClusterConfig(), tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.data = None
    assert plan.data == {"train": {"kind": "synthetic", "fingerprint": "synthetic"}}
    assert plan.command == ["run_benchmarks/start_task.py", "--vendor", "cpu", "--case_name", "llama3_tiny:megatron:cpu:1:2:1"]
