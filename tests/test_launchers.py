"""The framework launchers' node commands (run_benchmarks/planning/launchers.py)."""

from __future__ import annotations

import base64
import json
import subprocess

import pytest

from run_benchmarks.planning.launchers import DeepSpeed, LaunchSpec


def _spec(python: str = "python3") -> LaunchSpec:
    return LaunchSpec(python, 2, 4, 1, "10.0.0.1", 29501, "cases/x/deepspeed/train.py", "/r/resolved.json", "/r/node1/ranks", "cuda")


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_deepspeed_starts_its_per_node_launcher_with_the_world_of_the_round() -> None:
    argv = DeepSpeed().command(_spec())
    assert argv[:4] == ["python3", "-u", "-m", "deepspeed.launcher.launch"]
    world = json.loads(base64.urlsafe_b64decode(_option(argv, "--world_info")))
    assert world == {"node0": [0, 1, 2, 3], "node1": [0, 1, 2, 3]}  # what --num_nodes 2 --num_gpus 4 gives
    assert (_option(argv, "--node_rank"), _option(argv, "--master_addr"), _option(argv, "--master_port")) == ("1", "10.0.0.1", "29501")
    assert _option(argv, "--enable_each_rank_log") == "/r/node1/ranks"
    assert argv[-3:] == ["cases/x/deepspeed/train.py", "--config", "/r/resolved.json"]
    assert DeepSpeed().files(_spec()) == {}  # no hostfile: the harness starts every node itself


@pytest.mark.framework("deepspeed")
def test_deepspeeds_own_parser_reads_the_command(deepspeed_python) -> None:
    """The command through DeepSpeed's own argument parser, in its environment."""
    argv = DeepSpeed().command(_spec(deepspeed_python))
    code = (
        "import sys, json; from deepspeed.launcher import launch; sys.argv = ['launch'] + json.loads(sys.argv[1]); "
        "a = launch.parse_args(); print(json.dumps([a.node_rank, a.master_addr, a.master_port, a.world_info, "
        "a.enable_each_rank_log, a.training_script, a.training_script_args]))"
    )
    proc = subprocess.run([deepspeed_python, "-c", code, json.dumps(argv[4:])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    node_rank, addr, port, info, logs, script, rest = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (node_rank, addr, port, info, logs) == (1, "10.0.0.1", 29501, _option(argv, "--world_info"), "/r/node1/ranks")
    assert (script, rest) == ("cases/x/deepspeed/train.py", ["--config", "/r/resolved.json"])
