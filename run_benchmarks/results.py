"""results.json, results.md and the terminal table: one shape, the seeds' columns."""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = ["config", "phase", "precision", "parallel", "fix_hp", "tokens/p/s", "loss aligned", "mem (GiB)", "MFU-6N", "MFU-PaLM", "status"]


def system_info() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def layout(parallel: dict[str, Any]) -> str:
    """The seeds' ``PPxDPyTPz`` notation (plus extra degrees where a case has them)."""
    s = f"PP{parallel.get('pp', 1)}DP{parallel.get('dp', '?')}TP{parallel.get('tp', 1)}"
    for key, tag in (("sharding_stage", "SH"), ("zero_stage", "ZeRO")):
        if parallel.get(key) is not None:
            s += f"{tag}{parallel[key]}"
    return s


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mem(phase_mem: dict[str, Any]) -> str:
    used, total = phase_mem.get("peak_mem_gib"), phase_mem.get("total_mem_gib")
    if used is None:
        return "-"
    return f"{used:.2f}/{total:.0f}" if total else f"{used:.2f}"


def _aligned(p: dict[str, Any]) -> str:
    if p.get("loss_aligned") is None:
        return "no reference" if p.get("loss_mre") is None else "-"
    return f"{p['loss_aligned']} ({100 * p['loss_mre']:.2f}%)"


def rows(results: dict[str, Any]) -> list[list[str]]:
    out = []
    fix = ", ".join(f"{o['param']}={o['value']}" for o in results.get("user_overrides", [])) or "/"
    for rnd in results["rounds"]:
        phases = rnd.get("phases") or [{}]
        for p in phases:
            tps = p.get("tokens_per_gpu_s")
            out.append(
                [
                    f"{results['config_name']} r{rnd['round']}",
                    p.get("phase", "-"),
                    results["settings"]["train"]["precision"],
                    p.get("layout") or rnd.get("layout", "-"),
                    fix,
                    "-" if tps is None else f"{tps:.1f}",
                    _aligned(p),
                    _mem({"peak_mem_gib": p.get("peak_mem_gib", rnd.get("peak_mem_gib")), "total_mem_gib": rnd.get("total_mem_gib")}),
                    _pct(p.get("mfu_6n")),
                    _pct(p.get("mfu_palm")),
                    rnd["status"] + (f": {rnd['error'][:60]}" if rnd.get("error") else ""),
                ]
            )
    return out


def markdown(results: dict[str, Any]) -> str:
    hw = results["hardware_info"]
    peak = "unknown" if hw["peak_flops"] is None else f"{hw['peak_flops'] / 1e12:.0f} TFLOP/s"
    head = (
        f"# {results['case']} on {results['vendor']}\n\n"
        f"run `{results['run_id']}`, {results['started']}, config `{results['config_name']}`"
        f"{'' if results['validated'] else ' (not yet validated on hardware)'}, "
        f"{results['nnodes']} node(s) x {results['nprocs']} process(es), peak {peak} "
        f"({hw['chip']} {hw['precision']})\n\n"
    )
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows(results)]
    ov = results.get("overrides") or []
    notes = ["", "Vendor overrides: " + (", ".join(f"`{o['param']}`={o['value']} (standard {o['standard']})" for o in ov) or "none")]
    if results.get("user_overrides"):
        notes.append("User overrides (not a standard run): " + ", ".join(f"`{o['param']}`={o['value']} (standard {o['standard']})" for o in results["user_overrides"]))
    notes += breakdown_lines(results)
    return head + "\n".join(lines + notes) + "\n"


def breakdown_lines(results: dict[str, Any]) -> list[str]:
    """A markdown table per profiled step (``train.profile_step``): where the step's time went."""
    out: list[str] = []
    for rnd in results["rounds"]:
        for p in rnd.get("phases") or []:
            for rank, b in sorted((p.get("step_breakdown") or {}).items(), key=lambda kv: int(kv[0])):
                wall, ref = b["step_time_s"], b.get("window_step_time_s")

                def row(name: str, t: float | None, of_ref: bool = True) -> str:
                    if t is None:
                        return f"| {name} | - | - | - |"
                    return f"| {name} | {t:.3f} | {_pct(t / wall if wall else None)} | {_pct(t / ref if ref and of_ref else None)} |"

                out += ["", f"Step {b['step']} of round {rnd['round']}, phase {p['phase']}, rank {rank} "
                        f"(pipeline stage {b.get('pp_rank', 0)}), profiled from {b['source']}: {wall:.3f} s under the profiler, "
                        + (f"{ref:.3f} s for an ordinary step of the window" if ref else "no window step to compare"),
                        "", "| part | time (s) | of the profiled step | of an ordinary step |", "|---|---|---|---|"]  # fmt: skip
                for name, c in b["categories"].items():
                    out.append(row(name, c["kernel_s"]))
                out.append(row("communication not overlapped", b["communication_exposed_s"]))
                out.append(row("idle under the profiler", b["idle_s"], of_ref=False))
                out.append(row("idle in an ordinary step (estimate)", b.get("idle_estimate_s")))
                out.append(row("optimizer region (host included)", b["optimizer_wall_s"]))
                out.append(f"\nTrace: `{b.get('trace')}` in the rank's output folder; the profiled step is left out of the "
                           "throughput window. Kernels on several streams overlap, so the parts may add up to more than the step.")
    return out


def print_table(results: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze the table to 80 columns
        console.width = max(console.width, 180)
    table = Table(title=f"{results['case']} / {results['vendor']} / {results['config_name']}")
    for c in COLUMNS:
        table.add_column(c)
    for r in rows(results):
        table.add_row(*r)
    console.print(table)


def write(results: dict[str, Any], run_dir: Path) -> None:
    """Write results.json and results.md atomically (finished rounds are never lost)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(results, indent=2, default=str)), ("results.md", markdown(results))):
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, run_dir / name)
