"""Nightly rounds: run a list of cases, keep the history, flag regressions, write a report.

``start_task.py --nightly RUNLIST.yaml`` or ``python -m run_benchmarks.nightly.driver RUNLIST.yaml``.
Every case goes through the same planning and orchestrator as start_task.py; the run list
format, the verdict and the exit statuses are in docs/nightly.md.

Exit status: 0 nothing regressed, 1 a case regressed or failed (listed), 2 bad run list
or flags (nothing ran), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import socket
import statistics
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from run_benchmarks import typed_results
from run_benchmarks.errors import InputError
from run_benchmarks.judging import loss_gate
from run_benchmarks.nightly import history
from run_benchmarks.nightly.runlist import RunList, RunListEntry, Tolerances, parse_runlist
from run_benchmarks.planning import code_version, references, registry
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.planning.config import ClusterConfig, cluster_with, load, parse_duration
from run_benchmarks.running import orchestrator
from run_benchmarks.typed_results import RunResults, environment_changes, recorded_environment

EXIT_OK, EXIT_REGRESSED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclasses.dataclass
class NightlyCase:
    index: int
    entry: RunListEntry
    plan: planning.Plan
    tolerances: Tolerances
    hardware_key: str
    reference_notes: list[str] = dataclasses.field(default_factory=list)  # what its references can judge (loss_gate.resolution_note)


@dataclasses.dataclass
class Night:
    path: Path
    text: str
    runlist: RunList
    cluster: ClusterConfig
    log_dir: Path
    db_path: Path
    report_dir: Path
    jobs: list[NightlyCase]


WAIT_S = 3600.0  # how long a night's case waits for a host another run holds (--wait)


def _resolve(base: Path, p: str) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() else (base / q).resolve()


def prepare(
    path: Path, db: str | None = None, log_dir: str | None = None, report_dir: str | None = None, wait_s: float | None = None
) -> Night:
    """Validate the run list and plan every case; raises InputError, writes nothing. Each case
    waits for hosts another run holds (``wait_s``; default: the cluster file's
    ``lock_wait_s``, else ``WAIT_S``), so a night queues behind a run instead of failing."""
    code_version.sent_code_version()  # what every results.json will name
    rl = parse_runlist(path)
    base = path.resolve().parent
    cluster = load(ClusterConfig, _resolve(base, rl.cluster)) if rl.cluster else ClusterConfig()
    wait_s = wait_s if wait_s is not None else cluster.lock_wait_s or WAIT_S
    cluster = cluster_with(
        cluster, str(path), python=rl.python, round_timeout_s=rl.round_timeout_s, stall_timeout_s=rl.stall_timeout_s, lock_wait_s=wait_s
    )
    logs = Path(log_dir).expanduser().resolve() if log_dir else _resolve(base, rl.log_dir)
    jobs = []
    for i, e in enumerate(rl.cases):
        cn = dataclasses.replace(CaseName.parse(e.case), repeat=e.rounds)
        try:
            refs_given = planning.reference_files(e.reference, base, "reference")
            # its references read and checked: a curve that cannot judge the case is bad input, nothing runs
            plan = planning.build(cn, e.vendor, cluster, logs, e.variant, list(e.sets), recipe=e.recipe, references=refs_given)
        except InputError as exc:
            raise InputError(f"{path}: field 'cases.{i}' ({e.case} on {e.vendor}): {exc}") from None
        tol = rl.tolerances.model_copy(update=e.tolerances.model_dump(exclude_none=True))
        hosts = [h.name for h in cluster.hosts[: cn.nnodes]]
        hw = history.hardware_key(cn.hardware, cluster.backend, hosts, history.cpu_model() if cluster.backend == "local" else None)
        jobs.append(
            NightlyCase(i, e, plan, tol, hw, loss_gate.reference_notes(references.curves_of(plan.references)) + references.judging(plan))
        )
    return Night(
        path=path,
        text=path.read_text(encoding="utf-8"),
        runlist=rl,
        cluster=cluster,
        log_dir=logs,
        db_path=Path(db).expanduser().resolve() if db else _resolve(base, rl.history_db) if rl.history_db else history.default_db(),
        report_dir=Path(report_dir).expanduser().resolve()
        if report_dir
        else _resolve(base, rl.report_dir)
        if rl.report_dir
        else logs / "reports",
        jobs=jobs,
    )


# --------------------------------------------------------------------------- the verdict

METRIC_LABELS = {"tokens_per_gpu_s": "tokens/p/s", "mfu_6n": "MFU-6N", "peak_mem_gib": "peak memory (GiB)"}
#: figures not judged, named beside a speed finding (:func:`_beside_notes`)
BESIDE = ("sm_clock_mhz", "alloc_retries")

Stats = dict[str, dict[str, dict[str, Any]]]  # phase -> metric -> history.value_stats() over the clean rounds


@dataclasses.dataclass
class Verdict:
    status: str  # pass | regressed | baseline: none
    baseline_runs: int
    baseline: dict[str, dict[str, float | None]]  # phase -> metric -> baseline median
    findings: list[dict[str, Any]]


def judge(
    label: str,
    stats: Stats,
    rounds_requested: int,
    rounds_failed: int,
    not_aligned: dict[str, str],
    first_error: str | None,
    baseline: list[Stats],
    tol: Tolerances,
    environment: list[tuple[str, str | None, str | None]] | None = None,
) -> Verdict:
    """Compare one case run, phase by phase, with the medians of its baseline runs (their per-run medians).

    Failed rounds and phases whose loss no longer aligns (``not_aligned``: phase -> the reason
    of an invalid round) are failures with or without a baseline (the baseline runs never have
    them: only good runs count). Throughput and MFU falling, or memory rising, by more than the
    tolerance is a regression; without a baseline nothing is compared. A phase is named in the
    findings when the case has more than one. ``environment``: the recorded variables whose values
    differ from the latest baseline run's (``typed_results.environment_changes``), named beside
    each figure's finding, since they are no part of the config the baseline is matched on.
    """
    findings: list[dict[str, Any]] = []
    n = len(baseline)
    tag = (lambda ph: f" phase {ph}") if len(stats) > 1 else (lambda ph: "")
    medians = {
        ph: {m: _median([b.get(ph, {}).get(m, {}).get("median") for b in baseline]) for m in (*METRIC_LABELS, *BESIDE)} for ph in stats
    }
    base = {ph: {m: ms[m] for m in METRIC_LABELS} for ph, ms in medians.items()}  # the judged figures
    if rounds_failed:
        why = f": {first_error.strip().splitlines()[0]}" if first_error else ""
        findings.append(
            {
                "metric": "rounds failed",
                "baseline": 0.0 if n else None,
                "now": float(rounds_failed),
                "change": None,
                "tolerance": 0.0,
                "message": f"{label}: {rounds_failed} of {rounds_requested} round(s) failed"
                f" (baseline: {'none' if not n else f'no failed round in the last {n} good runs'}){why}",
            }
        )
    for ph, reason in not_aligned.items():
        findings.append(
            {
                "metric": "loss alignment",
                "phase": ph,
                "baseline": 1.0 if n else None,
                "now": 0.0,
                "change": None,
                "tolerance": None,
                "message": f"{label}{tag(ph)}: loss no longer aligns with the reference: {reason}"
                f" (baseline: {'none' if not n else f'aligned or not judged in the last {n} good runs'})",
            }
        )
    for ph, st in stats.items():
        for metric, pct, direction in (
            ("tokens_per_gpu_s", tol.throughput_drop_pct, -1),
            ("mfu_6n", tol.mfu_drop_pct, -1),
            ("peak_mem_gib", tol.memory_rise_pct, +1),
        ):
            now, b = st.get(metric, {}).get("median"), base[ph][metric]
            if now is None or not b:
                continue
            change = now / b - 1
            if direction * change > pct / 100:
                fmt = (lambda x: f"{100 * x:.2f}%") if metric == "mfu_6n" else (lambda x: f"{x:.4g}")
                findings.append(
                    {
                        "metric": METRIC_LABELS[metric],
                        "phase": ph,
                        "baseline": b,
                        "now": now,
                        "change": change,
                        "tolerance": direction * pct / 100,
                        "message": f"{label}{tag(ph)}: {METRIC_LABELS[metric]} median {fmt(now)} vs baseline {fmt(b)} (median of {n} run(s)):"
                        f" {100 * change:+.1f}%, tolerance {'-' if direction < 0 else '+'}{pct:g}%"
                        + (_beside_notes(st, medians[ph]) if direction < 0 else "")
                        + _environment_note(environment or []),
                    }
                )
    status = "regressed" if findings else "pass" if n else "baseline: none"
    return Verdict(status, n, base, findings)


def _beside_notes(stats: dict[str, Any], baseline: dict[str, float | None]) -> str:
    """Beside a speed finding, what a slower night may stand on (:data:`BESIDE`): the GPUs' SM
    clock over the steps (median) now and in the baseline, where both were recorded, so a night
    on a hotter or power-capped machine says so; and the allocator's cache flushes for want of a
    free block (median over rounds), where the night had any, so a run at its memory limit says so."""
    clock, clock_base = stats.get("sm_clock_mhz", {}).get("median"), baseline["sm_clock_mhz"]
    retries, retries_base = stats.get("alloc_retries", {}).get("median"), baseline["alloc_retries"]
    notes = ""
    if clock is not None and clock_base:
        notes += f"; the GPUs' SM clock {clock:,.0f} MHz vs {clock_base:,.0f} in the baseline ({100 * (clock / clock_base - 1):+.1f}%)"
    if retries:
        was = "not recorded" if retries_base is None else f"{retries_base:g}"
        notes += f"; the allocator gave its cache back {retries:g} time(s) for want of a free block (baseline: {was})"
    return notes


def _environment_note(changes: list[tuple[str, str | None, str | None]]) -> str:
    """Beside a figure's finding: the recorded variables set otherwise than in the latest baseline run."""
    if not changes:
        return ""
    shown = lambda value: "unset" if value is None else repr(value)
    return "; the ranks' environment differs from the latest baseline run's: " + ", ".join(
        f"{name} {shown(now)} (baseline: {shown(then)})" for name, now, then in changes
    )


def _median(values: list[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


# --------------------------------------------------------------------------- running


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


class _ProgressConsole:
    """The console handed to the orchestrator: its spinner text becomes the progress line,
    and whenever it reports, finished rounds are counted from the run's results.json."""

    def __init__(self, progress: Progress, task: Any, label: str, results_file: Path, done_before: int) -> None:
        self.progress, self.task, self.label = progress, task, label
        self.results_file, self.done_before = results_file, done_before

    @contextlib.contextmanager
    def status(self, text: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        self.progress.update(self.task, description=f"{self.label} {text}")
        try:
            yield
        finally:
            self.sync()

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.progress.console.print(*args, **kwargs)
        self.sync()

    def sync(self) -> None:
        try:
            done = len(typed_results.load(self.results_file).rounds)
        except InputError:  # not written yet
            return
        self.progress.update(self.task, completed=self.done_before + done)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.progress.console, name)


def run_case(job: NightlyCase, console: Any) -> tuple[RunResults, str | None]:
    """Run one case through the orchestrator; returns its results and, if it broke off, why."""
    from run_benchmarks.running.runtimes import select

    plan = job.plan
    try:
        runtime = select(plan.cluster, plan.cluster.python)
        return orchestrator.run(plan, runtime, console), None
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # a broken case must not hide the others' verdicts
        why = str(exc) if isinstance(exc, InputError) else "".join(traceback.format_exception_only(exc)).strip()
        f = plan.run_dir / "results.json"
        try:
            res = typed_results.load(f) if f.is_file() else orchestrator.base_results(plan)
        except InputError:  # cut off mid-write: the rounds it finished are in the run folder
            res = orchestrator.base_results(plan)
        return res, why


def _label(job: NightlyCase) -> str:
    e = job.entry
    extra = (f" variant {e.variant}" if e.variant else "") + (f" set {','.join(e.sets)}" if e.sets else "")
    return f"{history.case_key(e.case)} on {e.vendor}{extra}"


def run_night(night: Night, db: Any, night_id: int, console: Console, outcomes: list[dict[str, Any]]) -> None:
    """Every case in order; each is judged, stored and appended to ``outcomes`` as soon as it finishes."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("nightly", total=sum(j.entry.rounds for j in night.jobs))
        done = 0
        for job in night.jobs:
            counter = f"[{job.index + 1}/{len(night.jobs)}]"
            progress.console.print(
                f"{counter} {_label(job)}: {job.entry.rounds} round(s), run {job.plan.run_id}", markup=False, highlight=False
            )
            proxy = _ProgressConsole(progress, task, counter, job.plan.run_dir / "results.json", done)
            res, broke = run_case(job, proxy)
            done += job.entry.rounds
            progress.update(task, completed=done)
            outcomes.append(_judge_and_store(night, db, night_id, job, res, broke, console=progress.console))


def _judge_and_store(
    night: Night, db: Any, night_id: int, job: NightlyCase, res: RunResults, broke: str | None, console: Console
) -> dict[str, Any]:
    counts = history.status_counts(res, job.entry.rounds)
    failed = counts["failed"]
    first_error = broke or next((r.error for r in res.rounds if r.status == "failed" and r.error), None)
    if failed and not first_error:
        first_error = f"{job.entry.rounds - len(res.rounds)} round(s) never ran"
    # the reason of the first invalid round per phase whose loss did not align
    not_aligned: dict[str, str] = {}
    for r in res.rounds:
        for p in r.phases:
            if r.status == "invalid" and p.gate.verdict == "not aligned":
                not_aligned.setdefault(p.phase, p.gate.reason)
    identity = {
        "case_key": history.case_key(res.case),
        "vendor": res.vendor,
        "hardware_key": job.hardware_key,
        "config_key": history.config_key(res.config_name, res.settings),
    }
    base_rows = history.baseline_runs(db, identity, night.runlist.baseline_runs)
    stats = history.round_stats(res)
    verdict = judge(
        f"{identity['case_key']} on {res.vendor} ({res.config_name})",
        stats,
        job.entry.rounds,
        failed,
        not_aligned,
        first_error,
        [history.stats_of(db, r["id"]) for r in base_rows],
        job.tolerances,
        environment_changes(recorded_environment(res.rounds), history.environment_of(base_rows[0])) if base_rows else [],
    )
    run_pk = history.record_run(
        db,
        night_id,
        res,
        hardware=job.hardware_key,
        variant=job.entry.variant,
        rounds_requested=job.entry.rounds,
        verdict=verdict.status,
        baseline_runs=verdict.baseline_runs,
        findings=verdict.findings,
        error=broke,
        baseline=verdict.baseline,
        tolerances=job.tolerances.model_dump(),
        run_dir=str(job.plan.run_dir),
        reference=_reference_curves(res),
    )
    lines = [
        f"  rounds ok {counts['ok']}, unjudged {counts['unjudged']}, invalid {counts['invalid']}, failed {failed} of {job.entry.rounds}"
    ]
    for ph, st in stats.items():
        tps, b = st["tokens_per_gpu_s"], verdict.baseline[ph].get("tokens_per_gpu_s")
        lines.append(
            f"  {ph}: tokens/p/s median {history.fmt_num(tps['median'])} (IQR {history.fmt_num(tps['q1'])}-{history.fmt_num(tps['q3'])},"
            f" over {tps['n']} clean round(s)); " + (f"baseline {b:.1f} from {verdict.baseline_runs} run(s)" if b else "baseline: none")
        )
    lines.append(f"  verdict: {verdict.status}")
    if broke:
        lines.insert(0, f"  case broke off: {broke}")
    console.print("\n".join(lines), markup=False, highlight=False)
    return {"job": job, "run_pk": run_pk, "verdict": verdict, "stats": stats, "counts": counts}


def _reference_curves(res: RunResults) -> dict[str, dict[int, float]]:
    """The reference curves the phases were judged against (kept with the run), from its first round."""
    for r in res.rounds:
        return {p.phase: p.reference.loss for p in r.phases if p.reference is not None}
    return {}


def summary_table(outcomes: list[dict[str, Any]]) -> Table:
    """A line per case and phase; the figures are over clean rounds only."""
    table = Table(title="nightly results")
    for col in (
        "case",
        "phase",
        "rounds ok/unjudged/invalid/failed",
        "tokens/p/s median",
        "IQR",
        "olympic",
        "mem alloc (GiB)",
        "baseline tokens/p/s",
        "verdict",
    ):
        table.add_column(col, overflow="fold")
    for o in outcomes:
        v, c = o["verdict"], o["counts"]
        for ph, st in (o["stats"] or {"-": {}}).items():
            tps, mem = st.get("tokens_per_gpu_s", {}), st.get("peak_mem_gib", {})
            b = v.baseline.get(ph, {}).get("tokens_per_gpu_s")
            table.add_row(
                _label(o["job"]),
                ph,
                f"{c['ok']}/{c['unjudged']}/{c['invalid']}/{c['failed']}",
                history.fmt_num(tps.get("median")),
                f"{history.fmt_num(tps.get('q1'))}-{history.fmt_num(tps.get('q3'))}",
                history.fmt_num(tps.get("olympic")),
                history.fmt_num(mem.get("median"), ".3f"),
                "none" if not v.baseline_runs else f"{history.fmt_num(b)} ({v.baseline_runs} runs)",
                v.status,
            )
    return table


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flagbench nightly", description=__doc__.split("\n\n")[0], epilog="Format and exit statuses: docs/nightly.md"
    )
    ap.add_argument("runlist", nargs="?", metavar="RUNLIST.yaml", help="the run list")
    ap.add_argument("--nightly", metavar="RUNLIST.yaml", help="the run list (as start_task.py takes it)")
    ap.add_argument("--db", metavar="PATH", help="history file (default: the run list's history_db)")
    ap.add_argument("--log-dir", "--log_dir", dest="log_dir", metavar="DIR", help="where run folders go (default: the run list's log_dir)")
    ap.add_argument("--report-dir", dest="report_dir", metavar="DIR", help="where report pages go (default: the run list's report_dir)")
    ap.add_argument("--check", action="store_true", help="validate the run list and plan every case, run nothing")
    ap.add_argument(
        "--wait",
        type=_duration,
        metavar="DURATION",
        help="how long each case waits for a host another run holds (30m, 2h; default: the cluster file's lock_wait_s, else 1h)",
    )
    return ap


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, unknown = parser().parse_known_args(argv)
    except SystemExit as exc:  # argparse: usage errors are bad input
        return int(exc.code or 0) and EXIT_BAD_INPUT
    console = Console(stderr=True)
    try:
        if unknown:
            raise InputError(
                f"{' '.join(unknown)}: not a nightly option; the run list names the cases, vendors and overrides (docs/nightly.md)"
            )
        if bool(args.runlist) == bool(args.nightly):
            raise InputError(
                "give the run list once: start_task.py --nightly RUNLIST.yaml, or python -m run_benchmarks.nightly.driver RUNLIST.yaml"
            )
        night = prepare(Path(args.runlist or args.nightly), args.db, args.log_dir, args.report_dir, args.wait)
        if args.check:
            for j in night.jobs:
                given = [str(p) for p in j.plan.reference] or [
                    registry.shown(p) for ph in j.plan.phases for p in references.reference_paths(j.plan, ph)
                ]
                refs = "".join(f", reference {p}" for p in given)
                print(
                    f"{_label(j)}: {j.entry.rounds} round(s), config {j.plan.config_name}, recipe {j.plan.recipe}{refs}, "
                    f"tolerances {j.tolerances.model_dump()}"
                )
                for note in j.reference_notes:
                    print(f"  {note}")
            print(f"history {night.db_path}\nlogs    {night.log_dir}\nreports {night.report_dir}")
            return EXIT_OK
        db = history.connect(night.db_path)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from run_benchmarks.nightly import report

    night_id = history.start_night(db, _now(), str(night.path.resolve()), night.text, socket.gethostname())
    status, outcomes = EXIT_OK, []  # type: tuple[int, list[dict[str, Any]]]
    try:
        run_night(night, db, night_id, console, outcomes)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
        print("interrupted; finished cases are in the history and the report", file=sys.stderr)
    findings = [f for o in outcomes for f in o["verdict"].findings]
    if findings and status == EXIT_OK:
        status = EXIT_REGRESSED
    page = report.write_night(db, night_id, night.report_dir, status)
    history.finish_night(db, night_id, _now(), status, str(page))
    report.write_index(db, night.report_dir)
    out = Console(width=160)
    if outcomes:
        out.print(summary_table(outcomes))
    for f in findings:
        print(f"REGRESSION {f['message']}")
    print(f"report: {page}")
    print(f"nightly: {len(outcomes)} case(s), {len(findings)} finding(s); exit status {status}")
    db.close()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
