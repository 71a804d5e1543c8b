"""Cluster-file fields that reach remote hosts are validated at load, like names and addresses.

No cluster needed: a bad SSH user or work dir is refused before any connection, with one
line naming the file and the field, and nothing is created anywhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from run_benchmarks.planning.registry import ROOT

START = str(ROOT / "run_benchmarks" / "start_task.py")


def dry_run(tmp_path: Path, doc: dict) -> subprocess.CompletedProcess[str]:
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(
        yaml.safe_dump({"backend": "ssh", "hosts": [{"name": "h1", "address": "10.0.0.1"}, {"name": "h2", "address": "10.0.0.2"}], **doc})
    )
    return subprocess.run(
        [
            sys.executable,
            START,
            "--vendor",
            "cpu",
            "--case_name",
            "llama3_tiny:megatron:cpu:2:1",
            "--cluster",
            str(cfile),
            "--log-dir",
            str(tmp_path / "logs"),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.parametrize(
    "doc, field, value",
    [
        (
            {"hosts": [{"name": "h1", "address": "10.0.0.1", "work_dir": "/h1;touch "}, {"name": "h2", "address": "10.0.0.2"}]},
            "hosts.0.work_dir",
            "/h1;touch ",
        ),
        ({"work_dir": "flagbench"}, "work_dir", "flagbench"),
        ({"work_dir": "/scratch/../etc"}, "work_dir", "/scratch/../etc"),
        ({"ssh": {"user": "root; rm -rf ~"}}, "ssh.user", "root; rm -rf ~"),
        (
            {"hosts": [{"name": "h1", "address": "10.0.0.1"}, {"name": "h2", "address": "10.0.0.2", "user": "-oProxyCommand=x"}]},
            "hosts.1.user",
            "-oProxyCommand=x",
        ),
    ],
)
def test_remote_user_and_work_dir_are_validated(tmp_path: Path, doc: dict, field: str, value: str) -> None:
    proc = dry_run(tmp_path, doc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / 'cluster.yaml'}: field '{field}': not a")
    assert line.endswith(f", got {value!r}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]  # no folder made, here or in logs


def test_good_user_and_work_dir_pass(tmp_path: Path) -> None:
    proc = dry_run(tmp_path, {"work_dir": "/scratch/flag-bench_1/", "ssh": {"user": "bench.user"}})
    assert proc.returncode == 0, proc.stderr
    assert "/scratch/flag-bench_1/code/" in proc.stdout  # the trailing slash dropped
