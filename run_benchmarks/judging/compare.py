"""A vendor's run against a reference run, and a run's curve made the case's reference.

``start_task.py --compare RUN_A RUN_B [...]``: every run set against the last one (the
reference run, e.g. NVIDIA's), phase by phase: tokens/p/s and its ratio, MFU both ways,
memory both ways, the loss MRE over the steps both ran from step 21 on (only where both
trained on the same data), the layout and every setting that differs. A table here, and
``compare.md`` and ``compare.html`` (the loss curves overlaid, drawn by the pages module's plotting
code) in ``--out`` (default ``logs/compare-<time>``).

``start_task.py --record-reference RUN/results.json [RUN2/results.json ...] --why TEXT``: the
curves of the runs' rounds that ran through become the reference of their model, phase, recipe
and data (references.record: the mean of the repeats, with their provenance and spread).

Exit status: 0 done, 2 bad input (a file that is not a results.json, only failed rounds, a
curve too short to judge a run). ``--judge`` exits as a run does: 0 when every phase it judged
is aligned, 1 when one is not aligned or not judged, 2 bad input.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.judging import pages, references
from run_benchmarks.judging import typed_results as tr
from run_benchmarks.judging.results import (
    _pct,
    allocated_cell,
    ceiling_cell,
    clock_cell,
    device_mem,
    energy_cell,
    repeats_note,
    spread_cell,
)
from run_benchmarks.planning import datacheck

# --------------------------------------------------------------------------- --compare


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


class Side:
    """One run as the comparison reads it: its clean rounds' figures per phase; with
    ``with_invalid``, also those of rounds its own loss gate made invalid (they ran through),
    each row then saying so in its ``status``."""

    def __init__(self, path: Path, with_invalid: bool = False):
        self.path = path
        self.res = tr.load(path)
        kept = [r for r in self.res.rounds if (r.ran_through if with_invalid else r.clean)]
        self.rounds = kept
        self.label = f"{self.res.vendor} {self.res.hardware} x{self.res.world_size} {self.res.config_name}"
        host = (self.res.system or {}).get("host") or "host unknown"
        self.tag = f"{self.res.run_id}, {host}, {self.res.started[:16].replace('T', ' ')}"  # tells runs of one config apart
        if not kept:
            statuses = ", ".join(f"round {r.round} {r.status}" for r in self.res.rounds) or "no round"
            if with_invalid:
                raise InputError(f"{path}: no round ran through (ok, unjudged or invalid by its own gate): {statuses}")
            hint = (
                " (--with-invalid shows a run whose loss gate failed, marked so)"
                if any(r.status == "invalid" for r in self.res.rounds)
                else ""
            )
            raise InputError(f"{path}: no round ran clean (ok or unjudged): {statuses}; its figures are no results{hint}")

    def status(self, phase: str) -> str:
        """The kept rounds' statuses as ``phase`` saw them: ``ok``, ``invalid (<its gate's reason>)``
        where this phase's loss did not align, ``invalid (another phase's loss)`` where it did."""
        parts = []
        for r in self.rounds:
            gates = [p.gate for p in r.phases if p.phase == phase]
            if r.status != "invalid":
                parts.append(r.status)
            elif gates and gates[0].verdict == "not aligned":
                parts.append(f"invalid ({gates[0].reason})")
            else:
                parts.append("invalid (another phase's loss)")
        return ", ".join(dict.fromkeys(parts))

    def phase(self, name: str) -> list[tr.PhaseResult]:
        return [p for r in self.rounds for p in r.phases if p.phase == name]

    def environment(self) -> dict[str, str] | None:
        """What its kept rounds' ranks recorded of their environment (typed_results)."""
        return tr.recorded_environment(self.rounds)

    def fig(self, phase: str, field: str) -> float | None:
        return _mean([getattr(p, field) for p in self.phase(phase)])

    def loss(self, phase: str) -> dict[int, float]:
        ps = self.phase(phase)
        return ps[0].loss if ps else {}

    def fingerprint(self, phase: str) -> str:
        ident = (self.res.data or {}).get(phase)
        return datacheck.SYNTHETIC if ident is None else (ident.get("fingerprint") or "unknown")


def _mre(loss: dict[int, float], ref: dict[int, float]) -> tuple[float | None, str]:
    """The gate's MRE (references.loss_mre) of a run against the reference run, over the steps
    from 21 on that both ran; None with why where they are too few or a loss is not finite."""
    common = {s: v for s, v in ref.items() if s in loss}
    steps = [s for s in sorted(common) if s >= references.ALIGN_FROM_STEP]
    if len(steps) < references.MIN_COMPARED_STEPS:
        return None, f"{len(steps)} common step(s) from step {references.ALIGN_FROM_STEP}"
    if any(not math.isfinite(loss[s]) for s in steps):
        return None, "a non-finite or zero loss"
    try:
        mre, _ = references.loss_mre(loss, common)
    except ValueError:
        return None, "a non-finite or zero loss"
    return mre, f"steps {steps[0]}-{steps[-1]}"


def comparison(paths: list[Path], with_invalid: bool = False) -> dict[str, Any]:
    """Every run against the last: rows per phase, differing settings, loss curves; with
    ``with_invalid`` the rounds a loss gate made invalid count too, marked in ``status``."""
    if len(paths) < 2:
        raise InputError("--compare needs at least two results.json files: RUN_A RUN_B (B the reference run)")
    sides = [Side(p, with_invalid) for p in paths]
    ref = sides[-1]
    models = {s.res.model for s in sides}
    if len(models) != 1:
        raise InputError(f"--compare: runs of different models ({', '.join(sorted(models))}); compare runs of one case")
    phases = ref.res.phases
    rows = []
    for phase in phases:
        base_tps = ref.fig(phase, "tokens_per_gpu_s")
        for i, s in enumerate(sides):
            tps = s.fig(phase, "tokens_per_gpu_s")
            if s is ref:
                ratio, mre, note = "reference", "reference", ""
            else:
                ratio = "-" if tps is None or not base_tps else f"{tps / base_tps:.3f}"
                if s.fingerprint(phase) != ref.fingerprint(phase):
                    mre, note = "-", f"other data ({s.fingerprint(phase)} vs {ref.fingerprint(phase)}): loss not compared"
                else:
                    m, note = _mre(s.loss(phase), ref.loss(phase))
                    mre = "-" if m is None else f"{100 * m:.2f}%"
            ps = s.phase(phase)
            last = ps[-1] if ps else None
            gated = repeats_note(last.reference) if last else ""  # its own gate's reference, when made from repeats
            if gated and last and last.gate.noise_units is not None:
                gated += f", {last.gate.noise_units:.1f} x its noise" + (" (numerics differ)" if last.gate.numerics_differ else "")
            if gated:
                note = f"{note}; its gate: {gated}" if note else f"its gate: {gated}"
            rows.append(
                {
                    "phase": phase,
                    "run": ("reference: " if s is ref else f"run {i + 1}: ") + s.label,
                    "file": str(s.path),
                    "rounds": len(s.rounds),
                    "layout": (last.layout if last else None) or "-",
                    "tokens/p/s": "-" if tps is None else f"{tps:,.1f}",
                    "steps p10-p90": spread_cell(last.throughput_spread) if last else "-",
                    "ratio": ratio,
                    "MFU 6N": _pct(s.fig(phase, "mfu_6n")),
                    "MFU PaLM": _pct(s.fig(phase, "mfu_palm")),
                    "mem allocated (GiB)": allocated_cell(s.fig(phase, "peak_mem_gib"), None, None, last.alloc_retries if last else None),
                    "mem in use (GiB)": device_mem(last.device_mem) if last else "-",
                    "of ceiling": ceiling_cell(s.fig(phase, "ceiling_efficiency"), s.fig(phase, "ceiling_tokens_per_gpu_s")),
                    "SM MHz": clock_cell(last.device_clocks) if last else "-",
                    "tokens/J": energy_cell(last.device_energy) if last else "-",
                    "loss MRE vs reference": mre,
                    "compared": note,
                    "status": s.status(phase),
                }
            )
    flats = [_flat(s.res.settings) for s in sides]
    keys = sorted(set().union(*flats))
    differ = [
        [k] + [json.dumps(f.get(k), default=str) if k in f else "(absent)" for f in flats]
        for k in keys
        if len({json.dumps(f.get(k), default=str) if k in f else "(absent)" for f in flats}) > 1
    ]
    # the environment the ranks recorded: unset where a run recorded its environment without the
    # variable, not recorded where it recorded none (a run from before the record, a vendor without it)
    envs = [s.environment() for s in sides]
    for name in sorted(set().union(*(e for e in envs if e))):
        vals = [("(not recorded)" if e is None else e.get(name, "(unset)")) for e in envs]
        if len(set(vals)) > 1:
            differ.append([f"environment {name}"] + vals)
    for attr in ("vendor", "hardware", "world_size", "config_name", "code_version"):
        vals = [str(getattr(s.res, attr)) for s in sides]
        if len(set(vals)) > 1:
            differ.insert(0, [attr] + vals)
    return {"sides": sides, "rows": rows, "differ": differ, "phases": phases, "with_invalid": with_invalid}


COLUMNS = [
    "phase",
    "run",
    "layout",
    "tokens/p/s",
    "steps p10-p90",
    "ratio",
    "MFU 6N",
    "MFU PaLM",
    "mem allocated (GiB)",
    "mem in use (GiB)",
    "of ceiling",
    "SM MHz",
    "tokens/J",
    "loss MRE vs reference",
    "compared",
    "status",
]


def markdown(c: dict[str, Any]) -> str:
    sides = c["sides"]
    lines = [f"# {sides[-1].res.model}: {len(sides) - 1} run(s) against the reference run", ""]
    kept = "round(s) that ran through" if c["with_invalid"] else "clean round(s)"
    lines += [
        f"- {side_name(s, i, sides)}, `{s.path}` ({len(s.rounds)} {kept}); data: "
        + "; ".join(f"{ph} {datacheck.identity_text((s.res.data or {}).get(ph))}" for ph in c["phases"])
        for i, s in enumerate(sides)
    ]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[k]).replace("|", "/") for k in COLUMNS) + " |" for r in c["rows"]]
    lines += [
        "",
        (
            "Figures are the mean over each run's rounds that ran through, those its own loss gate made invalid "
            "included (status says which)"
            if c["with_invalid"]
            else "Figures are the mean over each run's clean rounds"
        )
        + "; ratio is tokens/p/s over the reference run's; of ceiling is tokens/p/s over the kernel ceiling timed "
        "in the run; SM MHz is the median SM clock of its GPUs over the steps of its last round, with the reason "
        "the driver held it down most often (docs/metrics.md); the loss MRE is over the steps both runs have from "
        "step 21 on, on the same data only.",
        "",
        "## Settings that differ",
        "",
    ]
    if c["differ"]:
        lines += [
            "| setting | " + " | ".join(f"run {i + 1}" if s is not sides[-1] else "reference" for i, s in enumerate(sides)) + " |",
            "|" + "---|" * (len(sides) + 1),
        ]
        lines += ["| " + " | ".join(str(x).replace("|", "/") for x in row) + " |" for row in c["differ"]]
    else:
        lines.append("none")
    return "\n".join(lines) + "\n"


def side_name(s: Side, i: int, sides: list[Side]) -> str:
    """A run as the page names it: its place, what ran, and its run id, host and date."""
    return f"{'reference' if s is sides[-1] else f'run {i + 1}'}: {s.label} ({s.tag})"


def _legend_below(ax: Any) -> None:
    """The legend under the axes, outside the curves, one run a line."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.14), frameon=False)


def _other_data_plot(phase: str, sides: list[Side], others: list[Side]) -> str:
    """The curves of runs on other data than the reference run's, drawn apart: not comparable."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for s in others:
        curve = s.loss(phase)
        steps = sorted(curve)
        ax.plot(steps, [curve[k] for k in steps], lw=1, label=f"{side_name(s, sides.index(s), sides)}, data {s.fingerprint(phase)}")
    ax.set(xlabel="step", ylabel="loss", title=f"loss, phase {phase}: runs on other data than the reference run (not compared)")
    _legend_below(ax)
    caption = f"phase {phase}: runs on other data (reference data {sides[-1].fingerprint(phase)})"
    return pages.img(fig, f"loss {phase}, other data", caption)


def data_rows(sides: list[Side], phases: list[str]) -> list[list[str]]:
    """Each run's data per phase: its identity in a few words and its fingerprint."""
    return [[side_name(s, i, sides)] + [datacheck.identity_text((s.res.data or {}).get(ph)) for ph in phases] for i, s in enumerate(sides)]


def html_page(c: dict[str, Any]) -> str:
    from matplotlib.figure import Figure

    sides = c["sides"]
    body = [f"<h1>{pages.e(sides[-1].res.model)}: {len(sides) - 1} run(s) against the reference run</h1>", "<ul>"]
    body += [f'<li>{pages.e(side_name(s, i, sides))} <span class="meta">{pages.e(s.path)}</span></li>' for i, s in enumerate(sides)]
    body.append("</ul>")
    body.append(
        "<h2>Data</h2>"
        + pages.table(["run", *(f"phase {ph}" for ph in c["phases"])], [[pages.e(x) for x in r] for r in data_rows(sides, c["phases"])])
    )
    body.append(pages.table(COLUMNS, [[pages.e(r[k]) for k in COLUMNS] for r in c["rows"]], numeric={3, 4, 5, 6, 7, 8, 9, 10}))
    plots = []
    for phase in c["phases"]:
        same = [s for s in sides if s.fingerprint(phase) == sides[-1].fingerprint(phase)]
        fig = Figure(figsize=(13, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for i, s in [(i, s) for i, s in enumerate(sides) if s in same]:
            curve = s.loss(phase)
            steps = sorted(curve)
            style = {"color": "k", "ls": "--", "lw": 1.6} if s is sides[-1] else {"lw": 1}
            ax.plot(steps, [curve[k] for k in steps], label=side_name(s, i, sides), **style)
        ax.axvline(references.ALIGN_FROM_STEP, color="grey", lw=0.8, ls=":", label=f"compared from step {references.ALIGN_FROM_STEP}")
        ax.set(xlabel="step", ylabel="loss", title=f"loss, phase {phase}")
        _legend_below(ax)
        plots.append(pages.img(fig, f"loss {phase}", f"phase {phase}: every run's first clean round, on the reference run's data"))
        if len(same) < len(sides):
            plots.append(_other_data_plot(phase, sides, [s for s in sides if s not in same]))
    body.append(f'<h2>Loss</h2><div class="plots wide">{"".join(plots)}</div>')
    body.append("<style>.wide figure { width: 100%; } .wide img.plot { width: 100%; }</style>")
    body.append("<h2>Settings that differ</h2>")
    if c["differ"]:
        head = ["setting"] + [f"run {i + 1}" if s is not sides[-1] else "reference" for i, s in enumerate(sides)]
        body.append(pages.table(head, [[pages.e(x) for x in row] for row in c["differ"]]))
    else:
        body.append("<p>none</p>")
    return pages.PAGE.substitute(title=pages.e(f"flagbench compare {sides[-1].res.model}"), body="\n".join(body))


# --------------------------------------------------------------------------- --judge


def judge_again(paths: list[Path], files: list[Path]) -> list[dict[str, Any]]:
    """Each run's rounds that ran through, each phase's curve judged again by the loss gate
    (references.judge_loss) against the curve ``files``: what the run would have said against them. The
    runs' files are not changed. One row per run, round and phase, with the verdict recorded."""
    if not files:
        raise InputError("--judge needs at least one --reference FILE to judge against")
    rows = []
    for path in paths:
        res = tr.load(path)
        through = [r for r in res.rounds if r.ran_through]
        if not through:
            raise InputError(f"{path}: no round ran through (every round failed): nothing to judge")
        refs: dict[str, tr.Reference] = {}  # per phase: a run's rounds share its settings
        for rnd in through:
            for p in rnd.phases:
                if p.phase not in refs:  # checked as a live run's --reference is, data first
                    refs[p.phase] = references.offline_reference(res, p.phase, files)
                gate = references.judge_loss(p.loss, refs[p.phase], p.window.warmup_steps)
                rows.append(
                    {
                        "run": res.run_id,
                        "round": rnd.round,
                        "phase": p.phase,
                        "recorded": f"{p.gate.verdict}: {p.gate.reason}",
                        "verdict": gate.verdict,
                        "noise_units": gate.noise_units,
                        "reason": gate.reason,
                    }
                )
    return rows


def judged_status(verdicts: list[str]) -> int:
    """``--judge``'s exit status, as a run's: 0 every phase judged aligned, 1 a phase not aligned
    or not judged (bad input, 2, is refused before)."""
    return 0 if verdicts and all(v == "aligned" for v in verdicts) else 1


def print_table(c: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{c['sides'][-1].res.model}: against {c['sides'][-1].label}")
    for col in COLUMNS:
        t.add_column(col)
    for r in c["rows"]:
        t.add_row(*[str(r[k]) for k in COLUMNS])
    console = Console(width=200)
    console.print(t)
    if c["differ"]:
        d = Table(title="settings that differ")
        d.add_column("setting")
        for i, s in enumerate(c["sides"]):
            d.add_column("reference" if s is c["sides"][-1] else f"run {i + 1}")
        for row in c["differ"]:
            d.add_row(*[str(x) for x in row])
        console.print(d)


def print_judged(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="loss gate, judged again")
    for col in ("run", "round", "phase", "recorded", "verdict", "x noise", "reason"):
        t.add_column(col)
    for r in rows:
        units = "-" if r.get("noise_units") is None else f"{r['noise_units']:.1f}"
        t.add_row(r["run"], str(r["round"]), r["phase"], r["recorded"], r["verdict"], units, r["reason"])
    Console(width=240).print(t)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="start_task.py", description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--compare", nargs="+", metavar="RESULTS.json", help="runs to compare; the last is the reference run")
    group.add_argument(
        "--judge",
        nargs="+",
        metavar="RESULTS.json",
        help="judge runs' loss curves again against --reference files (several: their mean and spread); the files stay as they are",
    )
    ap.add_argument("--reference", action="append", default=[], metavar="FILE", help="with --judge: a curve to judge against (repeatable)")
    group.add_argument(
        "--record-reference",
        nargs="+",
        metavar="RESULTS.json",
        help="make a run's curves the case's reference for its data; several runs of one config: their mean, with the runs and their spread",
    )
    ap.add_argument("--replace", action="store_true", help="with --record-reference: replace a reference that exists")
    ap.add_argument(
        "--update",
        action="store_true",
        help="with --judge: write the verdicts into the runs' results.json (a reference made after they ran)",
    )
    ap.add_argument("--why", default="", metavar="TEXT", help="with --record-reference: why the reference is made or changed (kept in it)")
    ap.add_argument("--out", metavar="DIR", help="with --compare: where compare.md and compare.html go (default logs/compare-<time>)")
    ap.add_argument(
        "--with-invalid",
        action="store_true",
        help="with --compare: count rounds whose own loss gate failed (they ran through), marked invalid in the status column",
    )
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2
    try:
        if args.record_reference:
            paths = [Path(a).expanduser().resolve() for a in args.record_reference]
            print("\n".join(references.record(paths, args.why, args.replace)))
            return 0
        if args.judge and args.update:
            files = [Path(r).expanduser().resolve() for r in args.reference]
            verdicts = []
            for a in args.judge:
                path = Path(a).expanduser().resolve()
                print("\n".join(references.judge_file(path, files)))
                verdicts += [p.gate.verdict for r in tr.load(path).rounds if r.ran_through for p in r.phases]
            return judged_status(verdicts)
        if args.judge:
            rows = judge_again(
                [Path(a).expanduser().resolve() for a in args.judge], [Path(r).expanduser().resolve() for r in args.reference]
            )
            print_judged(rows)
            return judged_status([r["verdict"] for r in rows])
        c = comparison([Path(p).expanduser().resolve() for p in args.compare], args.with_invalid)
        out = Path(args.out or Path("logs") / f"compare-{dt.datetime.now():%Y%m%d-%H%M%S}").expanduser().resolve()
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "compare.md").write_text(markdown(c))
            (out / "compare.html").write_text(html_page(c))
        except OSError as exc:
            raise InputError(f"{out}: cannot write the comparison there: {exc.strerror or exc}") from None
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(c)
    print(f"comparison: {out / 'compare.md'}, {out / 'compare.html'}")
    return 0
