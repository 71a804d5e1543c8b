"""The interactive charts of ``flagbench compare``'s page: per phase, the loss per step of every
run with the judged steps marked and a zoom onto them, the relative difference to the reference
run per step, and tokens/p/s per step (plotly, written into the page so it works offline).
"""

from __future__ import annotations

import math
from typing import Any

from run_benchmarks.judging import loss_gate, pages

Side = Any  # compare.Side (a run as compared: its label, tag, results and rounds), which imports this module


def side_name(s: Side, i: int, sides: list[Side]) -> str:
    """A run as the page names it: its place, what ran, and its run id, host and date."""
    return f"{'reference' if s is sides[-1] else f'run {i + 1}'}: {s.label} ({s.tag})"


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
