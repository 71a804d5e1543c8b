"""The vendor engineer's path: check, fairness guard, scaffold."""

import shutil

import pytest
import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning import registry
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.tools import vendor_tools
from tests.case_helpers import start_task


@pytest.mark.parametrize("vendor", ["cpu", "nvidia", "iluvatar"])
def test_shipped_vendors_pass_check(vendor):
    assert vendor_tools.check_vendor(vendor) == []


def _copy_vendor(tmp_path, name="nvidia"):
    vendors = tmp_path / "vendors"
    shutil.copytree(registry.VENDORS_DIR / name, vendors / name)
    return vendors, vendors / name


def test_check_reports_every_defect_at_once(tmp_path):
    vendors, v = _copy_vendor(tmp_path)
    (v / "megatron" / "Dockerfile").unlink()
    cfgs = v / "cases" / "llama3_8b" / "megatron"
    (cfgs / "config_H100x1x8_BADLAYOUT.yaml").write_text("parallel: {tp: 3}\n")
    (cfgs / "config_H100x1x8_CHEAT.yaml").write_text("model: {hidden_size: 1024}\n")
    (cfgs / "config_Z9x1x8.yaml").write_text("train: {micro_batch: 1}\n")
    (cfgs / "settings.yaml").write_text("train: {micro_batch: 1}\n")
    (cfgs / "config_H100x1x8_HOOK.yaml").write_text("hook: vendors.nvidia.adapters.nope:install\n")
    (cfgs.parent / "config_H100x1x4.yaml").write_text("train: {micro_batch: 1}\n")  # the layout without framework folders
    (cfgs.parent / "paddle").mkdir()
    (cfgs.parent / "paddle" / "config_H100x1x8.yaml").write_text("train: {micro_batch: 1}\n")
    (v / "cases" / "llama9_1t" / "megatron").mkdir(parents=True)
    (v / "cases" / "llama9_1t" / "megatron" / "config_H100x1x8.yaml").write_text("train: {micro_batch: 1}\n")
    vy = yaml.safe_load((v / "vendor.yaml").read_text())
    vy["chips"]["A100"]["peak_flops"]["bf16"] = 312  # forgot the e12
    vy["adapters"] = {"megatron": "vendors.nvidia.adapters.tuning:install"}
    (v / "vendor.yaml").write_text(yaml.safe_dump(vy))
    problems = vendor_tools.check_vendor("nvidia", vendors_dir=vendors)
    text = "\n".join(problems)
    expected = [
        "megatron/Dockerfile: missing",
        "config_H100x1x8_BADLAYOUT.yaml: tp=3 x pp=1 does not divide the world size 8",
        "config_H100x1x8_CHEAT.yaml: parameter 'model.hidden_size' may not be changed by a vendor",
        "chip 'Z9' is not in",
        "settings.yaml: file name must be config_",
        "config_H100x1x8_HOOK.yaml: field 'hook': module vendors.nvidia.adapters.nope not found",
        "field 'chips.A100.peak_flops.bf16': 312.0 is not a plausible",
        "field 'adapters.megatron': module vendors.nvidia.adapters.tuning not found",
        f"{cfgs.parent / 'config_H100x1x4.yaml'}: not read: configs live in a framework folder; move it to {cfgs / 'config_H100x1x4.yaml'}",
        f"{cfgs.parent / 'paddle'}: framework 'paddle' does not serve model 'llama3_8b'; it is served by megatron",
        f"{v / 'cases' / 'llama9_1t'}: no case serves model 'llama9_1t'; the cases serve baichuan2_13b,",
    ]
    for fragment in expected:
        assert fragment in text, f"{fragment!r} not reported:\n{text}"
    assert len(problems) == len(expected)


def test_check_command_exit_status(tmp_path, capsys):
    assert vendor_tools.main(["check", "cpu"]) == 0
    assert "cpu: ok" in capsys.readouterr().out
    assert vendor_tools.main(["check", "../etc"]) == 2


def test_fairness_guard_both_ways():
    case = registry.find_case(CaseName.parse("llama3_8b:megatron:A100:1:8")).config
    std = registry.standard_settings(case, "llama3_8b")
    ok = registry.fairness_check({"parallel": {"tp": 2, "recompute": "full"}, "train": {"micro_batch": 2}}, case, std, "f.yaml")
    assert {"param": "parallel.tp", "value": 2, "standard": 1} in ok
    assert {"param": "train.micro_batch", "value": 2, "standard": 1} in ok
    for bad in (
        {"train": {"global_batch": 256}},
        {"train": {"lr": 1e-4}},
        {"model": {"num_layers": 16}},
        {"train": {"steps": 5}},
        {"data": {"data_dir": "/x"}},
    ):
        with pytest.raises(InputError, match="may not be changed by a vendor"):
            registry.fairness_check(bad, case, std, "f.yaml")


def test_scaffolded_vendor_and_config_pass_check(tmp_path, monkeypatch):
    vendors = tmp_path / "vendors"
    written = vendor_tools.scaffold_vendor("acme", "X1", ["megatron"], vendors_dir=vendors)
    assert (vendors / "acme" / "megatron" / "Dockerfile") in written
    path = vendor_tools.scaffold_config("acme", "llama3_8b:megatron:X1:1:8", None, vendors_dir=vendors)
    assert path == vendors / "acme" / "cases" / "llama3_8b" / "megatron" / "config_X1x1x8.yaml"
    # the scaffold's placeholders are refused, every one at once
    problems = vendor_tools.check_vendor("acme", vendors_dir=vendors)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "field 'chips.X1.source': still the scaffold's placeholder; name the datasheet of the peak",
        "BASE_IMAGE is still the scaffold's placeholder; name the vendor's base image",
        "does not name megatron-core (needed by megatron cases and the node monitors; if the base image provides it, say so in a comment naming it)",
        "does not name psutil (needed by megatron cases and the node monitors; if the base image provides it, say so in a comment naming it)",
    ], problems
    v = vendors / "acme"
    (v / "vendor.yaml").write_text(
        (v / "vendor.yaml").read_text().replace("fill in the datasheet the peak comes from", "Acme X1 datasheet")
    )
    (v / "megatron" / "Dockerfile").write_text(
        (v / "megatron" / "Dockerfile").read_text().replace("fill-in/base-image:tag", "acme/torch:2.6")
    )
    (v / "megatron" / "requirements.txt").write_text("megatron-core==0.16.1\npsutil>=5.9\npyyaml\n")
    assert vendor_tools.check_vendor("acme", vendors_dir=vendors) == []
    with pytest.raises(InputError, match="exists already"):
        vendor_tools.scaffold_vendor("acme", "X1", ["megatron"], vendors_dir=vendors)


def test_every_field_problem_of_vendor_yaml_at_once(tmp_path):
    """Open device types, yet names checked; a monitor is a built-in or a plug-in; all listed."""
    vendors, v = _copy_vendor(tmp_path, "cpu")
    vy = yaml.safe_load((v / "vendor.yaml").read_text())
    vy.update({"device": "NPU!", "dist_backend": "hccl", "monitor": "bogus", "memory_query": "no spec", "colour": "red"})
    (v / "vendor.yaml").write_text(yaml.safe_dump(vy))
    problems = vendor_tools.check_vendor("cpu", vendors_dir=vendors)
    assert [p.split("field ", 1)[1].split(":")[0] for p in problems] == ["'device'", "'monitor'", "'memory_query'", "'colour'"], problems
    vy.update({"device": "npu", "monitor": "vendors.cpu.monitor:sample", "memory_query": "vendors.cpu.memory:peak"})
    del vy["colour"]
    (v / "vendor.yaml").write_text(yaml.safe_dump(vy))
    problems = vendor_tools.check_vendor("cpu", vendors_dir=vendors)
    assert problems == [
        f"{v / 'vendor.yaml'}: field 'monitor': module vendors.cpu.monitor not found",
        f"{v / 'vendor.yaml'}: field 'memory_query': module vendors.cpu.memory not found",
    ], problems


def test_the_cases_own_settings_check_runs_before_launch(tmp_path):
    """A combination only a case's own settings reader refuses is refused when the run is
    planned, before any process starts: in a vendor config (vendor_tools check names the file),
    by --set (start_task.py --dry-run and a run list's --check name the file and the values), with
    the message the ranks would give."""
    vendors, v = _copy_vendor(tmp_path)
    cfgs = v / "cases" / "llama3_8b" / "megatron"
    (cfgs / "config_H100x1x8_NOSP.yaml").write_text("parallel: {tp: 2, tp_comm_overlap: symm_mem}\n")
    (problem,) = vendor_tools.check_vendor("nvidia", vendors_dir=vendors)
    assert problem == (
        f"{cfgs / 'config_H100x1x8_NOSP.yaml'}: parallel.tp_comm_overlap: symm_mem runs the gathers and "
        "reduce-scatters of sequence parallelism: set parallel.sequence_parallel: true"
    )
    proc = start_task(
        "--vendor", "cpu", "--case_name", "llava_tiny:deepspeed:cpu:1:2", "--set", "parallel.fused_elementwise=liger", "--dry-run"
    )
    cfg = registry.vendor_config_dir("cpu", "llava_tiny", "deepspeed") / "config_cpux1x2.yaml"
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {cfg} with --set parallel.fused_elementwise=liger: parallel.fused_elementwise: liger runs liger-kernel's "
        "Triton kernels, which need vendor.device: cuda (this vendor's device is cpu); use none or compile"
    ), proc.stderr
    runlist = tmp_path / "list.yaml"
    runlist.write_text("cases:\n  - case: llama3_8b:megatron:H200:1:4\n    vendor: nvidia\n    set: [parallel.sequence_parallel=false]\n")
    proc = start_task("--nightly", str(runlist), "--check")
    assert proc.returncode == 2 and "config_H200x1x4.yaml with --set parallel.sequence_parallel=false: parallel.tp_comm_overlap" in (
        proc.stdout + proc.stderr
    ), proc.stdout + proc.stderr


def test_check_lists_every_problem_of_a_config_each_worded_once(tmp_path):
    vendors, v = _copy_vendor(tmp_path)
    cfgs = v / "cases" / "llama3_8b" / "megatron"
    (cfgs / "config_H100x1x8_TWO.yaml").write_text("model: {hidden_size: 1024}\ntrain: {seq_length: 9, micro_batch: 1}\n")
    vy = yaml.safe_load((v / "vendor.yaml").read_text())
    vy["monitor"] = "npu-smi"
    del vy["chips"]["A100"]["source"], vy["device"]
    (v / "vendor.yaml").write_text(yaml.safe_dump(vy))
    text = "\n".join(vendor_tools.check_vendor("nvidia", vendors_dir=vendors))
    assert "field 'monitor': must be one of nvml, ixsmi, none or a vendor's 'module:function', got 'npu-smi'\n" in text + "\n"
    assert text.count("got 'npu-smi'") == 1, text
    assert "field 'device': Field required; add 'device: <value>' at the top level" in text
    assert "field 'chips.A100.source': Field required; add 'source: <value>' under 'chips.A100'" in text
    vy.update(monitor="none", device="cuda")
    vy["chips"]["A100"]["source"] = "datasheet"
    (v / "vendor.yaml").write_text(yaml.safe_dump(vy))
    problems = vendor_tools.check_vendor("nvidia", vendors_dir=vendors)
    two = [p for p in problems if "config_H100x1x8_TWO.yaml" in p]
    assert len(two) == 2 and "'model.hidden_size'" in two[0] and "'train.seq_length'" in two[1], problems


def test_values_equal_to_the_standard_are_no_overrides(tmp_path):
    vendors, v = _copy_vendor(tmp_path)
    cfg = v / "cases" / "llama3_8b" / "megatron" / "config_H100x1x8.yaml"
    entry = registry.find_case(CaseName.parse("llama3_8b:megatron:H100:1:8"))
    standard = registry.standard_settings(entry.config, "llama3_8b")
    cfg.write_text(yaml.safe_dump({"train": {"micro_batch": standard["train"]["micro_batch"]}, "parallel": {"tp": 2}}))
    from run_benchmarks.planning import plan as planning
    from run_benchmarks.planning.config import VendorConfig, load

    vendor = load(VendorConfig, v / "vendor.yaml")
    r = planning.resolve(CaseName.parse("llama3_8b:megatron:H100:1:8"), vendor, entry, cfg)
    assert [o["param"] for o in r.overrides] == ["parallel.tp"]
