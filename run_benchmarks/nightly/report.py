"""Static HTML reports of nightly runs, built from the history database.

One page per night (result tables, loss against the reference, throughput per round,
trends) and an index of all nights.  Plots are PNGs drawn with matplotlib's Agg canvas
and embedded as base64, the style sheet is inline: the pages load with no network.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sqlite3
from pathlib import Path

from matplotlib.figure import Figure

from run_benchmarks.judging.loss_gate import ALIGN_FROM_STEP
from run_benchmarks.judging.pages import PAGE, e, img, legend, table
from run_benchmarks.judging.results import figure
from run_benchmarks.nightly import history
from run_benchmarks.typed_results import CLEAN

EXIT_MEANING = {0: "no regression", 1: "regression or failure", 2: "bad run list", 130: "interrupted", None: "running"}


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _range(lo: str, hi: str) -> str:
    return "-" if lo == hi == "-" else f"{lo} &ndash; {hi}"


# --------------------------------------------------------------------------- plots


def loss_plot(curves: dict[tuple[int, str], dict[int, float]], title: str) -> str:
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    for (rnd, phase), curve in sorted(curves.items()):
        steps = sorted(curve)
        curve = {k: math.nan if v is None else v for k, v in curve.items()}  # a NaN loss is stored as NULL
        tag = f" ({phase})" if phase != "train" else ""
        if rnd == 0:
            ax.plot(steps, [curve[s] for s in steps], "k--", lw=1.6, label=f"reference{tag}")
        else:
            ax.plot(steps, [curve[s] for s in steps], lw=1, alpha=0.85, label=f"round {rnd}{tag}")
    if not curves:
        ax.text(0.5, 0.5, "no loss recorded", ha="center", va="center", transform=ax.transAxes)
    elif not any(rnd == 0 for rnd, _ in curves):
        ax.text(0.98, 0.95, "no reference curve", ha="right", va="top", transform=ax.transAxes, fontsize=8, color="#666")
    ax.axvline(ALIGN_FROM_STEP, color="grey", lw=0.8, ls=":", label=f"compared from step {ALIGN_FROM_STEP}")
    ax.set(xlabel="step", ylabel="loss", title=title)
    legend(ax)
    ax.grid(alpha=0.3)
    return img(fig, f"loss vs reference: {title}", "loss per step, every round and phase, against the reference it was judged with")


def rounds_plot(phases: list[sqlite3.Row], baseline: dict[str, dict[str, float | None]], tol_pct: float | None, title: str) -> str:
    """tokens/p/s of every round and phase; a round that is not ok is marked with its status, and only
    ok rounds are drawn as plain bars."""
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    names = list(dict.fromkeys(p["phase"] for p in phases))
    width = 0.8 / max(1, len(names))
    top = 0.0
    for i, name in enumerate(names):
        rows = [p for p in phases if p["phase"] == name]
        xs = [p["round"] - 0.4 + width * (i + 0.5) for p in rows]
        tag = f" {name}" if len(names) > 1 else ""
        for x, p in zip(xs, rows):
            y = p["tokens_per_gpu_s"] if p["status"] in CLEAN else 0
            ax.bar(
                [x],
                [y or 0],
                width=width * 0.9,
                color=f"C{i}",
                hatch=None if p["status"] == "ok" else "//",
                alpha=1 if p["status"] == "ok" else 0.5,
            )
            top = max(top, y or 0)
            if p["status"] != "ok":
                ax.annotate(
                    p["status"],
                    (x, y or 0),
                    ha="center",
                    va="bottom",
                    color="#b00020",
                    fontsize=8,
                    xytext=(0, 3),
                    textcoords="offset points",
                )
        ax.bar([], [], color=f"C{i}", label=f"round{tag}")
        b = (baseline.get(name) or {}).get("tokens_per_gpu_s")
        if b:
            ax.axhline(b, color=f"C{i}", lw=1, label=f"baseline median{tag}")
            if tol_pct:
                ax.axhline(b * (1 - tol_pct / 100), color=f"C{i}", lw=1, ls="--", label=f"tolerance -{tol_pct:g}%{tag}")
            top = max(top, b)
    ax.set_ylim(0, 1.15 * top if top > 0 else 1)
    ax.set_xticks(sorted({p["round"] for p in phases}) or [1])
    ax.set(xlabel="round", ylabel="tokens per GPU per second", title=title)
    legend(ax)
    ax.grid(axis="y", alpha=0.3)
    return img(
        fig,
        f"throughput per round: {title}",
        "tokens/p/s of each round and phase (a round not ok: hatched, its status written; failed and invalid rounds are not drawn)",
    )


def trend_plot(db: sqlite3.Connection, runs: list[sqlite3.Row], title: str) -> str:
    """Per phase, the median tokens/p/s (min-max) and allocator memory of each run, over its clean rounds."""
    fig = Figure(figsize=(6.4, 4.4))
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    xs = list(range(1, len(runs) + 1))
    stats = [history.stats_of(db, r["id"]) for r in runs]
    names = list(dict.fromkeys(ph for st in stats for ph in st))
    for i, name in enumerate(names):
        tag = f" {name}" if len(names) > 1 else ""
        t = [st.get(name, {}).get("tokens_per_gpu_s", {}) for st in stats]
        have = [k for k, v in enumerate(t) if v.get("median") is not None]
        if have:
            ax.errorbar(
                [xs[k] for k in have],
                [t[k]["median"] for k in have],
                yerr=[[t[k]["median"] - t[k]["min"] for k in have], [t[k]["max"] - t[k]["median"] for k in have]],
                fmt="o-",
                capsize=3,
                color=f"C{i}",
                label=f"median (min-max){tag}",
            )
        mem = [st.get(name, {}).get("peak_mem_gib", {}).get("median") for st in stats]
        ax2.plot([xs[k] for k, v in enumerate(mem) if v is not None], [v for v in mem if v is not None], "s-", color=f"C{i}")
        bad = [k for k, r in enumerate(runs) if r["verdict"] == "regressed"]
        if bad and i == 0:
            ax.plot(
                [xs[k] for k in bad],
                [t[k].get("median") or 0 for k in bad],
                "x",
                color="#b00020",
                ms=10,
                mew=2,
                ls="none",
                label="regressed",
            )
    ax.set(ylabel="tokens/p/s", title=title)
    ax.grid(alpha=0.3)
    legend(ax)
    ax2.set(ylabel="mem alloc (GiB)", xlabel="run")
    ax2.grid(alpha=0.3)
    step = max(1, len(xs) // 10)
    ax2.set_xticks(xs[::step] or [1])
    ax2.set_xticklabels([r["started"][5:16].replace("T", " ") for r in runs][::step] or [""], rotation=30, fontsize=7)
    return img(fig, f"trend: {title}", f"history of this case, vendor, hardware and config ({len(runs)} run(s)), clean rounds only")


# --------------------------------------------------------------------------- pages


def _verdict_cell(v: str) -> str:
    cls = {"pass": "pass", "regressed": "regressed"}.get(v, "none")
    return f'<span class="{cls}">{e(v)}</span>'


def _loss_cell(flag: int | None) -> str:
    return {
        None: '<span class="none">not judged</span>',
        1: '<span class="ok">aligned</span>',
        0: '<span class="failed">NOT aligned</span>',
    }[flag]


def _verdict_text(verdict: str, reason: str | None) -> str:
    cls = {"aligned": "ok", "not aligned": "failed"}.get(verdict, "none")
    return f'<span class="{cls}">{e(verdict)}</span>' + (f" ({e(reason)})" if reason and verdict != "aligned" else "")


def _status(status: str) -> str:
    return f'<span class="{"ok" if status == "ok" else "none" if status == "unjudged" else "failed"}">{e(status)}</span>'


def _rounds_text(row: sqlite3.Row) -> str:
    return (
        f"{row['rounds_ok']} of {row['rounds_requested']} round(s) ok, {row['rounds_unjudged']} unjudged, "
        f"<b>{row['rounds_invalid']} invalid, {row['rounds_failed']} failed</b>"
    )


def _config_text(row: sqlite3.Row) -> str:
    sets = json.loads(row["user_overrides_json"])
    return row["config_name"] + (" " + ", ".join(f"{o['param']}={o['value']}" for o in sets) if sets else "")


AGGREGATES = (
    ("tokens_per_gpu_s", "tokens/p/s", _f),
    ("mfu_6n", "MFU-6N", _pct),
    ("mfu_palm", "MFU-PaLM", _pct),
    ("peak_mem_gib", "mem allocated (GiB)", lambda x: _f(x, ".3f")),
    ("device_mem_used_gib", "mem in use (GiB)", lambda x: _f(x, ".2f")),
    ("tokens_per_joule", "tokens/J per device", lambda x: _f(x, ".2f")),
)


def _phase_row(p: sqlite3.Row) -> list[str]:
    """One round's phase; the figures of a round that is not ok carry its status."""
    fig = lambda text: e(figure(text, p["status"]))
    used = (
        "-"
        if p["device_mem_used_gib"] is None
        else (f"{p['device_mem_used_gib']:.2f}" + (f"/{p['device_mem_total_gib']:.0f}" if p["device_mem_total_gib"] else ""))
    )
    return [
        str(p["round"]),
        e(p["phase"]),
        _status(p["status"]),
        fig(_f(p["tokens_per_gpu_s"])),
        fig(_pct(p["mfu_6n"])),
        fig(_pct(p["mfu_palm"])),
        fig(_f(p["peak_mem_gib"], ".3f")),
        fig(used),
        "-" if p["loss_mre"] is None else f"{100 * p['loss_mre']:.2f}%",
        _verdict_text(p["loss_verdict"], p["loss_reason"]),
        e((p["error"] or "").splitlines()[0] if p["error"] else ""),
    ]


def _case_section(db: sqlite3.Connection, row: sqlite3.Row) -> str:
    st = history.stats_of(db, row["id"])
    phases = history.phases_of(db, row["id"])
    findings = db.execute("SELECT * FROM findings WHERE run = ?", (row["id"],)).fetchall()
    baseline = json.loads(row["baseline_json"])
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
    agg = [
        [
            e(ph),
            e(label),
            str(s.get(m, {}).get("n", 0)),
            *(fmt(s.get(m, {}).get(k)) for k in ("median", "min", "max")),
            _range(fmt(s.get(m, {}).get("q1")), fmt(s.get(m, {}).get("q3"))),
            fmt(s.get(m, {}).get("olympic")),
        ]
        for ph, s in st.items()
        for m, label, fmt in AGGREGATES
        if m != "tokens_per_joule" or s.get(m, {}).get("n")  # energy only where a monitor read power
    ]
    out.append(f"<p>{_rounds_text(row)}; loss {_loss_cell(row['loss_aligned'])}</p>")
    out.append(
        table(["phase", "metric", "clean rounds", "median", "min", "max", "IQR", "olympic mean (5+ rounds)"], agg, {2, 3, 4, 5, 6, 7})
    )
    out.append(
        table(
            [
                "round",
                "phase",
                "status",
                "tokens/p/s",
                "MFU-6N",
                "MFU-PaLM",
                "mem allocated (GiB)",
                "mem in use (GiB)",
                "loss MRE",
                "loss",
                "error",
            ],
            [_phase_row(p) for p in phases],
            {0, 3, 4, 5, 6, 7, 8},
        )
    )
    trend = history.runs_of_identity(db, history.identity_of(row), up_to_run=row["id"])
    out.append(
        '<div class="plots">'
        + loss_plot(history.losses_of(db, row["id"]), title)
        + rounds_plot(phases, baseline, tol_pct, title)
        + trend_plot(db, trend, title)
        + "</div>"
    )
    details = {
        "settings": json.loads(row["settings_json"]),
        "vendor overrides": json.loads(row["overrides_json"]),
        "user overrides": json.loads(row["user_overrides_json"]),
        "hardware": json.loads(row["hardware_json"]),
        "system": json.loads(row["system_json"]),
    }
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
            f'({e(EXIT_MEANING.get(exit_status, "?"))}); <a href="index.html">all nights</a></p>'
        ),
    ]
    body.append(
        '<ul class="findings">' + "".join(f"<li>{e(f['message'])}</li>" for f in findings) + "</ul>"
        if findings
        else '<p class="pass">No regression.</p>'
    )
    rows = []
    for r in runs:
        for ph, st in (history.stats_of(db, r["id"]) or {"-": {}}).items():
            tps, mem, used, mfu = (st.get(m, {}) for m in ("tokens_per_gpu_s", "peak_mem_gib", "device_mem_used_gib", "mfu_6n"))
            rows.append(
                [
                    f'<a href="#run-{r["id"]}">{e(r["case_key"])}</a>',
                    e(r["vendor"]),
                    e(_config_text(r)),
                    e(ph),
                    e(history.rounds_text(r)),
                    _f(tps.get("median")),
                    _range(_f(tps.get("min")), _f(tps.get("max"))),
                    _range(_f(tps.get("q1")), _f(tps.get("q3"))),
                    _f(tps.get("olympic")),
                    _pct(mfu.get("median")),
                    _f(mem.get("median"), ".3f"),
                    _f(used.get("median"), ".2f"),
                    _loss_cell(r["loss_aligned"]),
                    str(r["baseline_runs"]),
                    _verdict_cell(r["verdict"]),
                ]
            )
    body.append(
        '<p class="meta">Figures are medians over each run\'s clean rounds (ok or unjudged); rounds ok/unjudged/invalid/failed.</p>'
    )
    body.append(
        table(
            [
                "case",
                "vendor",
                "config",
                "phase",
                "rounds ok/unjudged/invalid/failed",
                "tokens/p/s median",
                "min-max",
                "IQR",
                "olympic",
                "MFU-6N",
                "mem alloc (GiB)",
                "mem in use (GiB)",
                "loss",
                "baseline runs",
                "verdict",
            ],
            rows,
            {5, 6, 7, 8, 9, 10, 11, 13},
        )
    )
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
        rows.append(
            [
                link,
                e(n["host"]),
                f"<code>{e(n['runlist_path'])}</code>",
                str(cnt["runs"]),
                str(cnt["bad"] or 0),
                f"{e(n['exit_status'])} ({e(EXIT_MEANING.get(n['exit_status'], '?'))})",
            ]
        )
    body = ["<h1>flagbench nightly history</h1>", table(["night", "host", "run list", "cases", "regressed", "exit status"], rows, {3, 4})]
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
