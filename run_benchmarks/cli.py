"""``flagbench <command>``: every tool of the harness under one name.

``flagbench --help`` lists the commands, ``flagbench <command> --help`` the options of one. Each
command is the same code as its older form, which keeps working:
``python run_benchmarks/start_task.py --vendor V --case_name C`` is ``flagbench run --vendor V
--case_name C``, ``start_task.py --verify F`` is ``flagbench verify F``, and so on; ``flagbench``
followed directly by options is ``flagbench run``.

The checkout a command works on is the one it runs inside, when it is one (a folder above the
working directory holding ``run_benchmarks/cli.py``, ``cases/`` and ``vendors/``), and otherwise
the installed one: run inside another checkout, the installed command runs that checkout's code
(:func:`checkout_of`), saying so on stderr, so its cases, vendors, references and scaffolds are
the ones read and written.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from run_benchmarks.planning.casename import GRAMMAR


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[list[str]], int]  # the command's arguments -> exit status
    usage: Callable[[], int]  # prints the command's own options


def _start(*flag: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from run_benchmarks import start_task

        return start_task.main([*flag, *argv])

    return run


def _module(name: str, *head: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        return int(importlib.import_module(f"run_benchmarks.{name}").main([*head, *argv]) or 0)

    return run


def _help(name: str, *head: str) -> Callable[[], int]:
    return lambda: _module(name, *head)(["--help"])


COMMANDS: dict[str, Command] = {
    "run": Command(f"run a case ({GRAMMAR}) and judge it", _start(), _help("start_task")),
    "verify": Command("recompute results.json files' figures and verdicts from their records", _start("--verify"), _help("judging.verify")),
    "judge": Command("judge finished runs against references (--update writes the verdict)", _start("--judge"), _help("judging.compare")),
    "compare": Command("set runs side by side against the last one", _start("--compare"), _help("judging.compare")),
    "record-reference": Command(
        "make runs the reference of their model, phase, recipe and data", _start("--record-reference"), _help("judging.compare")
    ),
    "ceiling": Command("measure a case's kernel ceiling on this host's first device", _start("--ceiling"), _help("tools.ceiling")),
    "conformance": Command(
        "check a case's math on this host's first device against float64 numpy",
        _start("--conformance"),
        _help("tools.conformance"),
    ),
    "nightly": Command("run a nightly run list and judge it against history", _start("--nightly"), _help("nightly.driver")),
    "cleanup": Command("clean the hosts, finish runs left running", _start("--cleanup"), lambda: _start()(["--cleanup", "--help"])),
    "load-images": Command(
        "put a vendor's images on a cluster's hosts", _start("--load-images"), lambda: _start()(["--load-images", "--help"])
    ),
    "scaffold-case": Command(
        "write a runnable tiny case", _module("tools.case_tools", "scaffold-case"), _help("tools.case_tools", "scaffold-case")
    ),
    "scaffold-vendor": Command(
        "write a vendor folder", _module("tools.vendor_tools", "scaffold-vendor"), _help("tools.vendor_tools", "scaffold-vendor")
    ),
    "scaffold-config": Command(
        "write a vendor's config of a case",
        _module("tools.vendor_tools", "scaffold-config"),
        _help("tools.vendor_tools", "scaffold-config"),
    ),
    "runs-table": Command(
        "write docs/results/runs.md from the committed results (--check: is it current)",
        _module("judging.runs_table"),
        _help("judging.runs_table"),
    ),
    "check": Command(
        "check a vendor folder: every problem, nothing run", _module("tools.vendor_tools", "check"), _help("tools.vendor_tools", "check")
    ),
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: flagbench <command> [options]   (flagbench <command> --help: its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {c.help}" for name, c in COMMANDS.items()]
    return "\n".join(lines)


#: set to the checkout a re-run command was handed to (so that it is not handed on again)
CHECKOUT_ENV = "FLAGBENCH_CHECKOUT"


def checkout_of(start: Path) -> Path | None:
    """The flagbench checkout ``start`` is inside, if any."""
    for folder in (start, *start.parents):
        if (folder / "run_benchmarks" / "cli.py").is_file() and (folder / "cases").is_dir() and (folder / "vendors").is_dir():
            return folder
    return None


def _hand_over(argv: list[str]) -> int | None:
    """Run the command with the checkout of the working directory, where that is not this code's
    own (an installed ``flagbench`` used inside another checkout); None to run it here."""
    from run_benchmarks.planning.registry import ROOT

    here = checkout_of(Path.cwd().resolve())
    if here is None or here == ROOT or os.environ.get(CHECKOUT_ENV) == str(here):
        return None
    print(f"flagbench: the checkout at {here} (the installed one is {ROOT})", file=sys.stderr, flush=True)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, CHECKOUT_ENV: str(here), "PYTHONPATH": str(here) + (os.pathsep + path if path else "")}
    import subprocess

    try:
        return subprocess.run([sys.executable, "-m", "run_benchmarks.cli", *argv], env=env).returncode
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    handed = _hand_over(argv)
    if handed is not None:
        return handed
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0].startswith("-"):  # the older form: start_task.py's own options
        return _start()(argv)
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"error: flagbench has no command {name!r}{hint} (flagbench --help lists them)", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        try:
            return command.usage()
        except SystemExit as exc:  # argparse's help
            return int(exc.code or 0)
    return command.run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
