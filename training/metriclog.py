"""The one metric-log protocol of the harness: emitter and parser.

Every case writes structured lines to its standard output.  A line is the
prefix ``:::FBLOG`` followed by one JSON object with fixed fields::

    :::FBLOG {"v": 1, "run": "...", "t": 1732590000.123, "host": "n1",
              "rank": 0, "event": "step", "key": "train_step",
              "value": {...}, "caller": "train.py:120"}

Anything before the prefix on a line (launcher prefixes such as
``[default0]:``, ssh or docker noise) is ignored, and lines without the prefix
are skipped.  :func:`parse_lines` is the only parser of this format in the
project; it never raises on bad input but returns the bad lines as errors.

This module uses the standard library only, so it can be imported by every
case inside every framework environment and by the host side alike.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import socket
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

PREFIX = ":::FBLOG"
VERSION = 1

# event types
EV_META = "meta"
EV_STEP = "step"
EV_MEMORY = "memory"
EV_END = "end"
EV_ERROR = "error"
EV_INFO = "info"
EVENTS = (EV_META, EV_STEP, EV_MEMORY, EV_END, EV_ERROR, EV_INFO)

# keys
K_RUN_META = "run_meta"  # value: dict, see REQUIRED_META
K_TRAIN_STEP = "train_step"  # value: dict, see REQUIRED_STEP
K_PEAK_MEMORY = (
    "peak_memory"  # value: {"peak_bytes": int, "total_bytes": int|None, "device": str[, "reserved_bytes": int][, "alloc_retries": int]}
)
K_RUN_END = "run_end"  # value: {"status": "ok"|"failed", "steps": int}
K_RUN_ERROR = "run_error"  # value: {"message": str}
K_STEP_BREAKDOWN = "step_breakdown"  # info; value: training.profiling.breakdown() of one profiled step
K_CONFORMANCE = "conformance"  # info from rank 0 before training; value: training.conformance.check()'s verdict
K_STARTUP = "startup"  # info from the reporting rank when its first step ends; value: training.startup.record()
K_KERNEL_CEILING = "kernel_ceiling"  # optional run_meta key, and info under --ceiling; value: training.ceiling.measure()

#: keys every ``run_meta`` value must carry
REQUIRED_META = (
    "model",  # name, e.g. llama3_8b
    "framework",
    "framework_version",
    "params_exact",
    "params_nominal",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_groups",
    "seq_length",
    "vocab_size",
    "global_batch",  # sequences per optimizer step
    "precision",
    "parallel",  # dict, e.g. {"tp": 2, "pp": 1, "dp": 4}
    "world_size",
)
#: keys every ``train_step`` value must carry; ``step_time_s`` follows training/steptimer.py
#: (batch fetch to the end of the optimizer step, synchronized across ranks), and every case
#: also sends ``data_s``, the part of it spent fetching the batch
REQUIRED_STEP = ("step", "loss", "tokens", "step_time_s", "lr")


@dataclasses.dataclass(frozen=True)
class Record:
    """One parsed protocol line."""

    run: str
    t: float
    host: str
    rank: int
    event: str
    key: str
    value: Any
    caller: str = ""
    source: str = ""  # the file or stream the line came from
    lineno: int = 0


@dataclasses.dataclass(frozen=True)
class ParseError:
    """A line that carried the prefix but could not be read."""

    source: str
    lineno: int
    line: str
    reason: str


@dataclasses.dataclass
class ParsedLog:
    records: list[Record]
    errors: list[ParseError]

    def of(self, event: str, key: str | None = None) -> list[Record]:
        return [r for r in self.records if r.event == event and (key is None or r.key == key)]

    def extend(self, other: ParsedLog) -> None:
        self.records.extend(other.records)
        self.errors.extend(other.errors)


def _check(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return "not a JSON object"
    for field in ("v", "event", "key", "value", "rank"):
        if field not in obj:
            return f"missing field {field!r}"
    if obj["v"] != VERSION:
        return f"unsupported version {obj['v']!r} (expected {VERSION})"
    if obj["event"] not in EVENTS:
        return f"unknown event {obj['event']!r}"
    if not isinstance(obj["rank"], int) or isinstance(obj["rank"], bool):
        return "rank is not an integer"
    if obj["key"] == K_RUN_META:
        if not isinstance(obj["value"], dict):
            return "run_meta value is not an object"
        missing = [k for k in REQUIRED_META if k not in obj["value"]]
        if missing:
            return f"run_meta lacks {', '.join(missing)}"
    if obj["key"] == K_TRAIN_STEP:
        if not isinstance(obj["value"], dict):
            return "train_step value is not an object"
        missing = [k for k in REQUIRED_STEP if k not in obj["value"]]
        if missing:
            return f"train_step lacks {', '.join(missing)}"
    return None


def parse_lines(lines: Iterable[str], source: str = "") -> ParsedLog:
    """Parse protocol lines out of arbitrary text; never raises on content."""
    out = ParsedLog([], [])
    for lineno, raw in enumerate(lines, 1):
        pos = raw.find(PREFIX)
        if pos < 0:
            continue
        body = raw[pos + len(PREFIX) :].strip()
        try:
            obj = json.loads(body)
        except ValueError as exc:
            out.errors.append(ParseError(source, lineno, raw.rstrip("\n"), f"bad JSON: {exc}"))
            continue
        reason = _check(obj)
        if reason:
            out.errors.append(ParseError(source, lineno, raw.rstrip("\n"), reason))
            continue
        out.records.append(
            Record(
                run=str(obj.get("run", "")),
                t=float(obj.get("t", 0.0)),
                host=str(obj.get("host", "")),
                rank=obj["rank"],
                event=obj["event"],
                key=obj["key"],
                value=obj["value"],
                caller=str(obj.get("caller", "")),
                source=source,
                lineno=lineno,
            )
        )
    return out


def parse_file(path: str | os.PathLike[str]) -> ParsedLog:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return parse_lines(fh, source=str(path))


class MetricLogger:
    """Writes protocol lines for one process.

    ``run`` and ``rank`` default to the ``FB_RUN_ID`` and ``RANK`` environment
    variables set by the harness and the framework launchers.
    """

    def __init__(self, run: str | None = None, rank: int | None = None, stream: IO[str] | None = None):
        self.run = run if run is not None else os.environ.get("FB_RUN_ID", "")
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.host = socket.gethostname()
        self.stream = stream if stream is not None else sys.stdout

    def emit(self, event: str, key: str, value: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}")
        frame = inspect.currentframe()
        caller = ""
        if frame is not None and frame.f_back is not None:
            back = frame.f_back
            if back.f_code.co_filename == __file__ and back.f_back is not None:
                back = back.f_back
            caller = f"{os.path.basename(back.f_code.co_filename)}:{back.f_lineno}"
        line = json.dumps(
            {
                "v": VERSION,
                "run": self.run,
                "t": round(time.time(), 6),
                "host": self.host,
                "rank": self.rank,
                "event": event,
                "key": key,
                "value": value,
                "caller": caller,
            },
            separators=(",", ":"),
            allow_nan=True,
        )
        # one write per line so that lines of concurrent ranks do not interleave
        self.stream.write(f"{PREFIX} {line}\n")
        self.stream.flush()

    def meta(self, phase: str | None = None, **value: Any) -> None:
        missing = [k for k in REQUIRED_META if k not in value]
        if missing:
            raise ValueError(f"run_meta lacks {', '.join(missing)}")
        self.emit(EV_META, K_RUN_META, _phased(value, phase))

    def step(self, step: int, loss: float, tokens: int, step_time_s: float, lr: float, phase: str | None = None, **extra: Any) -> None:
        value = {"step": step, "loss": loss, "tokens": tokens, "step_time_s": step_time_s, "lr": lr}
        self.emit(EV_STEP, K_TRAIN_STEP, {**_phased(value, phase), **extra})

    def peak_memory(
        self,
        peak_bytes: int,
        total_bytes: int | None,
        device: str,
        phase: str | None = None,
        reserved_bytes: int | None = None,
        alloc_retries: int | None = None,
    ) -> None:
        """The allocator's peak of this rank; ``reserved_bytes``: the most its cache held at once
        (allocated plus cached free blocks: what an out-of-memory margin is measured against), and
        ``alloc_retries``: how often it gave its cache back and asked the device again for want of a
        free block (training.accelerator.Accelerator.alloc_retries), each where the framework
        reports it (accelerators; not the CPU)."""
        value: dict[str, Any] = {"peak_bytes": int(peak_bytes), "total_bytes": total_bytes, "device": device}
        if reserved_bytes is not None:
            value["reserved_bytes"] = int(reserved_bytes)
        if alloc_retries is not None:
            value["alloc_retries"] = int(alloc_retries)
        self.emit(EV_MEMORY, K_PEAK_MEMORY, _phased(value, phase))

    def end(self, status: str, steps: int, phase: str | None = None) -> None:
        self.emit(EV_END, K_RUN_END, _phased({"status": status, "steps": steps}, phase))

    def error(self, message: str, phase: str | None = None) -> None:
        self.emit(EV_ERROR, K_RUN_ERROR, _phased({"message": message}, phase))

    def info(self, key: str, value: dict, phase: str | None = None) -> None:
        """An ``info`` record (``step_breakdown``, ``start_weights``, a case's own keys)."""
        self.emit(EV_INFO, key, _phased(value, phase))


def _phased(value: dict, phase: str | None) -> dict:
    """``value`` with ``"phase"`` when the record belongs to a named phase (a case without
    phases sends none: its records are the ``train`` phase's)."""
    return value if phase is None else {**value, "phase": phase}
