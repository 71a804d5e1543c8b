"""What every runtime (local, ssh + container, slurm) provides to the orchestrator."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from run_benchmarks.plan import NodePlan, Plan


@dataclasses.dataclass
class NodeOutcome:
    host: str
    node_rank: int
    returncode: int | None  # None: did not finish
    timed_out: bool
    node_dir: Path  # local directory holding this node's logs
    error: str | None = None  # runtime-level failure (host lost, container error)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Runtime:
    """Runs the node commands of one round and brings their logs into ``round_dir``."""

    name = ""

    def dry_prepare(self, plan: "Plan") -> tuple[str, Path]:
        """What ``prepare`` would return, without touching anything (for --dry-run)."""
        raise NotImplementedError

    def prepare(self, plan: "Plan", log: Path) -> tuple[str, Path]:
        """Make nodes ready; return (python on the nodes, code root on the nodes)."""
        raise NotImplementedError

    def node_plans(self, plan: "Plan", python: str, root: Path, round_dir: Path) -> list["NodePlan"]:
        """Each node's launcher command for a round (``round_dir`` is the local one)."""
        from run_benchmarks.plan import plan_nodes

        return plan_nodes(plan, python, root, round_dir)

    def run_round(self, plan: "Plan", round_dir: Path, nodes: list["NodePlan"], timeout_s: float) -> list[NodeOutcome]:
        raise NotImplementedError

    def dry_run_details(self, plan: "Plan") -> dict[str, Any]:
        """What --dry-run shows beyond the node commands (a batch script, submit lines); runs nothing."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Extra facts for results.json (image ids, job ids)."""
        return {}

    def cleanup(self) -> None:
        """Tear everything down; safe to call more than once."""
