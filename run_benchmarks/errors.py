"""Errors of the host side.  ``InputError`` means bad input: exit status 2."""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a case name, a config file, a flag.

    The message is one line that names the file, field or host at fault.
    """


class RoundFailed(Exception):
    """A benchmark round did not complete; the message says why."""


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """A command's arguments, or the exit status argparse ended with: 0 after --help, 2 on a
    usage error (bad input)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2


#: where an unexpected error's traceback goes when no run folder exists yet
CRASH_DIR = Path.home() / ".cache" / "flagbench" / "crashes"


def crash_report(exc: BaseException, run_dir: Path | None) -> str:
    """An unexpected error (a harness bug, an unforeseen failure) as one line; its traceback goes
    to ``harness-error.log`` in the run folder (else under ``CRASH_DIR``), which the line names."""
    text = "".join(traceback.format_exception(exc))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in ([run_dir / "harness-error.log"] if run_dir is not None else []) + [CRASH_DIR / f"{stamp}-{os.getpid()}.log"]:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            where = f"the traceback is in {path}"
            break
        except OSError:
            continue
    else:
        where = "the traceback could not be written to a file"
    lines = str(exc).strip().splitlines()
    return f"error: unexpected {type(exc).__name__}" + (f": {lines[0]}" if lines else "") + f" ({where})"
