"""pytest fixtures for the real Slurm test cluster (tests/slurm/cluster.py).

``slurm_cluster`` (defined as ``slurm_cluster_fixture``; import that name): munged, slurmctld and two slurmd nodes (``n1``, ``n2``) for the whole
session, stopped by PID at the end. Tests that need it are skipped, with the reason,
when not root or when Slurm or munge is missing (``tests/install_system_deps.sh``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import SlurmTestCluster, missing_programs


def slurm_skip_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (it runs slurmd in its own namespaces)"
    missing = missing_programs()
    if missing:
        return f"the Slurm test cluster needs {', '.join(missing)} (tests/install_system_deps.sh installs them)"
    return None


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture() -> Iterator[SlurmTestCluster]:
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmTestCluster().start()
    print(f"slurm test cluster up in {cluster.timings['start_s']:.2f} s at {cluster.base}", file=sys.stderr)
    try:
        yield cluster
    finally:
        cluster.stop()
