"""The root cause of a failed round, in one line, first.

A rank that dies takes its peers down with it: they report connection errors, their
launcher a traceback of its own, and a healthy node says it was stopped. What people need
is the first failure: the rank that was killed (and by what), or the exception it raised.
Sources, in order of trust: the launcher's own "Root Cause (first observed failure)" record
(torchrun), the ranks' ``run_error`` records (earliest first), a signal or exception line in
the node's logs.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

from training.case import STACK_DONE, STACK_LATE

_ROOT = re.compile(r"Root Cause \(first observed failure\):(?P<block>.*?)(?:={10,}|\Z)", re.S)
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RETURN_CODE = re.compile(r"(?:exits with return code|return code)\s*=\s*(-\d+)")
_EXCEPTION = re.compile(r"^(?:\[[^\]]*\]:?\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::.*)?)\s*$")
_ADDRESS = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


#: in a NodeOutcome's ``extra``: the node itself was lost (crashed, its engine, sshd or slurmd
#: gone, Slurm's NODE_FAIL); it leads the round's error, before the ranks that fell with it
LOST_KEY = "node_lost"
#: in a NodeOutcome's ``extra``: other jobs that ran on the node beside the round (a
#: scheduler's shared nodes): the round's figures are not of a whole node, said beside them
SHARED_KEY = "shared_with"
#: signals by which a node's processes are stopped (by the launcher, srun, the harness) after
#: something else failed: such an exit comes after the cause, never before it
STOP_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP"}


def exit_signal(code: int | None) -> str | None:
    """The signal a process died of: a negative return code (Python's subprocess), or 128+N
    (a shell's, Docker's, srun's): 137 is SIGKILL. None for an ordinary exit status."""
    if code is None or 0 <= code <= 128:
        return None
    try:
        return signal.Signals(-code if code < 0 else code - 128).name
    except ValueError:
        return None


def rest_at(round_dir: Path, first_line: str) -> Path | None:
    """The log under ``round_dir`` that holds the message of a round error's first line
    (what follows its "node0 (h1): ", "rank 3: " prefixes), for a reader who needs the rest."""
    message = re.sub(r"^(?:(?:node\d+ \([^)]*\)|rank \d+(?: on \S+ \([^)]*\))?):\s*)+", "", first_line).strip()
    if len(message) < 8:
        return None
    for path in sorted(round_dir.glob("node*/**/*")):
        if path.is_file() and path.suffix in (".log", ".txt") and message in read(path):
            return path
    return None


def launcher_root_cause(text: str) -> tuple[int | None, str] | None:
    """(rank, "killed by SIGKILL" / "exit status 1") from a launcher's summary, if it printed one."""
    m = _ROOT.search(text)
    if m:
        rank, code = _RANK.search(m["block"]), _EXIT.search(m["block"])
        if code:
            c = int(code[1])
            return (int(rank[1]) if rank else None), (f"killed by {_signal_name(c)}" if c < 0 else f"exit status {c}")
    m2 = _RETURN_CODE.search(text)
    if m2:  # DeepSpeed's launcher: "... exits with return code = -9"
        return None, f"killed by {_signal_name(int(m2[1]))}"
    return None


def log_cause(text: str) -> str | None:
    """The last exception line of a log, else an address-in-use line."""
    found = None
    for line in text.splitlines():
        m = _EXCEPTION.match(line.strip())
        if m and not m[1].startswith("torch.distributed.elastic"):  # the launcher's own wrapper
            found = m[1]
    if found:
        return found
    addr = next((ln.strip() for ln in text.splitlines() if _ADDRESS.search(ln)), None)
    return addr


def memory_hint(monitor: dict[str, Any] | None) -> str:
    """ "; likely out of host memory (peak X of Y GiB)" when the host was nearly full."""
    if not monitor or not monitor.get("host_mem_total_gib"):
        return ""
    peak, total = monitor["host_mem_peak_gib"], monitor["host_mem_total_gib"]
    return f"; likely out of host memory (peak {peak:.1f} of {total:.1f} GiB)" if peak >= 0.9 * total else ""


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


#: in a node's error: the round was stopped for want of records (orchestrator), so the
#: ranks' stack files say where they were
STALL_MARK = "stall_timeout_s"
STARTUP_MARK = "startup_timeout_s"
#: a node the harness's own stop concerns (its ranks never reported, or stood still first), in
#: NodeOutcome.extra: the stop's line, the same on every node, is said once with these nodes named
BLAME_KEY = "stop_concerns"
#: how Python's faulthandler begins its report of a fatal signal
FATAL_MARK = "Fatal Python error: "
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+?)\s*$')
#: frames of the project's own code, named from the repository root
_OWN = re.compile(r"(?:^|/)((?:cases|training)/.+)$")
#: where installed packages live: their frames are named from there, never as the project's
_PACKAGES = ("site-packages/", "dist-packages/")


def _own(path: str) -> str | None:
    """The path from the repository root of a frame of the project's code, else None."""
    if any(cut in path for cut in _PACKAGES):
        return None
    m = _OWN.search(path)
    return m[1] if m else None


def _short(path: str) -> str:
    own = _own(path)
    if own:
        return own
    for cut in _PACKAGES:
        if cut in path:
            return path.split(cut, 1)[1]
    return path.rsplit("/", 1)[-1]


def last_dump_main_thread(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (file, line, function; innermost first) in the last stack
    dump of a faulthandler file: the thread whose outermost frame is a module's top level;
    none when that dump's call ended after it (training/case.py's ``STACK_DONE`` line)."""
    if "Timeout (" not in text:
        return []
    dump = text.rsplit("Timeout (", 1)[-1]
    if any(line.startswith((STACK_DONE, STACK_LATE)) for line in dump.splitlines()):
        return []  # the call it caught ended after all (slow, not stuck), or it was written on resuming
    threads = [frames for _, frames in _threads(dump)]
    main = [t for t in threads if t and t[-1][2] == "<module>"]
    return main[-1] if main else (threads[0] if threads else [])


def _threads(dump: str) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """Each thread of a faulthandler dump: its header line (``Thread 0x...``, ``Current
    thread 0x...``) and its frames, innermost first, up to the first line that is no frame."""
    threads: list[tuple[str, list[tuple[str, int, str]]]] = []
    open_ = False
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ", "Stack ")):
            threads.append((line, []))
            open_ = True
        elif open_ and (m := _FRAME.match(line)):
            threads[-1][1].append((m["file"], int(m["line"]), m["func"]))
        elif threads and threads[-1][1]:
            open_ = False
    return threads


def stall_stacks(node_dir: Path, ranks: list[int], where: str) -> list[str]:
    """One line per rank of a node stopped as hung, or as never starting to train: where its
    main thread waited when its call reached the stall timeout, or came near the startup
    timeout (``stacks/rank<R>.txt``, training/case.py), and the project's frame it was called
    from; a rank that wrote nothing is named as such."""
    out = []
    for r in ranks:
        frames = last_dump_main_thread(read(node_dir / "stacks" / f"rank{r}.txt"))
        if not frames:
            out.append(
                f"rank {r} on {where}: no stack written by its timeout (a stopped process, or one that never reached it, writes none)"
            )
            continue
        out.append(f"rank {r} on {where}: waited in {describe(frames)}")
    return out


def describe(frames: list[tuple[str, int, str]]) -> str:
    """``func (file:line)`` of the innermost frame, and ``, called from`` the project's frame
    nearest to it where that is another."""
    file, line, func = frames[0]
    text = f"{func} ({_short(file)}:{line})"
    own = next(((f, ln, fn) for f, ln, fn in frames if _own(f)), None)
    if own and own != frames[0]:
        text += f", called from {own[2]} ({_short(own[0])}:{own[1]})"
    return text


def fatal_signal_frames(text: str) -> list[tuple[str, int, str]]:
    """The crashing thread's frames (innermost first) in the last report Python writes to a
    process's stderr when a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) kills it:
    every rank runs with ``PYTHONFAULTHANDLER`` (run_benchmarks/planning/plan.py). None without one, or
    when the crash came in a thread with no Python frame."""
    if FATAL_MARK not in text:
        return []
    threads = _threads(text.rsplit(FATAL_MARK, 1)[1])
    return next((frames for header, frames in threads if header.startswith("Current thread ")), [])
