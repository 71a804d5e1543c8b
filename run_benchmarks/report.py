"""Static HTML reports of nightly runs, built from the history database.

One page per night (result tables, loss against the reference, throughput per round,
trends) and an index of all nights.  Plots are PNGs drawn with matplotlib's Agg canvas
and embedded as base64, the style sheet is inline: the pages load with no network.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import os
import sqlite3
from pathlib import Path
from string import Template
from typing import Any, Iterable

from matplotlib.figure import Figure

from run_benchmarks import history
from run_benchmarks.metrics import ALIGN_FROM_STEP

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>
  body { font-family: sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; padding: 0 1em; }
  h1 { font-size: 1.5em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
  table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.88em; }
  th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
  th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .pass, .ok { color: #176317; } .regressed, .failed { color: #b00020; font-weight: bold; } .none { color: #666; }
  ul.findings li { color: #b00020; margin: 0.2em 0; }
  .plots { display: flex; flex-wrap: wrap; gap: 1em; } .plots figure { margin: 0; }
  .plots figcaption { font-size: 0.85em; color: #555; } img.plot { width: 560px; height: auto; border: 1px solid #ddd; }
  pre { background: #f7f7f7; padding: 0.5em; overflow-x: auto; font-size: 0.8em; } .meta { color: #555; }
</style>
</head>
<body>
$body
</body>
</html>
""")

EXIT_MEANING = {0: "no regression", 1: "regression or failure", 2: "bad run list", 130: "interrupted", None: "running"}


def e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _range(lo: str, hi: str) -> str:
    return "-" if lo == hi == "-" else f"{lo} &ndash; {hi}"


def _table(header: Iterable[str], rows: Iterable[Iterable[str]], numeric: frozenset[int] | set[int] = frozenset()) -> str:
    """Cells are HTML already (callers escape text)."""
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td class=\"num\">{c}</td>" if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# --------------------------------------------------------------------------- plots


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(fig: Figure, alt: str, caption: str) -> str:
    return (
        f'<figure><img class="plot" alt="{e(alt)}" src="data:image/png;base64,{_png(fig)}">'
        f"<figcaption>{e(caption)}</figcaption></figure>"
    )


def loss_plot(curves: dict[tuple[int, str], dict[int, float]], title: str) -> str:
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    for (rnd, phase), curve in sorted(curves.items()):
        steps = sorted(curve)
        tag = f" ({phase})" if phase != "train" else ""
        if rnd == 0:
            ax.plot(steps, [curve[s] for s in steps], "k--", lw=1.6, label=f"reference{tag}")
        else:
            ax.plot(steps, [curve[s] for s in steps], lw=1, alpha=0.85, label=f"round {rnd}{tag}")
    if not curves:
        ax.text(0.5, 0.5, "no loss recorded", ha="center", va="center", transform=ax.transAxes)
    elif not any(rnd == 0 for rnd, _ in curves):
        ax.text(0.98, 0.95, "no reference curve committed", ha="right", va="top", transform=ax.transAxes, fontsize=8, color="#666")
    ax.axvline(ALIGN_FROM_STEP, color="grey", lw=0.8, ls=":", label=f"compared from step {ALIGN_FROM_STEP}")
    ax.set(xlabel="step", ylabel="loss", title=title)
    _legend(ax)
    ax.grid(alpha=0.3)
    return _img(fig, f"loss vs reference: {title}", "loss per step, every round, against the committed reference")


def rounds_plot(rounds: list[sqlite3.Row], baseline: float | None, tol_pct: float | None, title: str) -> str:
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    xs = [r["round"] for r in rounds]
    ok = [(r["round"], r["tokens_per_gpu_s"]) for r in rounds if r["status"] == "ok" and r["tokens_per_gpu_s"] is not None]
    bad = [r["round"] for r in rounds if r["status"] != "ok"]
    if ok:
        ax.bar([x for x, _ in ok], [y for _, y in ok], color="#4a78b5", label="ok round")
    for i, x in enumerate(bad):
        ax.bar([x], [0], color="#b00020")
        ax.annotate("failed", (x, 0), ha="center", va="bottom", color="#b00020", fontsize=9, xytext=(0, 3), textcoords="offset points")
    if baseline:
        ax.axhline(baseline, color="k", lw=1, label="baseline median")
        if tol_pct:
            ax.axhline(baseline * (1 - tol_pct / 100), color="#b00020", lw=1, ls="--", label=f"tolerance -{tol_pct:g}%")
    top = max([y for _, y in ok] + [baseline or 0])
    ax.set_ylim(0, 1.15 * top if top > 0 else 1)
    ax.set_xticks(xs or [1])
    ax.set(xlabel="round", ylabel="tokens per GPU per second", title=title)
    _legend(ax)
    ax.grid(axis="y", alpha=0.3)
    return _img(fig, f"throughput per round: {title}", "tokens/p/s of each round (failed rounds marked)")


def trend_plot(db: sqlite3.Connection, runs: list[sqlite3.Row], title: str) -> str:
    fig = Figure(figsize=(6.4, 4.4))
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    xs = list(range(1, len(runs) + 1))
    med, lo, hi, mem = [], [], [], []
    for r in runs:
        s = history.stats_of(db, r["id"])
        t, m = s.get("tokens_per_gpu_s", {}), s.get("peak_mem_gib", {})
        med.append(t.get("median"))
        lo.append(t.get("min"))
        hi.append(t.get("max"))
        mem.append(m.get("median"))
    have = [i for i, v in enumerate(med) if v is not None]
    if have:
        ax.errorbar([xs[i] for i in have], [med[i] for i in have],
                    yerr=[[med[i] - lo[i] for i in have], [hi[i] - med[i] for i in have]],
                    fmt="o-", capsize=3, color="#4a78b5", label="median (min-max)")  # fmt: skip
    bad = [i for i, r in enumerate(runs) if r["verdict"] == "regressed"]
    if bad:
        ax.plot([xs[i] for i in bad], [med[i] or 0 for i in bad], "x", color="#b00020", ms=10, mew=2, ls="none", label="regressed")
    ax.set(ylabel="tokens/p/s", title=title)
    ax.grid(alpha=0.3)
    _legend(ax)
    ax2.plot([xs[i] for i, v in enumerate(mem) if v is not None], [v for v in mem if v is not None], "s-", color="#7a5195")
    ax2.set(ylabel="peak mem (GiB)", xlabel="run")
    ax2.grid(alpha=0.3)
    step = max(1, len(xs) // 10)
    ax2.set_xticks(xs[::step] or [1])
    ax2.set_xticklabels([r["started"][5:16].replace("T", " ") for r in runs][::step] or [""], rotation=30, fontsize=7)
    return _img(fig, f"trend: {title}", f"history of this case, vendor, hardware and config ({len(runs)} run(s))")


# --------------------------------------------------------------------------- pages


def _verdict_cell(v: str) -> str:
    cls = {"pass": "pass", "regressed": "regressed"}.get(v, "none")
    return f'<span class="{cls}">{e(v)}</span>'


def _loss_cell(flag: int | None) -> str:
    return {None: '<span class="none">no reference</span>', 1: '<span class="ok">aligned</span>', 0: '<span class="failed">NOT aligned</span>'}[flag]


def _config_text(row: sqlite3.Row) -> str:
    sets = json.loads(row["user_overrides_json"])
    return row["config_name"] + (" " + ", ".join(f"{o['param']}={o['value']}" for o in sets) if sets else "")


def _case_section(db: sqlite3.Connection, row: sqlite3.Row) -> str:
    st = history.stats_of(db, row["id"])
    rounds = db.execute("SELECT * FROM rounds WHERE run = ? ORDER BY round", (row["id"],)).fetchall()
    findings = db.execute("SELECT * FROM findings WHERE run = ?", (row["id"],)).fetchall()
    baseline = json.loads(row["baseline_json"]).get("tokens_per_gpu_s")
    tol_pct = json.loads(row["tolerances_json"]).get("throughput_drop_pct")
    title = f"{row['case_key']} on {row['vendor']}"
    out = [f'<h2 id="run-{row["id"]}">{e(title)} &mdash; {_verdict_cell(row["verdict"])}</h2>']
    out.append(
        f'<p class="meta">run <code>{e(row["run_id"])}</code>, config {e(_config_text(row))} [{e(row["config_key"][:8])}], '
        f"hardware {e(row['hardware_key'])}, folder <code>{e(row['run_dir'])}</code></p>"
    )
    if row["error"]:
        out.append(f'<p class="failed">the case broke off: {e(row["error"])}</p>')
    if findings:
        out.append('<ul class="findings">' + "".join(f"<li>{e(f['message'])}</li>" for f in findings) + "</ul>")
    agg = []
    for metric, label, fmt in (("tokens_per_gpu_s", "tokens/p/s", _f), ("mfu_6n", "MFU-6N", _pct), ("mfu_palm", "MFU-PaLM", _pct), ("peak_mem_gib", "peak mem (GiB)", lambda x: _f(x, ".3f"))):
        s = st.get(metric, {})
        agg.append([e(label), str(s.get("n", 0)), fmt(s.get("median")), fmt(s.get("min")), fmt(s.get("max")), _range(fmt(s.get("q1")), fmt(s.get("q3"))), fmt(s.get("olympic"))])
    out.append(f"<p>{row['rounds_ok']} of {row['rounds_requested']} round(s) ok, <b>{row['rounds_failed']} failed</b>; loss {_loss_cell(row['loss_aligned'])}</p>")
    out.append(_table(["metric", "ok rounds", "median", "min", "max", "IQR", "olympic mean (5+ rounds)"], agg, {1, 2, 3, 4, 5, 6}))
    rrows = [
        [str(r["round"]), f'<span class="{"ok" if r["status"] == "ok" else "failed"}">{e(r["status"])}</span>', _f(r["duration_s"]),
         _f(r["tokens_per_gpu_s"]), _pct(r["mfu_6n"]), _pct(r["mfu_palm"]), _f(r["peak_mem_gib"], ".3f"),
         "-" if r["loss_mre"] is None else f"{100 * r['loss_mre']:.2f}%", _loss_cell(r["loss_aligned"]), e((r["error"] or "").splitlines()[0] if r["error"] else "")]
        for r in rounds
    ]  # fmt: skip
    out.append(_table(["round", "status", "duration (s)", "tokens/p/s", "MFU-6N", "MFU-PaLM", "peak mem (GiB)", "loss MRE", "loss", "error"], rrows, {0, 2, 3, 4, 5, 6, 7}))
    trend = history.runs_of_identity(db, history.identity_of(row), up_to_run=row["id"])
    out.append(
        '<div class="plots">'
        + loss_plot(history.losses_of(db, row["id"]), title)
        + rounds_plot(rounds, baseline, tol_pct, title)
        + trend_plot(db, trend, title)
        + "</div>"
    )
    details = {"settings": json.loads(row["settings_json"]), "vendor overrides": json.loads(row["overrides_json"]),
               "user overrides": json.loads(row["user_overrides_json"]), "hardware": json.loads(row["hardware_json"]),
               "system": json.loads(row["system_json"])}  # fmt: skip
    out.append(f"<details><summary>config and system</summary><pre>{e(json.dumps(details, indent=2))}</pre></details>")
    return "\n".join(out)


def night_path(db: sqlite3.Connection, night_id: int, out_dir: Path) -> Path:
    started = db.execute("SELECT started FROM nights WHERE id = ?", (night_id,)).fetchone()["started"]
    stamp = dt.datetime.fromisoformat(started).strftime("%Y%m%d-%H%M%S")
    return out_dir / f"nightly-{stamp}-{night_id}.html"


def write_night(db: sqlite3.Connection, night_id: int, out_dir: Path, exit_status: int | None) -> Path:
    """The page of one night; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    night = db.execute("SELECT * FROM nights WHERE id = ?", (night_id,)).fetchone()
    runs = db.execute("SELECT * FROM runs WHERE night_id = ? ORDER BY id", (night_id,)).fetchall()
    findings = db.execute("SELECT f.* FROM findings f JOIN runs r ON f.run = r.id WHERE r.night_id = ?", (night_id,)).fetchall()
    status = "regressed" if findings else "pass"
    body = [
        f"<h1>Nightly {e(night['started'])}: {_verdict_cell(status)}</h1>",
        (
            f'<p class="meta">run list <code>{e(night["runlist_path"])}</code> on {e(night["host"])}; exit status {e(exit_status)} '
            f"({e(EXIT_MEANING.get(exit_status, '?'))}); <a href=\"index.html\">all nights</a></p>"
        ),
    ]
    body.append(
        '<ul class="findings">' + "".join(f"<li>{e(f['message'])}</li>" for f in findings) + "</ul>" if findings else '<p class="pass">No regression.</p>'
    )
    rows = []
    for r in runs:
        st = history.stats_of(db, r["id"])
        tps, mem, mfu = st.get("tokens_per_gpu_s", {}), st.get("peak_mem_gib", {}), st.get("mfu_6n", {})
        rows.append([
            f'<a href="#run-{r["id"]}">{e(r["case_key"])}</a>', e(r["vendor"]), e(_config_text(r)), f"{r['rounds_ok']}/{r['rounds_failed']}",
            _f(tps.get("median")), _range(_f(tps.get("min")), _f(tps.get("max"))), _range(_f(tps.get("q1")), _f(tps.get("q3"))),
            _f(tps.get("olympic")), _pct(mfu.get("median")), _f(mem.get("median"), ".3f"), _loss_cell(r["loss_aligned"]),
            str(r["baseline_runs"]), _verdict_cell(r["verdict"]),
        ])  # fmt: skip
    body.append(_table(["case", "vendor", "config", "rounds ok/failed", "tokens/p/s median", "min-max", "IQR", "olympic", "MFU-6N", "mem (GiB)", "loss", "baseline runs", "verdict"], rows, {3, 4, 5, 6, 7, 8, 9, 11}))
    body += [_case_section(db, r) for r in runs]
    page = night_path(db, night_id, out_dir)
    _write(page, PAGE.substitute(title=f"flagbench nightly {night['started']}", body="\n".join(body)))
    return page


def write_index(db: sqlite3.Connection, out_dir: Path) -> Path:
    """index.html: every night with its verdict, and the trend of every case identity."""
    out_dir.mkdir(parents=True, exist_ok=True)
    nights = db.execute("SELECT * FROM nights ORDER BY started DESC, id DESC").fetchall()
    rows = []
    for n in nights:
        cnt = db.execute("SELECT count(*) AS runs, sum(verdict = 'regressed') AS bad FROM runs WHERE night_id = ?", (n["id"],)).fetchone()
        link = e(n["started"])
        if n["report_path"]:
            href = os.path.relpath(n["report_path"], out_dir)
            link = f'<a href="{e(href)}">{link}</a>'
        rows.append([link, e(n["host"]), f"<code>{e(n['runlist_path'])}</code>", str(cnt["runs"]), str(cnt["bad"] or 0),
                     f"{e(n['exit_status'])} ({e(EXIT_MEANING.get(n['exit_status'], '?'))})"])  # fmt: skip
    body = ["<h1>flagbench nightly history</h1>", _table(["night", "host", "run list", "cases", "regressed", "exit status"], rows, {3, 4})]
    body.append("<h2>Trends</h2>")
    plots = []
    for ident in db.execute("SELECT DISTINCT case_key, vendor, hardware_key, config_key FROM runs ORDER BY case_key, vendor").fetchall():
        runs = history.runs_of_identity(db, dict(ident))
        plots.append(trend_plot(db, runs, f"{ident['case_key']} on {ident['vendor']} ({_config_text(runs[-1])})"))
    body.append('<div class="plots">' + "".join(plots) + "</div>" if plots else "<p>No runs yet.</p>")
    page = out_dir / "index.html"
    _write(page, PAGE.substitute(title="flagbench nightly history", body="\n".join(body)))
    return page


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
