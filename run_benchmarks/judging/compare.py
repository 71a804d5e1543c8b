"""A vendor's run against a reference run: ``flagbench compare RUN_A RUN_B [...]``
(``start_task.py --compare``): every run set against the last one (the
reference run, e.g. NVIDIA's), phase by phase: tokens/p/s and its ratio, MFU both ways,
memory both ways, the loss MRE over the steps both ran from step 21 on (only where both
trained on the same data), the layout and every setting that differs. A table here, and
``compare.md`` and ``compare.html`` (the loss curves overlaid, drawn by the pages module's plotting
code) in ``--out`` (default ``logs/compare-<time>``).

Exit status: 0 done, 2 bad input (a file that is not a results.json, only failed rounds).
``flagbench judge`` and ``record-reference`` are recording.py's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

from run_benchmarks import typed_results as tr
from run_benchmarks.errors import InputError, parse_args
from run_benchmarks.judging import loss_gate, pages
from run_benchmarks.judging.compare_charts import phase_charts, side_name
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
        layout = next((p.layout for r in reversed(kept) for p in r.phases if p.layout), None) or (kept[-1].layout if kept else None)
        data = "/".join(dict.fromkeys(self.fingerprint(ph)[:16] for ph in self.res.phases))
        self.label = f"{self.res.vendor} {self.res.hardware} x{self.res.world_size} {self.res.config_name} {layout or '-'}, data {data}"
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

    def verdict(self, phase: str) -> str:
        """The run's own gate of ``phase`` in its last kept round: ``aligned (0.25 %)``, ``NOT aligned
        (3.10 %)`` or ``not judged: <why>``."""
        ps = self.phase(phase)
        if not ps:
            return "no such phase"
        g = ps[-1].gate
        if g.verdict == "not judged":
            return f"not judged: {g.reason}"
        return f"{'aligned' if g.verdict == 'aligned' else 'NOT aligned'} ({'-' if g.mre is None else f'{100 * g.mre:.2f} %'})"

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
    """The gate's MRE (loss_gate.loss_mre) of a run against the reference run, over the steps
    from 21 on that both ran; None with why where they are too few or a loss is not finite."""
    common = {s: v for s, v in ref.items() if s in loss}
    steps = [s for s in sorted(common) if s >= loss_gate.ALIGN_FROM_STEP]
    if len(steps) < loss_gate.MIN_COMPARED_STEPS:
        return None, f"{len(steps)} common step(s) from step {loss_gate.ALIGN_FROM_STEP}"
    if any(not math.isfinite(loss[s]) for s in steps):
        return None, "a non-finite or zero loss"
    try:
        mre, _ = loss_gate.loss_mre(loss, common)
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
                    "status": f"reference run (its own rounds: {s.status(phase)})" if s is ref else s.status(phase),
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
    lines += [f"- {v}" for v in verdict_lines(c)] + [""]
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
        footnote(c),
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


def footnote(c: dict[str, Any]) -> str:
    """What the table's figures are, for the page and compare.md alike."""
    return (
        (
            "Figures are the mean over each run's rounds that ran through, those its own loss gate made invalid "
            "included (status says which)"
            if c["with_invalid"]
            else "Figures are the mean over each run's clean rounds"
        )
        + "; ratio is tokens/p/s over the reference run's; of ceiling is tokens/p/s over the kernel ceiling timed "
        "in the run; SM MHz is the median SM clock of its GPUs over the steps of its last round, with the reason "
        "the driver held it down most often; tokens/J is tokens per joule per device over the window (docs/metrics.md); "
        "the loss MRE is over the steps both runs have from step 21 on, on the same data only."
    )


def data_rows(sides: list[Side], phases: list[str]) -> list[list[str]]:
    """Each run's data per phase: its identity in a few words and its fingerprint."""
    return [[side_name(s, i, sides)] + [datacheck.identity_text((s.res.data or {}).get(ph)) for ph in phases] for i, s in enumerate(sides)]


def verdict_lines(c: dict[str, Any]) -> list[str]:
    """Each run's verdict, first on the page: its own loss gate per phase and, against the
    reference run, its throughput ratio and loss MRE."""
    sides = c["sides"]
    rows = {(r["phase"], r["run"]): r for r in c["rows"]}
    out = []
    for i, s in enumerate(sides):
        head = ("reference" if s is sides[-1] else f"run {i + 1}") + ": " + s.label
        parts = []
        for ph in c["phases"]:
            r = rows.get((ph, ("reference: " if s is sides[-1] else f"run {i + 1}: ") + s.label), {})
            against = (
                ""
                if s is sides[-1]
                else f"; against the reference run: ratio {r.get('ratio', '-')}, loss MRE {r.get('loss MRE vs reference', '-')}"
                + (f" ({r['compared']})" if r.get("loss MRE vs reference") == "-" and r.get("compared") else "")
            )
            parts.append(f"{ph}: {s.verdict(ph)}{against}")
        out.append(f"{head}: " + " | ".join(parts))
    return out


#: one color per run (the reference is black), as many as a comparison usually holds
def html_page(c: dict[str, Any]) -> str:
    sides = c["sides"]
    body = [f"<h1>{pages.e(sides[-1].res.model)}: {len(sides) - 1} run(s) against the reference run</h1>"]
    body.append('<h2>Verdicts</h2><ul class="verdicts">' + "".join(f"<li>{pages.e(v)}</li>" for v in verdict_lines(c)) + "</ul>")
    body.append("<h2>Runs</h2><ul>")
    body += [f'<li>{pages.e(side_name(s, i, sides))} <span class="meta">{pages.e(s.path)}</span></li>' for i, s in enumerate(sides)]
    body.append("</ul>")
    body.append(
        "<h2>Data</h2>"
        + pages.table(["run", *(f"phase {ph}" for ph in c["phases"])], [[pages.e(x) for x in r] for r in data_rows(sides, c["phases"])])
    )
    body.append("<h2>Figures</h2>")
    body.append(pages.table(COLUMNS, [[pages.e(r[k]) for k in COLUMNS] for r in c["rows"]], numeric={3, 4, 5, 6, 7, 8, 9, 10}))
    body.append(f'<p class="meta">{pages.e(footnote(c))}</p>')
    charts: list[str] = []
    for phase in c["phases"]:
        charts += phase_charts(phase, sides, first=not charts)
    body.append(f'<h2>Loss and throughput per step</h2><div class="charts">{"".join(charts)}</div>')
    body.append("<style>.charts figure.chart { width: 100%; margin: 0 0 1.5em; } ul.verdicts li { margin: 0.3em 0; }</style>")
    body.append("<h2>Settings that differ</h2>")
    if c["differ"]:
        head = ["setting"] + [f"run {i + 1}" if s is not sides[-1] else "reference" for i, s in enumerate(sides)]
        body.append(pages.table(head, [[pages.e(x) for x in row] for row in c["differ"]]))
    else:
        body.append("<p>none</p>")
    return pages.PAGE.substitute(title=pages.e(f"flagbench compare {sides[-1].res.model}"), body="\n".join(body))


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


def compare_main(argv: list[str]) -> int:
    """``flagbench compare RESULTS.json ... [--out DIR]`` (``start_task.py --compare``)."""
    ap = argparse.ArgumentParser(prog="flagbench compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RESULTS.json", help="runs to compare; the last is the reference run")
    ap.add_argument("--out", metavar="DIR", help="where compare.md and compare.html go (default logs/compare-<time>)")
    ap.add_argument(
        "--with-invalid",
        action="store_true",
        help="count rounds whose own loss gate failed (they ran through), marked invalid in the status column",
    )
    args = parse_args(ap, argv)
    if isinstance(args, int):
        return args
    try:
        c = comparison([Path(a).expanduser().resolve() for a in args.runs], args.with_invalid)
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
