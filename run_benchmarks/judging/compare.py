"""A vendor's run against a reference run, and a run's curve made the case's reference.

``start_task.py --compare RUN_A RUN_B [...]``: every run set against the last one (the
reference run, e.g. NVIDIA's), phase by phase: tokens/p/s and its ratio, MFU both ways,
memory both ways, the loss MRE over the steps both ran from step 21 on (only where both
trained on the same data), the layout and every setting that differs. A table here, and
``compare.md`` and ``compare.html`` (the loss curves overlaid, drawn by the pages module's plotting
code) in ``--out`` (default ``logs/compare-<time>``).

``start_task.py --record-reference RUN/results.json [RUN2/results.json ...] --why TEXT``: the
curves of the runs' rounds that ran through become the reference of their model, phase, recipe
and data (recording.record: the mean of the repeats, with their provenance and spread).

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
from run_benchmarks.judging import loss_gate, pages, recording
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


def side_name(s: Side, i: int, sides: list[Side]) -> str:
    """A run as the page names it: its place, what ran, and its run id, host and date."""
    return f"{'reference' if s is sides[-1] else f'run {i + 1}'}: {s.label} ({s.tag})"


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
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _chart(div_id: str, title: str, traces: list[dict[str, Any]], layout: dict[str, Any], first: bool) -> str:
    """A plotly chart written into the page (plotly.js once, with the first chart: the page needs
    no network), zoomable, its legend under the axes in text a reader can read."""
    import plotly.graph_objects as go

    fig = go.Figure(data=traces)
    fig.update_layout(
        title={"text": title, "font": {"size": 16}},
        font={"size": 13},
        showlegend=True,  # also for one run: its name is the legend
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0, "font": {"size": 13}},
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        height=460,
        template="plotly_white",
        **layout,
    )
    html = fig.to_html(full_html=False, include_plotlyjs=first, div_id=div_id, config={"displaylogo": False, "responsive": True})
    return f'<figure class="chart" data-title="{pages.e(title)}">{html}</figure>'


def _judged_band(last: int) -> dict[str, Any]:
    """The steps the gate compares, shaded."""
    return {
        "type": "rect",
        "xref": "x",
        "yref": "paper",
        "x0": loss_gate.ALIGN_FROM_STEP - 0.5,
        "x1": last + 0.5,
        "y0": 0,
        "y1": 1,
        "fillcolor": "rgba(120,120,120,0.12)",
        "line": {"width": 0},
        "layer": "below",
    }


def _zoom_buttons(last: int, judged_y: tuple[float, float] | None) -> list[dict[str, Any]]:
    """Buttons: every step, or the judged steps alone (from step 21), their loss range."""
    judged = {"xaxis.range": [loss_gate.ALIGN_FROM_STEP - 0.5, last + 0.5]}
    if judged_y:
        pad = 0.1 * (judged_y[1] - judged_y[0]) or 0.01 * abs(judged_y[1]) or 0.01
        judged["yaxis.range"] = [judged_y[0] - pad, judged_y[1] + pad]
    return [
        {
            "type": "buttons",
            "direction": "right",
            "x": 1,
            "xanchor": "right",
            "y": 1.12,
            "buttons": [
                {"label": "all steps", "method": "relayout", "args": [{"xaxis.autorange": True, "yaxis.autorange": True}]},
                {"label": f"judged steps ({loss_gate.ALIGN_FROM_STEP} on)", "method": "relayout", "args": [judged]},
            ],
        }
    ]


def phase_charts(phase: str, sides: list[Side], first: bool) -> list[str]:
    """A phase's charts: the loss per step of the runs on the reference run's data (the judged
    steps shaded; a button zooms to them), each run's relative difference to the reference run per
    step (the gate's 2 % band shaded), tokens/p/s per step, and the runs on other data apart."""
    ref = sides[-1]
    same = [(i, s) for i, s in enumerate(sides) if s.fingerprint(phase) == ref.fingerprint(phase)]
    others = [(i, s) for i, s in enumerate(sides) if s.fingerprint(phase) != ref.fingerprint(phase)]
    ref_loss = ref.loss(phase)
    last = max([max(s.loss(phase), default=0) for s in sides] + [loss_gate.ALIGN_FROM_STEP])

    def style(i: int, s: Side) -> dict[str, Any]:
        if s is ref:  # drawn first, wide and dashed: an equal run's markers stay visible on it
            return {"line": {"color": "#000", "width": 3, "dash": "dash"}, "mode": "lines"}
        return {"line": {"color": COLORS[i % len(COLORS)], "width": 1.6}, "mode": "lines+markers", "marker": {"size": 4}}

    order = [(len(sides) - 1, ref)] + [(i, s) for i, s in same if s is not ref]
    traces = []
    judged: list[float] = []
    for i, s in order:
        curve = s.loss(phase)
        steps = sorted(curve)
        traces.append({"type": "scatter", "x": steps, "y": [curve[k] for k in steps], "name": side_name(s, i, sides), **style(i, s)})
        judged += [curve[k] for k in steps if k >= loss_gate.ALIGN_FROM_STEP and math.isfinite(curve[k])]
    band = [_judged_band(last)]
    charts = [
        _chart(
            f"loss-{phase}",
            f"loss, phase {phase} (judged steps shaded)",
            traces,
            {
                "xaxis": {"title": "step"},
                "yaxis": {"title": "loss"},
                "shapes": band,
                "updatemenus": _zoom_buttons(last, (min(judged), max(judged)) if judged else None),
            },
            first,
        )
    ]
    diffs = []
    for i, s in same:
        if s is ref:
            continue
        curve = s.loss(phase)
        steps = [k for k in sorted(curve) if k in ref_loss and ref_loss[k] and math.isfinite(curve[k])]
        diffs.append(
            {
                "type": "scatter",
                "x": steps,
                "y": [100 * (curve[k] - ref_loss[k]) / ref_loss[k] for k in steps],
                "name": side_name(s, i, sides),
                **style(i, s),
            }
        )
    if diffs:
        tol = 100 * loss_gate.ALIGN_TOLERANCE
        shapes = band + [
            {
                "type": "rect",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": -tol,
                "y1": tol,
                "fillcolor": "rgba(46,160,44,0.08)",
                "line": {"width": 0},
                "layer": "below",
            },
            {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 0, "y1": 0, "line": {"color": "#000", "width": 1}},
        ]
        charts.append(
            _chart(
                f"diff-{phase}",
                f"loss against the reference run, phase {phase}: (run - reference) / reference, % (the gate's {tol:g} % band shaded)",
                diffs,
                {"xaxis": {"title": "step"}, "yaxis": {"title": "% of the reference run's loss"}, "shapes": shapes},
                False,
            )
        )
    speed = []
    for i, s in order + others:
        ps = s.phase(phase)
        if not ps:
            continue
        world = s.res.world_size
        steps = [st for st in ps[-1].steps if st.step_time_s > 0]
        speed.append(
            {
                "type": "scatter",
                "x": [st.step for st in steps],
                "y": [st.tokens / st.step_time_s / world for st in steps],
                "name": side_name(s, i, sides),
                **style(i, s),
            }
        )
    if speed:
        charts.append(
            _chart(
                f"tps-{phase}",
                f"tokens/p/s per step, phase {phase} (each run's last kept round; the warm-up steps included)",
                speed,
                {"xaxis": {"title": "step"}, "yaxis": {"title": "tokens per GPU per second"}},
                False,
            )
        )
    if others:
        traces = []
        for i, s in others:
            curve = s.loss(phase)
            steps = sorted(curve)
            traces.append(
                {
                    "type": "scatter",
                    "x": steps,
                    "y": [curve[k] for k in steps],
                    "name": f"{side_name(s, i, sides)}, data {s.fingerprint(phase)}",
                    **style(i, s),
                }
            )
        charts.append(
            _chart(
                f"other-{phase}",
                f"loss, phase {phase}: runs on other data than the reference run's ({ref.fingerprint(phase)}): not compared",
                traces,
                {"xaxis": {"title": "step"}, "yaxis": {"title": "loss"}},
                False,
            )
        )
    return charts


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


# --------------------------------------------------------------------------- --judge


def judge_again(paths: list[Path], files: list[Path]) -> list[dict[str, Any]]:
    """Each run's rounds that ran through, each phase's curve judged again by the loss gate
    (loss_gate.judge_loss) against the curve ``files``: what the run would have said against them. The
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
                    refs[p.phase] = recording.offline_reference(res, p.phase, files)
                gate = loss_gate.judge_loss(p.loss, refs[p.phase], p.window.warmup_steps)
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


def _parse(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status of a usage error (2) or of --help (0)."""
    try:
        return ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2


def _paths(names: list[str]) -> list[Path]:
    return [Path(a).expanduser().resolve() for a in names]


def judge_main(argv: list[str]) -> int:
    """``flagbench judge RESULTS.json ... --reference FILE ...`` (``start_task.py --judge``)."""
    ap = argparse.ArgumentParser(prog="flagbench judge", description="judge finished runs' loss curves again against --reference files")
    ap.add_argument("runs", nargs="+", metavar="RESULTS.json", help="the runs to judge (their files stay as they are without --update)")
    ap.add_argument(
        "--reference", action="append", default=[], metavar="FILE", help="a curve to judge against (repeatable: their mean and spread)"
    )
    ap.add_argument(
        "--update", action="store_true", help="write the verdicts into the runs' results.json (a reference made after they ran)"
    )
    args = _parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        files = _paths(args.reference)
        if args.update:
            verdicts = []
            for path in _paths(args.runs):
                print("\n".join(recording.judge_file(path, files)))
                verdicts += [p.gate.verdict for r in tr.load(path).rounds if r.ran_through for p in r.phases]
            return judged_status(verdicts)
        rows = judge_again(_paths(args.runs), files)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_judged(rows)
    return judged_status([r["verdict"] for r in rows])


def record_main(argv: list[str]) -> int:
    """``flagbench record-reference RESULTS.json ... [--why TEXT] [--replace]`` (``start_task.py --record-reference``)."""
    ap = argparse.ArgumentParser(
        prog="flagbench record-reference", description="make runs the reference of their model, phase, recipe and data"
    )
    ap.add_argument(
        "runs",
        nargs="+",
        metavar="RESULTS.json",
        help="a run's curves become the case's reference for its data; several runs of one config: their mean, with the runs and their spread",
    )
    ap.add_argument("--replace", action="store_true", help="replace a reference that exists")
    ap.add_argument("--why", default="", metavar="TEXT", help="why the reference is made or changed (kept in it)")
    args = _parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        print("\n".join(recording.record(_paths(args.runs), args.why, args.replace)))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


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
    args = _parse(ap, argv)
    if isinstance(args, int):
        return args
    try:
        c = comparison(_paths(args.runs), args.with_invalid)
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
