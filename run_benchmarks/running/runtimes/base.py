"""What every runtime (local, ssh + container, slurm) provides to the orchestrator."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from run_benchmarks.planning.plan import NodePlan, Plan, RoundPlan


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
    #: set (from the orchestrator's watch thread) to stop the running round early: the
    #: reason becomes every unfinished node's error; each ``run_round`` clears it first
    aborted: str | None = None

    def abort(self, reason: str) -> None:
        """Stop the round now running, as its deadline would, with ``reason`` as the cause."""
        self.aborted = reason

    def running_since(self) -> float | None:
        """Wall-clock time the round's processes started (None: when ``run_round`` began;
        a Slurm job counts from when it runs, not while it waits in the queue)."""
        return None

    #: the data on the hosts only is checked inside each round (a Slurm job's nodes), not before them
    data_in_rounds = False

    def round_data(self, plan: Plan, rnd: RoundPlan) -> list[tuple[str, dict[str, Any]]] | None:
        """After a round, where ``data_in_rounds``: each node's report of planning/hostdata.py's
        node side, in node order (InputError naming the node whose data is missing or bad); None
        where the round got no such report."""
        return None

    def host_data(self, plan: Plan, spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
        """After ``prepare``, before any round: the node side of planning/hostdata.py run with
        ``spec`` on every host of the round, each host's report in host order (InputError naming
        the host whose data is missing or bad); None where this runtime takes no fingerprint
        before its rounds."""
        return None

    def dry_prepare(self, plan: Plan) -> tuple[str, Path]:
        """What ``prepare`` would return, without touching anything (for --dry-run)."""
        raise NotImplementedError

    def prepare(self, plan: Plan, log: Path) -> tuple[str, Path]:
        """Make nodes ready; return (python on the nodes, code root on the nodes)."""
        raise NotImplementedError

    def node_plans(self, plan: Plan, python: str, root: Path, round_dir: Path) -> list[NodePlan]:
        """Each node's launcher command for a round (``round_dir`` is the local one)."""
        from run_benchmarks.planning.plan import plan_nodes

        return plan_nodes(plan, python, root, round_dir)

    def run_round(self, plan: Plan, rnd: RoundPlan, timeout_s: float) -> list[NodeOutcome]:
        """Run the round's node commands and bring their logs into ``rnd.dir``."""
        raise NotImplementedError

    def round_plan(self, plan: Plan, number: int, round_dir: Path, python: str, root: Path) -> RoundPlan:
        """Round ``number`` as planned when it starts: each node's command, ``python`` and ``root`` there."""
        from run_benchmarks.planning.plan import RoundPlan

        return RoundPlan(number, round_dir, python, tuple(self.node_plans(plan, python, root, round_dir)))

    def dry_round(self, plan: Plan) -> RoundPlan:
        """The first round as it would be planned, without touching anything (for --dry-run)."""
        python, root = self.dry_prepare(plan)
        return self.round_plan(plan, 1, plan.run_dir / "round1", python, root)

    def dry_run_details(self, plan: Plan, rnd: RoundPlan | None = None) -> dict[str, Any]:
        """What --dry-run shows beyond the node commands (a batch script, submit lines); runs nothing."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Extra facts for results.json (image ids, job ids)."""
        return {}

    def progress(self, round_dir: Path) -> list[dict[str, Any] | None]:
        """While a round runs (from another thread): each node's newest step record, read from
        the round folder here (the local runtime's logs, a Slurm cluster's shared folder)."""
        from run_benchmarks.running import progress

        return [progress.read(d) for d in sorted(round_dir.glob("node*")) if d.is_dir()]

    def host_memory(self) -> dict[str, int]:
        """Each node host's total memory in bytes, after ``prepare`` ({} where not known before
        the job starts, as under Slurm). This host's, for the local runtime."""
        import socket

        import psutil

        return {socket.gethostname(): psutil.virtual_memory().total}

    def note(self) -> str | None:
        """While a round runs: the runtime's own state worth showing (a Slurm job's id and state)."""
        return None

    def unreached_master(self) -> str | None:
        """While a round whose ranks have not started training runs: the nodes that cannot
        reach the master's rendezvous port which the master itself answers (a network cut
        between hosts), as one line naming each; None when none is found."""
        return None

    def cleanup(self) -> None:
        """Tear everything down; safe to call more than once, and after a stop signal
        interrupted any other call (``stop_on_signals``)."""

    def left_behind(self) -> list[str]:
        """What the run may leave if its teardown is cut short, one line per host."""
        return []


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclasses.dataclass
class Stop:
    """Which stop signal came first (None: none); ``exit_status`` is the shell's 128 + signal."""

    signum: int | None = None

    @property
    def exit_status(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS, left_behind: Callable[[], list[str]] | None = None) -> Iterator[Stop]:
    """Within: SIGTERM and SIGHUP (a kill, a closed terminal, a scheduler's stop) end the run
    as Ctrl-C does: ``KeyboardInterrupt`` in the main thread, so every ``finally`` and each
    runtime's teardown (containers removed, remote processes stopped, Slurm jobs cancelled)
    runs. A second signal, while that teardown runs, ends the process at once with the
    first signal's exit status, saying what may be left on which host (``left_behind``).
    The previous handlers come back on exit."""
    stop = Stop()

    def handler(signum: int, _frame: object) -> None:
        if stop.signum is not None:
            lines = []
            try:
                lines = left_behind() if left_behind else []
            except Exception:
                pass
            name = signal.Signals(signum).name
            print(f"{name} again: stopped without finishing the teardown", file=sys.stderr)
            for line in lines:
                print(f"  may be left: {line}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(stop.exit_status)
        stop.signum = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
