"""Runs whose start_task.py ended without finishing them (a SIGKILL, a second stop signal):
found from this machine's side. ``writer.json`` beside a run's results.json names the machine,
the process that writes it and that process's start (so a reused pid is not taken for it);
``--cleanup`` finishes, as failed, a results.json still saying running whose writer is gone."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from run_benchmarks.errors import InputError

if TYPE_CHECKING:
    from run_benchmarks.typed_results import RunResults

WRITER = "writer.json"


def process_start(pid: int) -> str | None:
    """When process ``pid`` of this machine started (the boot and the kernel's clock ticks
    since it, else psutil's start time); None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        import psutil  # no /proc: another kernel

        try:
            return f"{psutil.Process(pid).create_time():.2f}"
        except psutil.Error:
            return None
    except OSError:
        return None
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, starttime


def record(run_dir: Path) -> None:
    """``writer.json`` in ``run_dir``: this process as the writer of its results.json."""
    mark = {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid())}
    (run_dir / WRITER).write_text(json.dumps(mark) + "\n")


def _writer(run_dir: Path) -> dict[str, Any] | None:
    try:
        said = json.loads((run_dir / WRITER).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(said, dict) and isinstance(said.get("host"), str) and isinstance(said.get("pid"), int)
    return said if ok else None


def left_running(run_dir: Path) -> RunResults | None:
    """The run's results.json (typed) when it still says running, else None (finished, missing,
    or not a results.json: nothing of ours to finish)."""
    from run_benchmarks import typed_results

    try:
        res = typed_results.load(run_dir / "results.json")
    except InputError:
        return None
    return None if res.finished or res.status != "running" else res


def mark_failed(run_dir: Path, res: RunResults, error: str) -> None:
    """``res``, a results.json left running, written back finished as failed with ``error``
    (an OSError of the write is the caller's)."""
    from run_benchmarks.judging import results

    finished = dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")
    results.write(res.model_copy(update={"status": "failed", "error": error, "finished": finished}), run_dir)


def finish(run_dir: Path, res: RunResults, error: str) -> str:
    """``mark_failed``, and the line saying what became of the file."""
    path = run_dir / "results.json"
    try:
        mark_failed(run_dir, res, error)
    except OSError as exc:
        return f"{path}: still says running, and cannot be written ({exc.strerror or exc})"
    return f"{path}: finished as failed (it said running): {error}"


def _alive(w: dict[str, Any]) -> bool:
    """The writer ``w`` names still runs here (the same start, where it was recorded)."""
    now = process_start(w["pid"])
    return now is not None if w.get("started") is None else now == w["started"]


def run_folders(log_dir: Path) -> list[Path]:
    """The run folders in ``log_dir`` (or ``log_dir`` itself, a run folder)."""
    if (log_dir / "results.json").is_file():
        return [log_dir]
    return sorted(p.parent for p in log_dir.glob("*/results.json"))


def finish_left(log_dirs: list[Path], looked_at: str | None) -> list[str]:
    """A line for each results.json under ``log_dirs`` still saying running: finished as failed
    when its writer is gone from this machine, else why it was left. ``looked_at``: the backend
    whose hosts this cleanup went through first (a run on other hosts is left)."""
    here = socket.gethostname()
    lines = []
    for run_dir in [d for log_dir in log_dirs for d in run_folders(log_dir)]:
        path = run_dir / "results.json"
        res = left_running(run_dir)
        if res is None:
            continue
        w = _writer(run_dir)
        if res.backend != "local" and res.backend != looked_at:
            lines.append(f"{path}: left running: its run was on {res.backend} hosts, not looked at (give --cluster FILE of them)")
        elif w is None:
            lines.append(f"{path}: left running: it names no writer ({WRITER}), so whether its start_task.py is gone cannot be told")
        elif w["host"] != here:
            lines.append(f"{path}: left running: written on {w['host']}, not this host (--cleanup there finishes it)")
        elif _alive(w):
            lines.append(f"{path}: left running: its start_task.py (pid {w['pid']}) is still running")
        else:
            error = (
                f"start_task.py ended without finishing the run after {len(res.rounds)} round(s) (pid {w['pid']} on {here} gone); "
                "--cleanup found nothing of it left on the hosts"
            )
            lines.append(finish(run_dir, res, error))
    return lines
