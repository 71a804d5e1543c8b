"""A round's live progress: the latest step record of the ranks' logs, as one line.

The node agent (SSH and Slurm runtimes) writes ``node<k>/progress.json`` every few seconds
from the tails of its ranks' logs; the local runtime's logs are read here directly. The
orchestrator turns the newest record into "step k/n, tokens/p/s, loss" in the terminal's
status line (or a plain line now and then when the output is not a terminal).

Standard library only: the node agent imports it on hosts and in containers.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from training import metriclog as ml

TAIL_BYTES = 64 * 1024  # a step line is a few hundred bytes: the newest is in the last 64 KiB
FILE = "progress.json"
WRITE_EVERY_S = 2.0


def tail_lines(path: Path, nbytes: int = TAIL_BYTES) -> list[str]:
    """The last complete lines of ``path`` within its last ``nbytes`` (none when unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            data = fh.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if size > nbytes else lines  # the first may be cut


def rank_logs(node_dir: Path) -> list[Path]:
    """The files a node's ranks write their metric lines to (the launcher's per-rank logs,
    else the node's stdout)."""
    ranks = node_dir / "ranks"
    files = [p for p in ranks.rglob("*") if p.is_file()] if ranks.is_dir() else []
    return files or [node_dir / "stdout.log"]


def latest(files: Iterable[Path]) -> dict[str, Any] | None:
    """The ranks' state from the files' tails: None before any rank reported; ``{"started":
    True}`` once one has sent its ``run_meta`` (the framework is up: every node joined the
    rendezvous); with the newest step record's phase, step, loss, tokens, step_time_s, t.
    ``last_t``: the time stamp of the newest record of any kind (a step, a phase's start or
    end, its memory), which the orchestrator watches for a round that has stopped moving."""
    best: ml.Record | None = None
    started = False
    last_t = None
    for f in files:
        parsed = ml.parse_lines(tail_lines(f))
        started = started or bool(parsed.of(ml.EV_META, ml.K_RUN_META))
        if parsed.records:
            last_t = max(last_t or 0.0, max(r.t for r in parsed.records))
        for r in parsed.of(ml.EV_STEP, ml.K_TRAIN_STEP):
            if best is None or r.t > best.t:
                best = r
    if best is None:
        return {"started": True, "last_t": last_t} if started else None
    v = best.value
    return {
        "started": True,
        "last_t": last_t,
        "phase": v.get("phase", "train"),
        "step": int(v["step"]),
        "loss": float(v["loss"]),
        "tokens": float(v["tokens"]),
        "step_time_s": float(v["step_time_s"]),
        "t": best.t,
    }


def write(node_dir: Path) -> None:
    """``node_dir/progress.json`` from the node's rank logs (replaced at once: readers never see half)."""
    snap = latest(rank_logs(node_dir))
    if snap is None:
        return
    tmp = node_dir / f".{FILE}.tmp"
    tmp.write_text(json.dumps(snap))
    os.replace(tmp, node_dir / FILE)


def read(node_dir: Path) -> dict[str, Any] | None:
    """A node's progress: its progress.json, else its rank logs read here."""
    try:
        return json.loads((node_dir / FILE).read_text())
    except (OSError, ValueError):
        return latest(rank_logs(node_dir))


def writer(node_dir: Path, every: float = WRITE_EVERY_S) -> Watch:
    """In the node agent: refresh progress.json every ``every`` seconds, and once more when
    stopped (the last step, for a reader that comes after the end)."""
    return Watch(lambda: write(node_dir), every, name="progress", final=True)


def line(snaps: Iterable[dict[str, Any] | None], steps: dict[str, int], world_size: int) -> str | None:
    """ "pretrain step 12/30, 1,234 tokens/p/s, loss 5.432" from the newest node snapshot;
    ``steps`` holds each phase's planned step count."""
    found = [s for s in snaps if s and "step" in s]
    if not found:
        return None
    s = max(found, key=lambda x: x["t"])
    phase = "" if s["phase"] == "train" else f"{s['phase']} "
    total = steps.get(s["phase"])
    tps = s["tokens"] / s["step_time_s"] / world_size if s["step_time_s"] > 0 else None
    parts = [f"{phase}step {s['step']}" + (f"/{total}" if total else "")]
    if tps is not None:
        parts.append(f"{tps:,.0f} tokens/p/s")
    parts.append(f"loss {s['loss']:.4g}")
    return ", ".join(parts)


class Stillness:
    """How long the nodes' progress has stood still: a node's snapshot moves when its newest
    step or its newest record of any kind changes; a node not read this time (None: its
    file unreadable for a moment) keeps what it said before. Times are the caller's clock
    (monotonic), never the ranks' own time stamps: the hosts' clocks need not agree."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[Any, ...]] = {}
        self.moved_at: float | None = None
        self.node_moved: dict[int, float] = {}  # node index -> when its snapshot last moved
        self.newest: dict[str, Any] | None = None
        self.nodes = 0  # how many nodes the snapshots are of

    def update(self, snaps: list[dict[str, Any] | None], now: float) -> float | None:
        """Seconds since the last move (None before any rank reported)."""
        self.nodes = max(self.nodes, len(snaps))
        for i, s in enumerate(snaps):
            if not s:
                continue
            key = (s.get("phase"), s.get("step"), s.get("last_t"))
            if self.seen.get(i) != key:
                self.seen[i], self.moved_at, self.node_moved[i] = key, now, now
            if "step" in s and (self.newest is None or s["t"] >= self.newest["t"]):
                self.newest = s
        return None if self.moved_at is None else now - self.moved_at

    def still_first(self, slack: float) -> list[int]:
        """The nodes whose progress stood still first (within ``slack`` s of the earliest: at
        least the time a move takes to be seen, since nodes that stop closer together than that
        are seen stopping in either order), and those never seen at all (a node whose ranks
        report no steps, holding none of the reporting ranks: when it stopped is not known)."""
        if not self.node_moved:
            return []
        first = min(self.node_moved.values())
        unseen = set(range(self.nodes)) - set(self.node_moved)
        return sorted(unseen | {i for i, t in self.node_moved.items() if t <= first + slack})

    def where(self) -> str:
        """ "after step 8", "after finetune step 3", or "before the first step"."""
        s = self.newest
        if s is None:
            return "before the first step"
        return f"after {'' if s['phase'] == 'train' else s['phase'] + ' '}step {s['step']}"


def quietly(fn: Callable[[], None]) -> None:
    """``fn()``, a failure skipped: progress must never fail a round."""
    try:
        fn()
    except Exception:
        pass


class Watch(threading.Thread):
    """Call ``tick`` every ``every`` seconds until stopped (and once more then if ``final``).
    The orchestrator's tick reads the runtime's note and the nodes' progress and shows them;
    the node agent's writes progress.json. A failed tick is skipped: progress must never fail
    a round, nor a full disk or a vanished folder stop a node."""

    def __init__(self, tick: Callable[[], None], every: float, name: str = "round-watch", final: bool = False) -> None:
        super().__init__(name=name, daemon=True)
        self.tick, self.every, self.final = tick, every, final
        self._halt = threading.Event()

    def _tick(self) -> None:
        try:
            self.tick()
        except Exception:
            pass

    def run(self) -> None:
        while not self._halt.wait(self.every):
            quietly(self.tick)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        if self.final:
            quietly(self.tick)


def elapsed(t0: float) -> str:
    s = int(time.monotonic() - t0)
    return f"{s // 60}:{s % 60:02d}"
