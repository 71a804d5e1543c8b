"""The suite on several workers (pytest-xdist: ``-n 2 --dist loadgroup``, as the README runs it).

Nearly every test starts real processes, and a tiny run spends most of its time starting
them: run one test at a time, the suite kept a 2-core machine 75 % busy (its first 730 s of
tests, 2026-11-29), and the whole of it took 51 min. A second worker fills the rest.

- **One file, one worker.** Each test file is a group that one worker runs whole, so a
  file's module fixtures (the runs its tests share) run once. Files that share a session
  fixture starting something heavy are one group: the network-namespace cluster, the Slurm
  cluster, the shared llama3 DP2 run.
- **Tests that time something run alone** (``@pytest.mark.alone``): those comparing speeds,
  or bounding how long a thing takes to a few seconds. Such a test waits until the test on
  the other worker ends, and no test starts beside it until it ends. Its fixtures are set up
  and torn down inside that window too. A run of such tests on one worker holds the window
  from the first to the last, so the other worker's tests do not start between them.
- **Alone tests last.** Each group's alone tests are a unit of their own (``<group>+alone``),
  held back until every other group has been handed out, then given to the worker that ran the
  rest of their group (its session fixtures are up there). So each worker waits once for the
  other's running test, not once per alone file: 1,719 s against 1,612 s, replaying the tests'
  times of a two-worker run of 9bd848d (2026-12-04) in both orders.
- Without xdist (``-n 0``, a single test) nothing of this applies.
"""

from __future__ import annotations

import fcntl
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

#: session fixtures that start something heavy: the files using one share its group
SHARED = {
    "cluster": "netns-cluster",
    "cluster_pool": "netns-cluster",
    "slurm_cluster": "slurm-cluster",
    "llama3_dp2_run": "llama3-dp2-run",
}


#: the suffix of the group of a group's alone tests
ALONE = "+alone"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: under xdist, runs with no other test running (it times something)")


def is_worker(config: pytest.Config) -> bool:
    """This process is an xdist worker (a pytest started inside a test, which inherits the
    worker's environment, is not)."""
    return hasattr(config, "workerinput")


def group_of(item: pytest.Item) -> str:
    """The xdist group of a test: the heavy session fixture it uses, else its file."""
    for name in item.fixturenames:  # type: ignore[attr-defined]
        if name in SHARED:
            return SHARED[name]
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into the node ids
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not is_worker(config):
        return
    by_file: dict[str, set[str]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], set()).add(group_of(item))
    for item in items:
        # a file whose tests fall in two groups (some use a shared fixture, some not) stays whole
        groups = sorted(by_file[item.nodeid.split("::", 1)[0]])
        if not any(m.name == "xdist_group" for m in item.iter_markers()):
            group = next((g for g in groups if g in SHARED.values()), groups[0])
            item.add_marker(pytest.mark.xdist_group(group + ALONE if _is_alone(item) else group))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """``--dist loadgroup`` with each group's alone tests last (alone_last); any other ``--dist``
    as xdist has it."""
    return alone_last()(config, log) if config.getoption("dist") == "loadgroup" else None


def alone_last() -> type:
    """The scheduler class (xdist imported here: the suite collects without it)."""
    from xdist.scheduler import LoadGroupScheduling

    return type("AloneLast", (_AloneLast, LoadGroupScheduling), {})


class _AloneLast:
    """xdist's loadgroup, but a ``<group>+alone`` unit is held back until no other unit is left
    to hand out, then goes to the worker that was given ``<group>`` (any worker when none was, or
    when that worker is gone). A worker with nothing left, its own or unowned, is shut down."""

    workqueue: OrderedDict[str, dict[str, bool]]
    assigned_work: dict
    registered_collections: dict

    def __init__(self, config: pytest.Config, log=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, log)  # type: ignore[call-arg]
        self.held: OrderedDict[str, dict[str, bool]] = OrderedDict()
        self.owner: dict[str, object] = {}  # group -> the worker given it

    @property
    def tests_finished(self) -> bool:
        return not self.held and super().tests_finished

    @property
    def has_pending(self) -> bool:
        return bool(self.held) or super().has_pending

    def _hold(self) -> None:
        for scope in [s for s in self.workqueue if s.endswith(ALONE)]:
            self.held[scope] = self.workqueue.pop(scope)

    def _held_for(self, node) -> list[str]:  # type: ignore[no-untyped-def]
        def taker(scope: str) -> bool:
            owner = self.owner.get(scope[: -len(ALONE)])
            return owner is node or owner not in self.assigned_work

        return [s for s in self.held if taker(s)]

    def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
        self._hold()
        if self.workqueue:
            self.owner[next(iter(self.workqueue))] = node
            super()._assign_work_unit(node)
            return
        mine = self._held_for(node)
        if not mine:
            node.shutdown()
            return
        collection = self.registered_collections[node]
        for scope in mine:  # all at once: on the worker they follow each other and keep the window
            unit = self.held.pop(scope)
            self.assigned_work[node][scope] = unit
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in unit.items() if not done])

    def _reschedule(self, node) -> None:  # type: ignore[no-untyped-def]
        if node.shutting_down:
            return
        self._hold()
        if self.workqueue and self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)


def _lock_dir(config: pytest.Config) -> Path:
    """A folder every worker of this test run finds (the run's id is the same in each)."""
    folder = Path(tempfile.gettempdir()) / f"flagbench-xdist-{config.workerinput['testrunuid']}"  # type: ignore[attr-defined]
    folder.mkdir(exist_ok=True)
    return folder


#: the gate and running files of an ``alone`` test whose next test on this worker is also
#: ``alone``: it hands its exclusive hold on, so the other worker does not start a test between
_held: list[tuple[IO[str], IO[str]]] = []


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Every test holds the shared lock while it runs (setup to teardown); an ``alone`` test
    the exclusive one. An ``alone`` test first takes the gate, which a test about to start
    passes through, so no test starts while it waits for the running one to end. Consecutive
    ``alone`` tests of a worker keep the exclusive hold from one to the next."""
    if not is_worker(item.config):
        yield
        return
    alone = _is_alone(item)
    if alone and _held:
        gate, running = _held.pop()
    else:
        folder = _lock_dir(item.config)
        gate, running = open(folder / "gate", "a"), open(folder / "running", "a")
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(running, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(running, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if alone and _is_alone(nextitem):
            _held.append((gate, running))
        else:
            fcntl.flock(running, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
            gate.close()
            running.close()
