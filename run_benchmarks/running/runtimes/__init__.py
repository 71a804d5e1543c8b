"""Runtimes, chosen by the cluster config's ``backend`` (one registry, no vendor branches)."""

from __future__ import annotations

import importlib

from run_benchmarks.planning.config import ClusterConfig
from run_benchmarks.running.runtimes.base import Runtime

#: backend -> "module:class"
RUNTIMES = {
    "local": "run_benchmarks.running.runtimes.local:LocalRuntime",
    "ssh": "run_benchmarks.running.runtimes.ssh:SSHRuntime",
    "slurm": "run_benchmarks.running.runtimes.slurm:SlurmRuntime",
}


def select(cluster: ClusterConfig, python: str | None = None) -> Runtime:
    module, _, cls = RUNTIMES[cluster.backend].partition(":")
    return getattr(importlib.import_module(module), cls)(cluster=cluster, python=python)
