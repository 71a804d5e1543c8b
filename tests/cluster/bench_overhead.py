"""Benchmark: the harness's own time per case-round on 1, 2 and 4 SSH hosts.

    python -m tests.cluster.bench_overhead [--hosts 1 2 4] [--runtime container|process]

Builds a namespace cluster of the largest size (tests/cluster/netns.py), runs the tiny llama3
case with one process per host through start_task.py, and prints the ``orchestration`` figures
of each round's results.json: round start to the last node's launcher started, last training
step to results written, and the framework's own start-up between them (not overhead).
Needs root and the cpu megatron environment (built by run_benchmarks.planning.envs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from run_benchmarks.planning import envs
from run_benchmarks.planning.registry import ROOT
from tests.cluster import netns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--runtime", choices=["container", "process"], default="container")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    python = str(envs.ensure_env("cpu", "megatron"))
    directory = tempfile.mkdtemp(prefix="fbb-", dir="/tmp")
    cluster = netns.up(max(args.hosts), directory, log=lambda m: print(m, file=sys.stderr))
    rows = []
    try:
        for n in args.hosts:
            work = Path(directory) / f"bench{n}"
            work.mkdir()
            doc = {
                "backend": "ssh",
                "runtime": args.runtime,
                "python": python,
                "master_port": 29811,
                "hosts": [{"name": h.name, "address": h.address, "work_dir": f"{h.workdir}/bench"} for h in cluster.hosts[:n]],
                "ssh": {"key_file": cluster.key_file, "known_hosts": cluster.known_hosts},
                "image_build_args": {"BASE_IMAGE": cluster.image},
            }
            (work / "cluster.yaml").write_text(yaml.safe_dump(doc))
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "run_benchmarks" / "start_task.py"),
                    "--vendor",
                    "cpu",
                    "--case_name",
                    f"llama3_tiny:megatron:cpu:{n}:1:{args.rounds}",
                    "--cluster",
                    str(work / "cluster.yaml"),
                    "--log-dir",
                    str(work / "logs"),
                    "--set",
                    "train.steps=10",
                    "--set",
                    "train.warmup_steps=2",
                ],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if proc.returncode != 0:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return 1
            (res_file,) = (work / "logs").glob("*/results.json")
            res = json.loads(res_file.read_text())
            for rnd in res["rounds"]:
                rows.append((n, rnd["round"], rnd["orchestration"], res["runtime_info"]["timings_s"]))
    finally:
        netns.down(directory)
    print(
        "| hosts | round | round start -> last launcher | framework start-up | framework shut-down | launcher exit -> results | overhead |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, r, o, _ in rows:
        print(
            f"| {n} | {r} | {o['to_launch_s']:.2f} s | {o['framework_startup_s']:.2f} s | {o['framework_shutdown_s']:.2f} s "
            f"| {o['after_exit_s']:.2f} s | {o['overhead_s']:.2f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
