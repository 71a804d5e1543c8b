"""Runs a planned case round by round and turns its logs into results."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from run_benchmarks import typed_results
from run_benchmarks.errors import InputError
from run_benchmarks.judging import metrics, results, rounds
from run_benchmarks.planning import code_version, datacheck, hostdata
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.plan import Plan
from run_benchmarks.planning.registry import shown
from run_benchmarks.running import causes, orphans, progress
from run_benchmarks.running.monitors import monitor_summary
from run_benchmarks.running.runtimes.base import NodeOutcome, Runtime
from run_benchmarks.typed_results import RoundResult, RunResults
from training import metriclog as ml

TAIL_LINES = 20


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def metric_files(node_dir: Path) -> list[Path]:
    """Per-rank logs written by the launcher (the metric lines' source)."""
    ranks = node_dir / "ranks"
    files = sorted(p for p in ranks.rglob("*") if p.is_file()) if ranks.is_dir() else []
    if not files and (node_dir / "stdout.log").is_file():
        files = [node_dir / "stdout.log"]
    return files


#: a Python warning's first line ("file.py:12: UserWarning: ..."); its source line follows, indented
_WARNING = re.compile(r":\d+: \w*Warning: ")


def tail(path: Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines of a log, its Python warnings (a framework's UserWarnings) left out."""
    if not path.is_file():
        return ""
    lines, kept = path.read_text(encoding="utf-8", errors="replace").splitlines(), []
    for i, line in enumerate(lines):
        if _WARNING.search(line) or (line[:1].isspace() and i and _WARNING.search(lines[i - 1])):
            continue
        kept.append(line)
    return "\n".join(kept[-n:])


def _failed_rank_tail(outcome: NodeOutcome) -> str:
    """The last lines of the first rank log that reports an error, else the node's stdout."""
    for f in metric_files(outcome.node_dir):
        text = f.read_text(encoding="utf-8", errors="replace")
        if "Traceback" in text or "Error" in text:
            return f"{f.relative_to(outcome.node_dir.parent)}:\n{tail(f)}"
    return f"{outcome.node_dir.name}/stdout.log:\n{tail(outcome.node_dir / 'stdout.log')}"


def _used_gpus(plan: Plan, nodes: Sequence[planning.NodePlan], node_rank: int) -> set[int] | None:
    """The device indices a node's ranks used: those its visible-devices variable names, else the
    first ``nprocs`` (one per local rank); None (all) when the variable names them otherwise."""
    var = plan.vendor.visible_devices_env
    env = next((n.env for n in nodes if n.node_rank == node_rank), {})
    value = env.get(var) if var else None
    if value is None and var and plan.cluster.backend == "local":
        value = os.environ.get(var)
    if value is None:
        return set(range(plan.case.nprocs))
    try:
        return {int(x) for x in value.split(",") if x.strip()}
    except ValueError:  # device UUIDs: the monitor's indices cannot be matched
        return None


def _first_line(text: str | None) -> str:
    return next(iter((text or "").strip().splitlines()), "")


def _process_errors(plan: Plan, outcomes: list[NodeOutcome], parsed: ml.ParsedLog, monitors: dict[int, dict[str, Any] | None]) -> list[str]:
    """What the processes say made a round fail: a node's exit, a stop, a stall, a rank's error
    (judging adds what the records lack: judging/rounds.py).

    The root cause first: the round deadline, the stall or the startup timeout (the harness
    stopped the ranks: what they say after that is the stop's doing; after a stop of its own,
    where each rank waited), a rank killed by a signal, then the ranks' own exceptions
    (earliest first: later ones are mostly their peers' fall), then the nodes, a node that was
    only stopped because another failed last; the tail of the failing log closes the message.
    ``monitors``: each node's monitor summary, by node rank.
    """
    deadline, stalled, lost, killed, nodes, stopped, context = [], [], [], [], [], [], []
    rank_errors = sorted(parsed.of(ml.EV_ERROR), key=lambda e: e.t)
    # an error every node shares concerns the job (a time limit, a cancel), said once
    shared = len(outcomes) > 1 and len({o.error for o in outcomes}) == 1
    for o in outcomes:
        where = f"node{o.node_rank} ({o.host})"
        if shared and o.error and o.node_rank != outcomes[0].node_rank:
            continue
        said = o.error if shared else f"{where}: {o.error}"
        if shared and o.error and (causes.STALL_MARK in o.error or causes.STARTUP_MARK in o.error):
            # the harness's own stop, the same on every node: said once, naming the nodes it concerns
            named = [p for p in outcomes if p.extra.get(causes.BLAME_KEY)] or outcomes
            said = f"{', '.join(f'node{p.node_rank} ({p.host})' for p in named)}: {o.error}"
        if o.error and (causes.STALL_MARK in o.error or causes.STARTUP_MARK in o.error):
            stalled.append(said)  # the harness's own stop: what the ranks say after it is its doing
        elif o.error and o.extra.get(causes.LOST_KEY):
            lost.append(said)
        elif o.error:
            (stopped if o.error.startswith("stopped:") else nodes).append(said)
        elif o.timed_out:
            deadline.append(f"{where}: round deadline of {plan.cluster.round_timeout_s:.0f} s passed")
        elif o.returncode != 0:
            logs = "\n".join(causes.read(f) for f in [o.node_dir / "stdout.log", *metric_files(o.node_dir)])
            root = causes.launcher_root_cause(logs)
            if root and root[1].startswith("killed"):
                rank = "?" if root[0] is None else root[0]
                frames = causes.fatal_signal_frames(logs)
                at = f" in {causes.describe(frames)}" if frames else ""
                killed.append(f"rank {rank} on {where} {root[1]}{at}{causes.memory_hint(monitors.get(o.node_rank))}")
            sig = None if root else causes.exit_signal(o.returncode)
            cause = None if rank_errors else causes.log_cause(logs)
            if sig and sig not in causes.STOP_SIGNALS:  # killed from outside (137: SIGKILL): the lost node
                hint = causes.memory_hint(monitors.get(o.node_rank))
                killed.append(f"{where}: killed by {sig} (exit status {o.returncode}){hint}" + (f": {cause}" if cause else ""))
            else:  # stopped by a signal after another failed: last
                said = f"{where}: exit status {o.returncode}" + (f" ({sig})" if sig else "") + (f": {cause}" if cause else "")
                (stopped if sig and not cause else nodes).append(said)
            context.append(_failed_rank_tail(o))
    ranks = [f"rank {e.rank}: {_first_line(e.value.get('message'))}" for e in rank_errors]
    hung = []
    if stalled:  # where each rank waited
        n = plan.case.nprocs
        for o in outcomes:
            ranks_here = list(range(o.node_rank * n, (o.node_rank + 1) * n))
            hung += causes.stall_stacks(o.node_dir, ranks_here, f"node{o.node_rank} ({o.host})")
    return deadline + stalled + hung + lost + killed + ranks + nodes + stopped + context


def evaluate_round(
    plan: Plan,
    round_no: int,
    outcomes: list[NodeOutcome],
    started: float,
    nodes: Sequence[planning.NodePlan] = (),
) -> RoundResult:
    """A round's raw outcome (its parsed logs, the monitors, what the processes said), handed to
    judging once (``nodes``: the round's node plans, whose environment names the devices each
    node used)."""
    parsed = ml.ParsedLog([], [])
    for o in outcomes:
        for f in metric_files(o.node_dir):
            parsed.extend(ml.parse_file(f))
    monitors = {o.node_rank: monitor_summary(o.node_dir / "monitor.jsonl") for o in outcomes}
    outcome = rounds.RoundOutcome(
        round_no=round_no,
        duration_s=round(time.monotonic() - started, 3),
        parsed=parsed,
        monitor_nodes=[(metrics.read_monitor(o.node_dir / "monitor.jsonl"), _used_gpus(plan, nodes, o.node_rank)) for o in outcomes],
        monitors=monitors,
        process_errors=_process_errors(plan, outcomes, parsed, monitors),
        nodes=[{"host": o.host, "node_rank": o.node_rank, "returncode": o.returncode, **o.extra} for o in outcomes],
    )
    return rounds.judge_round(plan, outcome)


def base_results(plan: Plan) -> RunResults:
    return RunResults(
        code_version=code_version.code_version(),
        run_id=plan.run_id,
        case=str(plan.case),
        model=plan.case.model,
        framework=plan.case.framework,
        vendor=plan.vendor.name,
        hardware=plan.case.hardware,
        nnodes=plan.case.nnodes,
        nprocs=plan.case.nprocs,
        world_size=plan.world_size,
        config_name=plan.config_name,
        config_file=shown(plan.config_file),  # repository-relative: results name no one machine's paths
        validated=plan.validated,
        recipe=plan.recipe,
        launcher=plan.launcher,
        backend=plan.cluster.backend,
        runtime="local" if plan.cluster.backend == "local" else plan.cluster.runtime,
        started=_now(),
        system=results.system_info(),
        settings=plan.settings,
        overrides=plan.overrides,
        hook=plan.hook,
        user_overrides=plan.user_overrides,
        command=plan.command,
        model_counts=plan.counts,
        hardware_info=plan.hardware,
        data=plan.data,
    )


def _node_times(o: NodeOutcome) -> tuple[float | None, float | None]:
    """When the node's launcher started and ended: the node agent's report, else the runtime's note."""
    report = o.node_dir / "node.json"
    if report.is_file():
        try:
            rep = json.loads(report.read_text())
            return rep.get("started"), rep.get("finished")
        except ValueError:
            pass
    return o.extra.get("launched_at"), o.extra.get("exited_at")


def orchestration_overhead(rnd: RoundResult, outcomes: list[NodeOutcome], begin: float, written: float) -> dict[str, Any] | None:
    """The harness's own time in a round, apart from the framework's start-up and shut-down.

    round begin (the command's start for round 1) -> last launcher started, plus last
    launcher exited -> results written.
    """
    times = [_node_times(o) for o in outcomes]
    spans = [metrics.phase_span(p.steps) for p in rnd.phases]
    spans = [s for s in spans if s is not None]
    if not spans or any(a is None or b is None for a, b in times):
        return None
    launched, exited = max(a for a, _ in times), max(b for _, b in times)
    first_start, last_end = min(a for a, _ in spans), max(b for _, b in spans)
    to_launch, after = launched - begin, written - exited
    return {
        "to_launch_s": round(to_launch, 3),
        "framework_startup_s": round(first_start - launched, 3),
        "framework_shutdown_s": round(exited - last_end, 3),
        "after_exit_s": round(after, 3),
        "overhead_s": round(to_launch + after, 3),
    }


def _hosts_took(plan: Plan, res: RunResults, reports: list[tuple[str, dict[str, Any]]]) -> tuple[Plan, RunResults]:
    """The plan and results with the data identities the hosts' reports give (hostdata.agree:
    InputError where the hosts disagree), written, and its new data lines said."""
    before, plan = plan.data or {}, dataclasses.replace(plan, data=hostdata.agree(plan, reports))
    res = res.model_copy(update={"data": plan.data})
    results.write(res, plan.run_dir)
    for line in datacheck.describe({ph: ident for ph, ident in (plan.data or {}).items() if ident != before.get(ph)}):
        print(line, flush=True)  # with the plan's data lines, on stdout
    return plan, res


def run(plan: Plan, runtime: Runtime, console: Console | None = None, t0: float | None = None) -> RunResults:
    """Run every round; ``t0`` (wall clock) is when the command started, for the overhead figure.

    The plan holds its references, read and checked as it was made (planning.plan.with_references,
    again when the hosts fingerprint its data): nothing here reads a reference file.
    """
    console = console or Console(stderr=True)
    t0 = t0 if t0 is not None else time.time()
    run_dir = plan.run_dir
    res = base_results(plan)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        orphans.record(run_dir)  # before results.json says running: --cleanup tells a writer gone from a live one
        results.write(res, run_dir)
    except OSError as exc:  # a full or read-only log folder: one line, nothing started
        raise InputError(f"{run_dir}: cannot write results there: {exc.strerror or exc}") from None
    stopped_by: BaseException | None = None
    try:
        with console.status(f"preparing {plan.case.framework} environment"):
            python, root = runtime.prepare(plan, run_dir / "env_build.log")
        spec = hostdata.node_spec(plan)
        if spec is not None and not runtime.data_in_rounds:  # data on the hosts only: fingerprinted there, then judged by it
            with console.status("checking the data on the hosts"):
                reports = runtime.host_data(plan, spec)
            if reports is not None:
                plan, res = _hosts_took(plan, res, reports)
            else:
                plan = dataclasses.replace(plan, data=hostdata.not_taken(plan, runtime.name))
                res = res.model_copy(update={"data": plan.data})
            plan = planning.with_references(plan)  # that data's, once recorded: a --reference of other data is refused
        if any(m["host_gib_per_node"] for m in plan.memory.values()):  # offload: do the hosts hold it?
            planning.check_host_memory(plan.memory, runtime.host_memory(), str(plan.config_file))
        res = res.model_copy(update={"python": python, "runtime_info": runtime.describe()})
        said_monitors: set[tuple[str, str]] = set()
        for r in range(1, plan.case.repeat + 1):
            round_dir = run_dir / f"round{r}"
            round_dir.mkdir(parents=True, exist_ok=True)
            rnd_plan = runtime.round_plan(plan, r, round_dir, python, root)
            (round_dir / "resolved.json").write_text(
                json.dumps(plan.resolved(r, str(round_dir / "output"), str(_cache_dir(plan, root))), indent=2)
            )
            for name, text in rnd_plan.nodes[0].files.items():  # launcher files (e.g. DeepSpeed's hostfile)
                (round_dir / name).write_text(text)
            (round_dir / "plan.json").write_text(json.dumps(plan.to_json(rnd_plan), indent=2, default=str))
            started = time.monotonic()
            begin = t0 if r == 1 else time.time()
            outcomes = _watched_round(plan, runtime, console, rnd_plan)
            if runtime.data_in_rounds and hostdata.hosted(plan.data):  # the round's nodes checked its data (a Slurm job)
                reports = runtime.round_data(plan, rnd_plan)
                if reports is not None:
                    plan, res = _hosts_took(plan, res, reports)
                    plan = planning.with_references(plan)  # that data's: a --reference of other data is refused
            rnd = evaluate_round(plan, r, outcomes, started, rnd_plan.nodes)
            full = _full_folder(run_dir) if rnd.status != "ok" else None
            if full and str(run_dir) not in _first_line(rnd.error or ""):  # the cause of the rank errors that follow
                lead = f"{run_dir}: this machine's log folder is full ({full}): the logs written there are cut short"
                rnd = rnd.model_copy(update={"error": "\n".join(filter(None, [lead, rnd.error]))})
            rnd = rnd.model_copy(update={"orchestration": orchestration_overhead(rnd, outcomes, begin, time.time())})
            res = res.model_copy(update={"rounds": [*res.rounds, rnd], "runtime_info": runtime.describe()})
            results.write(res, run_dir)
            # plain text: a rank's message may hold brackets that rich would read as markup
            shared = sorted({j for n in rnd.nodes for j in n.get(causes.SHARED_KEY) or []})
            note = f" (nodes shared with {', '.join(shared)}: the figures are not of whole nodes)" if shared else ""
            console.print(
                f"round {r}: {rnd.status}{note}" + (f" - {_first_line(rnd.error)}" if rnd.error else ""), markup=False, soft_wrap=True
            )
            if rnd.error:  # the whole first line above, the rest where it lies
                log = causes.rest_at(round_dir, _first_line(rnd.error))
                rest = f"; the rank's log: {log}" if log else ""
                console.print(f"  whole error: {run_dir / 'results.json'} (round {r}){rest}", markup=False, soft_wrap=True)
            for node, mon in sorted(rnd.monitor.items()):  # a device monitor that cannot run, said once a run
                if mon and mon.get("error") and (node, mon["error"]) not in said_monitors:
                    said_monitors.add((node, mon["error"]))
                    failed = f"{mon['failed_samples']} of {mon['samples']} samples"
                    console.print(
                        f"{node}: no device figures: {mon['error']} ({failed}; results.json has it)", markup=False, soft_wrap=True
                    )
    except BaseException as exc:
        stopped_by = exc
        raise
    finally:
        runtime.cleanup()
        outcome = typed_results.run_outcome(res.rounds, stopped_by, plan.case.repeat)
        res = res.model_copy(update={"runtime_info": runtime.describe(), "finished": _now(), **outcome})
        results.write(res, run_dir)
    return res


def _full_folder(folder: Path, probe_bytes: int = 1 << 16) -> str | None:
    """Why ``folder`` cannot take a small file now (its disk full, read-only), else None."""
    probe = folder / f".room-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(bytes(probe_bytes))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        probe.unlink(missing_ok=True)
    return None


#: how long after launch, with no rank training yet, the nodes are first asked whether they
#: reach the master (Runtime.unreached_master); again at the startup timeout
REACH_PROBE_AFTER_S = 60.0


def _unreached_master(runtime: Runtime) -> str | None:
    try:
        return runtime.unreached_master()
    except Exception:  # a probe must never end the watch of the round
        return None


#: how often the progress line is refreshed, and how often it is printed as a plain line
#: when the output is not a terminal (a CI log, a file); a runtime's note (a Slurm job's
#: state) is printed whenever it changes
PROGRESS_EVERY_S = 2.0
PLAIN_EVERY_S = float(os.environ.get("FLAGBENCH_PROGRESS_EVERY_S", "60"))
#: after the stall timeout, how long the orchestrator waits for the ranks' stack files
STACKS_GRACE_S = 10.0


def _watched_round(plan: Plan, runtime: Runtime, console: Console, rnd: planning.RoundPlan) -> list[NodeOutcome]:
    """``runtime.run_round`` with a live line: the runtime's note (a Slurm job's id, state and
    pending reason), the newest step (k of n, tokens/p/s, loss) and the time so far."""
    r, round_dir = rnd.number, rnd.dir
    title = f"round {r}/{plan.case.repeat}: {plan.case} on {len(rnd.nodes)} node(s)"
    steps = {ph: int(planning.phase_value(plan.settings["train"], ph, "steps") or 0) for ph in plan.phases}
    t0, begun = time.monotonic(), time.time()
    shown: dict[str, Any] = {"note": None, "plain_at": t0, "line": None, "probed": False}
    startup, stall = plan.cluster.startup_timeout_s, plan.cluster.stall_timeout_s
    probe_after = min(REACH_PROBE_AFTER_S, startup / 2)
    still = progress.Stillness()

    with console.status(title) as status:

        def tick() -> None:
            note = runtime.note()
            snaps = runtime.progress(round_dir)
            since = runtime.running_since() or begun
            waited = time.time() - since
            if not any(snaps) and not runtime.aborted and (waited > startup or (waited > probe_after and not shown["probed"])):
                shown["probed"] = True  # a node that cannot reach the master: named now, or with the startup timeout
                cut = _unreached_master(runtime)
                if cut and waited <= startup:
                    runtime.abort(f"{cut}; stopped {waited:.0f} s after launch, before any rank trained")
                elif waited > startup:
                    shown["blame"] = [i for i, snap in enumerate(snaps) if not snap]
                    runtime.abort(
                        (f"{cut}; " if cut else "")
                        + f"no rank started training within {startup:g} s of launch ({causes.STARTUP_MARK}): a node "
                        "that never joined the rendezvous, or a hang before the first record; stopped"
                    )
            idle = still.update(snaps, time.monotonic())
            # the ranks write their stacks when their call reaches the timeout; a few seconds
            # more and the files are there for the round's error (causes.stall_stacks)
            if idle is not None and idle > stall + STACKS_GRACE_S and not runtime.aborted:
                # the nodes write their progress and the harness reads it every 2 s each: stops
                # closer together than that cannot be told apart, and both nodes are named
                shown["blame"] = still.still_first(slack=progress.WRITE_EVERY_S + PROGRESS_EVERY_S)
                runtime.abort(f"no record from any rank for {stall:g} s {still.where()} ({causes.STALL_MARK}): the ranks hang; stopped")
            line = progress.line(snaps, steps, plan.world_size)
            text = ", ".join(filter(None, [note, line, progress.elapsed(t0)]))
            if console.is_terminal:
                status.update(f"{title}: {text}")
                return
            now = time.monotonic()
            if note and note != shown["note"]:  # a job's state changes rarely: each change is said
                console.print(f"round {r}: {note}", markup=False, highlight=False)
                shown["note"] = note
            if line and now - shown["plain_at"] >= PLAIN_EVERY_S:
                console.print(f"round {r}: {line} ({progress.elapsed(t0)})", markup=False, highlight=False)
                shown["plain_at"], shown["line"] = now, line

        def last_line() -> None:
            """In a log, the last step the nodes reached, unless just said: a round shorter than
            the plain-line interval still shows where it ended (or stopped)."""
            line = progress.line(runtime.progress(round_dir), steps, plan.world_size)
            if line and line != shown.get("line"):
                console.print(f"round {r}: {line} ({progress.elapsed(t0)})", markup=False, highlight=False)

        watch = progress.Watch(tick, PROGRESS_EVERY_S)
        watch.start()
        try:
            outcomes = runtime.run_round(plan, rnd, plan.cluster.round_timeout_s)
            for o in outcomes:  # the nodes the harness's stop concerns, named on its line
                if o.node_rank in shown.get("blame", ()) and o.error:
                    o.extra[causes.BLAME_KEY] = True
            return outcomes
        finally:
            watch.stop()
            if not console.is_terminal:
                progress.quietly(last_line)


def _cache_dir(plan: Plan, root: Path) -> Path:
    """Where a case writes its synthetic corpus: a cache shared across runs on that host."""
    from run_benchmarks.planning.registry import ROOT

    if root == ROOT:
        return Path.home() / ".cache" / "flagbench" / "data"
    return Path(plan.cluster.work_dir) / "cache" / "data"
