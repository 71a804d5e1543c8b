"""Run a benchmark case: ``start_task.py --vendor V --case_name model:framework:hardware:nnodes:nprocs[:repeat]``.

Without --cluster the case runs here (the embedded default): this host, no SSH,
no container, the framework's own launcher in that framework's environment
(built once from vendors/<vendor>/<framework>/requirements.txt and cached).

To run on a cluster, write a cluster YAML and pass it with --cluster:

    backend: ssh              # local | ssh | slurm
    runtime: container        # process | container (the vendor's image per framework)
    hosts:
      - {name: node1, address: 10.1.2.1}
      - {name: node2, address: 10.1.2.3}
    ssh: {user: root, port: 22, key_file: ~/.ssh/id_ed25519, known_hosts: ~/.ssh/known_hosts}
    master_port: 29500
    data_dir: /data/wudao
    log_dir: /var/log/flagbench

The first host is the rendezvous master.  Results land in <log-dir>/<run_id>/:
results.json, results.md, and per round the resolved config and every rank's log.
Every phase's loss is judged against its reference curve (docs/metrics.md). A round is
ok (ran fine, every phase aligned), unjudged (ran fine, a phase not judged: no reference,
steps missing), invalid (ran fine, a phase not aligned) or failed (a process error, a
missing record, a NaN or inf loss, the wrong device).
Exit status: 0 every round ok, 1 a round unjudged, invalid or failed, 2 bad input (nothing ran),
3 an unexpected error in the harness (one line; its traceback in the file that line names),
128 + the signal when stopped by Ctrl-C (130), SIGTERM (143) or SIGHUP (129).

start_task.py --verify RESULTS.json [...] recomputes every figure of a results.json from
its per-step records and names any mismatch: exit 0 all match, 1 a mismatch, 2 unreadable.

Real data (--data-dir) is checked whole before anything starts (docs/datasets.md): a missing,
truncated or out-of-vocabulary file is exit 2 naming it. A reference curve belongs to the data
it was made on: start_task.py --record-reference RUN/results.json makes a run's curves the case's
reference for its data and config (several runs of one config: their mean, with the runs and
their spread, the gate's noise floor); start_task.py --compare RUN_A RUN_B [...] sets runs side by
side (a table here, Markdown and an HTML page with the loss curves overlaid).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console

from run_benchmarks.errors import InputError, crash_report, parse_args
from run_benchmarks.judging import results
from run_benchmarks.planning import code_version, options
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.planning.config import ClusterConfig, load
from run_benchmarks.running.runtimes import select
from run_benchmarks.running.runtimes.base import stop_on_signals


def describe(plan: planning.Plan, rnd: planning.RoundPlan, details: dict | None = None, judged_by: list[str] | None = None) -> str:
    d = plan.to_json(rnd)
    m, hw = d["model"], d["hardware"]
    lines = [
        f"case        {d['case']}  (vendor {d['vendor']}, config {d['config_name']}{'' if d['validated'] else ', not yet validated'})",
        f"recipe      {d['recipe']}",
        *(f"judged by   {line}" for line in judged_by or []),
        f"backend     {d['backend']}  runtime {d['runtime']}  launcher {d['launcher']}",
        f"hosts       {', '.join(h['name'] + '=' + h['address'] for h in d['hosts'])}",
        f"python      {d['python']}",
        f"model       params exact {m['params_exact']:,}  nominal {m['params_nominal']:.3g}",
        f"FLOPs/token 6N {m['flops_per_token_6n']:.4g}  PaLM {m['flops_per_token_palm']:.4g}",
        f"hardware    {hw['chip']} {hw['precision']} peak {'unknown' if hw['peak_flops'] is None else format(hw['peak_flops'], '.4g') + ' FLOP/s'}",
        f"overrides   {', '.join(o['param'] + '=' + str(o['value']) for o in d['overrides']) or 'none'}",
    ]
    if d["user_overrides"]:
        lines.append(f"user set    {', '.join(o['param'] + '=' + str(o['value']) for o in d['user_overrides'])}")
    for n in d["nodes"]:
        env = " ".join(f"{k}={v}" for k, v in sorted(n["env"].items()))
        lines.append(f"node {n['node_rank']} @ {n['host']}: env {env}")
        lines.append("  " + " ".join(n["command"]))
    for key, value in (details or {}).items():
        text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str)
        lines.append(f"{key}:")
        lines += ["  " + ln for ln in text.splitlines()]
    return "\n".join(lines)


def _printed(lines_of: Callable[[], list[str]]) -> int:
    """Print a host command's lines; exit 2 on bad input."""
    try:
        lines = lines_of()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def cleanup_command(argv: list[str]) -> int:
    """``flagbench cleanup [--cluster FILE] [--log-dir DIR]`` (``start_task.py --cleanup``): remove
    the containers and processes earlier runs left on the hosts, bring back their run folders
    there into the runs' folders here before removing them, or cancel the Slurm jobs of runs whose
    start_task.py is gone; then finish a results.json left running whose start_task.py is gone.
    One line per host and per such run; exit 2 on bad input."""
    ap = argparse.ArgumentParser(prog="flagbench cleanup", description=cleanup_command.__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", metavar="FILE", help="cluster YAML whose hosts (ssh) or jobs (slurm) to clean")
    ap.add_argument(
        "--log-dir",
        "--log_dir",
        dest="log_dirs",
        action="append",
        metavar="DIR",
        help="a folder of run folders, or a run folder (repeatable; default: the cluster's log_dir, else ./logs)",
    )
    args = parse_args(ap, argv)
    return args if isinstance(args, int) else _printed(lambda: cleanup(args.cluster, args.log_dirs))


def load_images_command(argv: list[str]) -> int:
    """``flagbench load-images [ARCHIVE] --cluster FILE --vendor V`` (``start_task.py
    --load-images``): put the vendor's base images on every host that lacks them (hosts without a
    registry), from ARCHIVE (a docker save file), else from this machine's docker engine. One line
    per host; exit 2 on bad input."""
    ap = argparse.ArgumentParser(prog="flagbench load-images", description=load_images_command.__doc__.split("\n\n")[0])
    ap.add_argument(
        "archive", nargs="?", metavar="ARCHIVE", help="a docker save file of the images (default: this machine's docker engine)"
    )
    ap.add_argument("--cluster", metavar="FILE", help="cluster YAML (backend ssh) of the hosts to load them on")
    ap.add_argument("--vendor", help="vendor folder under vendors/ (whose Dockerfiles name the base images)")
    args = parse_args(ap, argv)
    if isinstance(args, int):
        return args

    def lines() -> list[str]:
        if not args.cluster:
            raise InputError("--load-images needs --cluster FILE (the hosts to load them on)")
        if not args.vendor:
            raise InputError("--load-images needs --vendor (whose Dockerfiles name the base images)")
        check_name(args.vendor, "vendor")
        from run_benchmarks.running.runtimes.ssh import load_base_images

        return load_base_images(load(ClusterConfig, args.cluster), args.vendor, None, Path(args.archive) if args.archive else None)

    return _printed(lines)


def cleanup(cluster_file: str | None, log_dirs: list[str] | None) -> list[str]:
    """``--cleanup``: the cluster's hosts first (ssh, slurm), then the runs in the log folders
    left running by a start_task.py gone from this machine (running/orphans.py)."""
    from run_benchmarks.running import orphans

    cluster = load(ClusterConfig, cluster_file) if cluster_file else ClusterConfig()
    lines: list[str] = []
    if cluster.backend == "slurm":
        from run_benchmarks.running.runtimes.slurm import clean_jobs

        lines = clean_jobs(cluster) or ["no Slurm job of a run whose start_task.py is gone"]
    elif cluster.backend == "ssh":
        from run_benchmarks.running.runtimes.ssh import clean_hosts

        lines = clean_hosts(cluster) or ["nothing left on the hosts"]
    for d in log_dirs or []:
        if not Path(d).expanduser().is_dir():
            raise InputError(f"--log-dir {d}: no such folder")
    dirs = [Path(d).expanduser().resolve() for d in log_dirs or [cluster.log_dir or "logs"]]
    left = orphans.finish_left([d for d in dirs if d.is_dir()], cluster.backend if cluster_file else None)
    if not left and not cluster_file:
        left = [f"no results.json left running in {', '.join(map(str, dirs))}"]
    return lines + left


class Crashed(Exception):
    """An unexpected error once the plan names the run folder, where its traceback goes."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(str(run_dir))
        self.run_dir = run_dir


def main(argv: list[str] | None = None) -> int:
    """The command line; an error nobody foresaw is one line and exit 3, never a traceback."""
    try:
        return _main(argv)
    except Crashed as crash:
        print(crash_report(crash.__cause__ or crash, crash.run_dir), file=sys.stderr)
        return 3
    except Exception as exc:
        print(crash_report(exc, None), file=sys.stderr)
        return 3


def _main(argv: list[str] | None) -> int:
    t0 = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    from run_benchmarks import cli

    aliased = cli.aliased(argv)  # start_task.py --verify F is flagbench verify F, and so on
    if aliased is not None:
        return cli.COMMANDS[aliased[0]].run(aliased[1])
    args = options.parser(__doc__).parse_args(argv)
    try:
        if args.json and not args.dry_run:
            raise InputError("--json is only valid with --dry-run")
        check_name(args.vendor, "vendor")
        code_version.sent_code_version()  # what results.json will name: a mistyped FLAGBENCH_CODE_VERSION is bad input, before anything runs
        cn = CaseName.parse(args.case_name)
        cluster = options.load_cluster(args)
        log_dir = Path(args.log_dir or cluster.log_dir or "logs").expanduser().resolve()
        plan = planning.build(
            cn,
            args.vendor,
            cluster,
            log_dir,
            planning.check_variant(args.variant),
            args.sets,
            args.data_dir,
            args.recipe,
            references=planning.reference_files(args.reference),
            command=["run_benchmarks/start_task.py", *argv],
        )  # the data read whole: a bad file is bad input, before anything runs
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(plan, args, t0)
    except Exception as exc:
        raise Crashed(plan.run_dir) from exc


def _run(plan: planning.Plan, args: argparse.Namespace, t0: float) -> int:
    """The planned run: its references checked, then printed (--dry-run) or run round by round."""
    from run_benchmarks.judging import loss_gate
    from run_benchmarks.planning import datacheck, references
    from run_benchmarks.running import orchestrator

    console = Console(stderr=True)
    try:
        said = console if args.json else Console()  # with the plan and the table, on stdout; beside --json's, on stderr
        for line in datacheck.describe(plan.data):
            said.print(line, markup=False, soft_wrap=True)
        for note in loss_gate.reference_notes(references.curves_of(plan.references)):
            console.print(note, markup=False, soft_wrap=True)
        runtime = select(plan.cluster, args.python)
        if args.dry_run:
            rnd = runtime.dry_round(plan)
            judged_by = references.judging(plan)
            out = {**plan.to_json(rnd), "judged_by": judged_by, "runtime_details": runtime.dry_run_details(plan, rnd)}
            print(json.dumps(out, indent=2, default=str) if args.json else describe(plan, rnd, out["runtime_details"], judged_by))
            return 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = None
    try:
        with stop_on_signals(left_behind=runtime.left_behind) as stop:  # SIGTERM / SIGHUP tear down as Ctrl-C does
            res = orchestrator.run(plan, runtime, console, t0)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; finished rounds are kept in {plan.run_dir}", file=sys.stderr)
        return stop.exit_status if stop is not None else 130
    results.print_table(res, Console())
    print(f"results: {plan.run_dir / 'results.json'}")
    return 0 if res.rounds and all(r.status == "ok" for r in res.rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
