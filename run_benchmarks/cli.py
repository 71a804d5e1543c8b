"""``flagbench <command>``: every tool of the harness under one name.

``flagbench --help`` lists the commands, ``flagbench <command> --help`` the options of one. Each
command is one function called with the command's own arguments (:data:`COMMANDS`).
``start_task.py`` is the ``run`` command, and its older flags stay aliases of the others
(:func:`aliased`): ``start_task.py --verify F`` is ``flagbench verify F``, and so on;
``flagbench`` followed directly by options is ``flagbench run``.

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
from dataclasses import dataclass
from pathlib import Path

from run_benchmarks.planning.casename import GRAMMAR


@dataclass(frozen=True)
class Command:
    help: str
    function: str  # "module:function" under run_benchmarks/, called with the command's own arguments
    alias: str | None = None  # start_task.py's flag for it (``--verify F`` is ``verify F``)
    guards_itself: bool = False  # reports its own unexpected errors (the run: its run folder takes the traceback)

    def run(self, argv: list[str]) -> int:
        """The command's exit status; an error nobody foresaw is one line and exit 3."""
        import importlib

        from run_benchmarks.errors import crash_report

        module, _, name = self.function.partition(":")
        call = getattr(importlib.import_module(f"run_benchmarks.{module}"), name)
        if self.guards_itself:
            return int(call(argv) or 0)
        try:
            return int(call(argv) or 0)
        except Exception as exc:
            print(crash_report(exc, None), file=sys.stderr)
            return 3


COMMANDS: dict[str, Command] = {
    "run": Command(f"run a case ({GRAMMAR}) and judge it", "start_task:main", guards_itself=True),
    "verify": Command("recompute results.json files' figures and verdicts from their records", "judging.verify:main", "--verify"),
    "judge": Command("judge finished runs against references (--update writes the verdict)", "judging.recording:judge_main", "--judge"),
    "compare": Command("set runs side by side against the last one", "judging.compare:compare_main", "--compare"),
    "record-reference": Command(
        "make runs the reference of their model, phase, recipe and data", "judging.recording:record_main", "--record-reference"
    ),
    "ceiling": Command("measure a case's kernel ceiling on this host's first device", "tools.ceiling:main", "--ceiling"),
    "conformance": Command(
        "check a case's math on this host's first device against float64 numpy", "tools.conformance:main", "--conformance"
    ),
    "nightly": Command("run a nightly run list and judge it against history", "nightly.driver:main", "--nightly"),
    "cleanup": Command("clean the hosts, finish runs left running", "start_task:cleanup_command", "--cleanup"),
    "load-images": Command("put a vendor's images on a cluster's hosts", "start_task:load_images_command", "--load-images"),
    "scaffold-case": Command("write a runnable tiny case", "tools.case_tools:scaffold_case_main"),
    "scaffold-vendor": Command("write a vendor folder", "tools.vendor_tools:scaffold_vendor_main"),
    "scaffold-config": Command("write a vendor's config of a case", "tools.vendor_tools:scaffold_config_main"),
    "runs-table": Command("write docs/results/runs.md from the committed results (--check: is it current)", "judging.runs_table:main"),
    "results-page": Command("write docs/results/README.md, the headlines (--check: is it current)", "judging.results_page:main"),
    "check": Command("check a vendor folder: every problem, nothing run", "tools.vendor_tools:check_main"),
}


def aliased(argv: list[str]) -> tuple[str, list[str]] | None:
    """start_task.py's older form of a command (its first flag that names one, ``--verify F`` or
    ``--verify=F``): the command and its arguments, the flag left out; None for a run."""
    flags = {c.alias: name for name, c in COMMANDS.items() if c.alias}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            return flags[flag], [*argv[:i], *([value] if eq else []), *argv[i + 1 :]]
    return None


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
    if argv[0].startswith("-"):  # the older form: start_task.py's own options (and its aliases)
        return COMMANDS["run"].run(argv)
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"error: flagbench has no command {name!r}{hint} (flagbench --help lists them)", file=sys.stderr)
        return 2
    return command.run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
