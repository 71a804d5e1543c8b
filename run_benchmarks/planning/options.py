"""The options of a run (``start_task.py`` / ``flagbench run``) and the cluster they name.

Shared by the run command and ``--ceiling``, which resolves a case's config as a run does.
"""

from __future__ import annotations

import argparse

from run_benchmarks.planning.casename import GRAMMAR
from run_benchmarks.planning.config import ClusterConfig, cluster_with, load, parse_duration


def parser(doc: str = "") -> argparse.ArgumentParser:
    """The run's options; ``doc``: what ``--help`` prints above them (its first paragraph) and below."""
    ap = argparse.ArgumentParser(
        prog="start_task.py",
        description=doc.split("\n\n")[0],
        epilog="\n\n".join(doc.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--vendor", required=True, help="vendor folder under vendors/ (nvidia, iluvatar, cpu, ...)")
    ap.add_argument("--case_name", "--case-name", dest="case_name", required=True, help=f"{GRAMMAR}, e.g. llama3_8b:megatron:A100:1:8")
    ap.add_argument("--variant", help="layout variant of the size's config, e.g. PP4DP2TP1 -> config_A100x1x8_PP4DP2TP1.yaml")
    ap.add_argument(
        "--recipe",
        default="standard",
        help="the training recipe: standard (the seeds' settings, default) or one the model names in its case.yaml, "
        "e.g. short (the short runs of the GPU measurements; its reference judges every layout and vendor)",
    )
    ap.add_argument("--cluster", metavar="FILE", help="cluster YAML (default: this host, no SSH, no container)")
    ap.add_argument(
        "--log-dir", "--log_dir", dest="log_dir", metavar="DIR", help="where run folders go (default: the cluster's log_dir, else ./logs)"
    )
    ap.add_argument(
        "--data-dir",
        "--data_dir",
        dest="data_dir",
        metavar="DIR",
        help="dataset folder (default: the cluster's data_dir, else a synthetic corpus)",
    )
    ap.add_argument("--python", metavar="PATH", help="use this Python as is instead of building the framework environment")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting for a shorter run, e.g. train.steps=20; VALUE is YAML: a scalar or a list of scalars, "
        "e.g. parallel.zero.leaf_modules=[DecoderLayer] (listed in the results as a user override)",
    )
    ap.add_argument(
        "--reference",
        metavar="FILE",
        action="append",
        default=[],
        help="compare the loss with this curve instead of the committed one: an earlier run's results.json "
        "(e.g. another parallel layout of the same case) or a {steps, loss} file; given several times (repeats "
        "of one config), with their per-step mean, not judged when they differ by 2%% or more among themselves "
        "(unless the run is more than twice that spread away from their mean, or 2%% or more from it over the early "
        "steps where they still agree within 2%%: not aligned)",
    )
    ap.add_argument("--round-timeout", type=float, metavar="S", help="deadline per round in seconds")
    ap.add_argument(
        "--startup-timeout",
        type=float,
        metavar="S",
        help="seconds from launch to the first rank's report before the round is stopped (default 900)",
    )
    ap.add_argument(
        "--stall-timeout",
        type=float,
        metavar="S",
        help="seconds without a new record from any rank, once one has reported, before the round is stopped "
        "as hung, the ranks' stacks named (default 1800)",
    )
    ap.add_argument(
        "--wait",
        nargs="?",
        const="1h",
        type=_duration,
        metavar="DURATION",
        help="when another run holds a host, wait for it (say 30m, 2h; alone: 1h) instead of being refused",
    )
    ap.add_argument(
        "--keep-remote",
        action="store_true",
        help="keep each host's <work_dir>/runs/<run> folder (removed once its logs are back, by default)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and execute nothing")
    ap.add_argument("--json", action="store_true", help="with --dry-run: print the plan as one JSON object")
    ap.add_argument("--nightly", metavar="RUNLIST.yaml", help="run a nightly run list instead of one case (see docs/nightly.md)")
    return ap


def load_cluster(args: argparse.Namespace) -> ClusterConfig:
    cluster = load(ClusterConfig, args.cluster) if args.cluster else ClusterConfig()
    return cluster_with(
        cluster,
        "command line",
        python=args.python,
        round_timeout_s=args.round_timeout,
        startup_timeout_s=args.startup_timeout,
        stall_timeout_s=args.stall_timeout,
        lock_wait_s=args.wait,
        keep_remote=args.keep_remote or None,
    )


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
