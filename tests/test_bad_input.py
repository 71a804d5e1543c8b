"""Bad input: exit 2, one line naming the problem, nothing launched or written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.planning.registry import ROOT
from run_benchmarks.start_task import main

GOOD = ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:A100:1:8"]


def _write(tmp: Path, name: str, text: str) -> str:
    p = tmp / name
    p.write_text(text)
    return str(p)


CASES = [
    ("malformed case name", ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:A100:8"], "must have the form"),
    (
        "shell metacharacters in model",
        ["--vendor", "nvidia", "--case_name", "llama3_8b;reboot:megatron:A100:1:8"],
        "model 'llama3_8b;reboot' is not a valid name",
    ),
    (
        "command substitution in framework",
        ["--vendor", "nvidia", "--case_name", "llama3_8b:$(id):A100:1:8"],
        "framework '$(id)' is not a valid name",
    ),
    (
        "path separator in hardware",
        ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:../../etc:1:8"],
        "hardware '../../etc' is not a valid name",
    ),
    ("path in vendor", ["--vendor", "../nvidia", "--case_name", "llama3_8b:megatron:A100:1:8"], "vendor '../nvidia' is not a valid name"),
    ("unknown vendor", ["--vendor", "acme", "--case_name", "llama3_8b:megatron:A100:1:8"], "unknown vendor 'acme': known vendors are"),
    ("unknown model", ["--vendor", "nvidia", "--case_name", "llama9_1t:megatron:A100:1:8"], "unknown model 'llama9_1t'"),
    ("unknown framework", ["--vendor", "nvidia", "--case_name", "llama3_8b:paddle:A100:1:8"], "has no case for framework 'paddle'"),
    ("unknown chip", ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:B999:1:8"], "has no chip 'B999'"),
    (
        "no config for the size",
        ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:A100:1:3"],
        "no config_A100x1x3 for llama3_8b on megatron (vendors/nvidia/cases/llama3_8b/megatron/config_A100x1x3.yaml missing); "
        "configs that exist: config_A100x1x8",
    ),
    ("unknown variant", GOOD + ["--variant", "PP9DP9TP9"], "no config_A100x1x8_PP9DP9TP9"),
    ("nprocs < 1", ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:A100:1:0"], "nprocs must be a positive integer"),
    ("negative repeat", ["--vendor", "nvidia", "--case_name", "llama3_8b:megatron:A100:1:8:-1"], "repeat must be a positive integer"),
    ("missing data dir", GOOD + ["--data-dir", "/nonexistent/wudao"], "data dir /nonexistent/wudao does not exist"),
    ("bad --set", GOOD + ["--set", "train.steps"], "expected KEY=VALUE"),
    ("--set a mapping", GOOD + ["--set", "train.steps={a: 1}"], "value must be a scalar or a list of scalars ([a, b])"),
    ("--set a nested list", GOOD + ["--set", "parallel.zero.leaf_modules=[[a]]"], "value must be a scalar or a list of scalars"),
    ("--set outside the allowed sections", GOOD + ["--set", "model.hidden_size=8"], "only train.*, parallel.* and data.* may be set"),
    (
        "--set a setting the case lacks (a typo)",
        GOOD + ["--set", "parallel.fused_adm=true"],
        "the llama3/megatron case (" + str(ROOT / "cases/llama3/megatron/case.yaml") + ") has no setting 'parallel.fused_adm'; "
        "did you mean parallel.fused_adam",
    ),
    (
        "--set a name far from every setting",
        GOOD + ["--set", "train.foo=1"],
        "has no setting 'train.foo'; its train settings: train.adam_beta1, train.adam_beta2,",
    ),
    (
        "--set under a phase the case lacks",
        ["--vendor", "nvidia", "--case_name", "llava1.5_7b:deepspeed:H200:1:4", "--set", "train.phases.finetun.micro_batch=8"],
        "the llava/deepspeed case ("
        + str(ROOT / "cases/llava/deepspeed/case.yaml")
        + ") has no setting 'train.phases.finetun.micro_batch'",
    ),
    ("global batch not divisible", GOOD + ["--set", "train.global_batch=6"], "global batch 6 is not a multiple"),
    ("--json without --dry-run", GOOD + ["--json"], "--json is only valid with --dry-run"),
]


@pytest.mark.parametrize("what, argv, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_argv(what, argv, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(argv + ["--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    assert fragment in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the log dir


def test_set_names_a_setting_of_the_case_or_of_one_of_its_phases():
    """--set takes what the case's standard holds, what a vendor may change (and under a section a
    vendor may change), and either for one of the case's phases; nothing else."""
    from run_benchmarks.planning import registry

    llava = registry.cases()["llava1.5_7b:deepspeed"].config
    std = registry.standard_settings(llava, "llava1.5_7b")
    known = [
        "train.steps",  # the standard's
        "parallel.zero.reduce_bucket_size",  # the standard's, null there
        "train.phases.finetune.global_batch",  # a phase's own value
        "train.phases.pretrain.clip_grad",  # a common value set for one phase
        "parallel.phases.finetune.zero.memory_efficient_linear",  # a vendor's key, for one phase
        "data.num_workers",
    ]
    unknown = ["train.phases.eval.micro_batch", "parallel.zero.reduce_bucket", "train.stepz", "parallel.phases.finetune.tpp"]
    assert [k for k in known if not registry.known_setting(k, std, llava)] == []
    assert [k for k in unknown if registry.known_setting(k, std, llava)] == []


CLUSTER_CASES = [
    ("cluster YAML syntax error", "hosts: [a, b\n", "YAML syntax error"),
    (
        "cluster wrong type",
        "master_port: abc\n",
        "field 'master_port': Input should be a valid integer, unable to parse string as an integer, got 'abc'",
    ),
    ("cluster unknown field", "hostz: []\n", "field 'hostz': unknown field; expected one of: backend, runtime, hosts,"),
    ("cluster host with metacharacters", "backend: ssh\nhosts:\n  - {name: 'n1;ls', address: 10.0.0.1}\n", "field 'hosts.0.name'"),
    ("cluster bad address", "backend: ssh\nhosts:\n  - {name: n1, address: 'a b'}\n", "field 'hosts.0.address'"),
    ("cluster port out of range", "ssh: {port: 70000}\n", "field 'ssh.port'"),
    ("cluster top level not a mapping", "- 1\n- 2\n", "expected a mapping at the top level"),
    ("container runtime without remote backend", "runtime: container\n", "runtime 'container' needs backend"),
]


@pytest.mark.parametrize("what, text, fragment", CLUSTER_CASES, ids=[c[0] for c in CLUSTER_CASES])
def test_bad_cluster_file(what, text, fragment, tmp_path, capsys, monkeypatch):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    path = _write(cfg_dir, "cluster.yaml", text)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc = main(GOOD + ["--cluster", path, "--log-dir", str(work / "logs")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert path in err and fragment in err, err
    assert list(work.iterdir()) == []


def test_missing_cluster_file(tmp_path, capsys):
    rc = main(GOOD + ["--cluster", str(tmp_path / "nope.yaml"), "--log-dir", str(tmp_path / "logs")])
    assert rc == 2
    assert f"{tmp_path / 'nope.yaml'}: file not found" in capsys.readouterr().err


def test_exit_status_2_from_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run_benchmarks" / "start_task.py"), "--vendor", "nvidia", "--case_name", "x:y"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: case name 'x:y' must have the form model:framework:hardware:nnodes:nprocs[:repeat] (got 2 fields)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_unknown_nested_field_lists_the_fields_of_its_own_section(tmp_path):
    from run_benchmarks.planning.config import ClusterConfig, load

    path = tmp_path / "cluster.yaml"
    path.write_text("hosts:\n  - {name: a, address: 10.0.0.1, wrk_dir: /x}\nssh: {usr: me}\n")
    with pytest.raises(InputError) as err:
        load(ClusterConfig, path)
    text = str(err.value)
    assert text.startswith(f"{path}: field 'hosts.0.wrk_dir': unknown field; expected one of: name, address,") and "work_dir" in text
    path.write_text("ssh: {usr: me}\n")
    with pytest.raises(InputError, match=r"field 'ssh.usr': unknown field; expected one of: user,"):
        load(ClusterConfig, path)


def test_unknown_field_under_a_mapping_names_the_entry_model(tmp_path):
    from run_benchmarks.planning.config import VendorConfig, load

    path = tmp_path / "vendor.yaml"
    path.write_text(
        "name: v\ndevice: cuda\ndist_backend: nccl\nchips:\n  X1:\n    peak_flops: {bf16: 1.0e+15}\n    source: s\n    device_namez: [X1]\n"
    )
    with pytest.raises(
        InputError, match=r"field 'chips.X1.device_namez': unknown field; expected one of: peak_flops, memory_gib, source, device_names$"
    ):
        load(VendorConfig, path)


@pytest.mark.parametrize("sent", ["cd33ece4", "CD33ECE027E40D63641D54A771FF91072E9DDADA", "cd33ece027e40d63641d54a771ff91072e9ddada+dirty"])
def test_a_sent_code_version_must_be_a_full_commit_id(sent, tmp_path, capsys, monkeypatch):
    """FLAGBENCH_CODE_VERSION (a tree copied to another machine) is what every results.json of
    the run names: a short, upper-case or otherwise mistyped id is bad input before anything is
    planned or written, for one run and for a run list; a full id (with +changes) is taken."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLAGBENCH_CODE_VERSION", sent)
    expected = f"error: FLAGBENCH_CODE_VERSION={sent!r} is not a full commit id (40 lowercase hex digits"
    assert main(GOOD + ["--log-dir", str(tmp_path / "logs")]) == 2
    assert capsys.readouterr().err.startswith(expected)
    runlist = _write(tmp_path, "list.yaml", "cases:\n  - case: llama3_8b:megatron:A100:1:8\n    vendor: nvidia\n")
    assert main(["--nightly", runlist, "--check", "--log-dir", str(tmp_path / "logs")]) == 2
    assert capsys.readouterr().err.startswith(expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.yaml"]
    monkeypatch.setenv("FLAGBENCH_CODE_VERSION", "cd33ece027e40d63641d54a771ff91072e9ddada+changes")
    assert main(GOOD + ["--dry-run", "--log-dir", str(tmp_path / "logs")]) == 0, capsys.readouterr().err
