"""results.json, results.md and the terminal table: one shape, the seeds' columns."""

from __future__ import annotations

import errno
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from run_benchmarks.typed_results import (
    DeviceClocks,
    DeviceEnergy,
    DeviceMemory,
    LossGate,
    PhaseResult,
    Reference,
    RunResults,
    Spread,
)
from training.metriclog import K_KERNEL_CEILING

COLUMNS = [
    "config",
    "phase",
    "precision",
    "parallel",
    "fix_hp",
    "tokens/p/s",
    "steps p10-p90",
    "loss",
    "mem allocated (GiB)",
    "mem in use (GiB)",
    "MFU-6N",
    "MFU-PaLM",
    "of ceiling",
    "tokens/J",
    "status",
]


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


def _gib(used: float | None, total: float | None) -> str:
    if used is None:
        return "-"
    return f"{used:.2f}/{total:.0f}" if total else f"{used:.2f}"


def allocated_cell(peak: float | None, reserved: float | None, total: float | None, retries: int | None = None) -> str:
    """The allocator's peak over the device's total, with what its cache reserved where reported
    and how often it had to give its cache back for want of a free block, where it did:
    ``118.00/140 (reserved 125.80, 3 allocator retries)``; the gap between the first two is memory
    held but unused (fragmentation), and a retry stalls the device."""
    notes = ([] if reserved is None else [f"reserved {reserved:.2f}"]) + (
        [f"{retries} allocator retr{'y' if retries == 1 else 'ies'}"] if retries else []
    )
    return _gib(peak, total) + (f" ({', '.join(notes)})" if notes else "")


def device_mem(m: DeviceMemory | None) -> str:
    """The monitor's device memory in use, ``used/total`` GiB as in the seeds' column; "-" without a device."""
    return "-" if m is None else _gib(m.used_gib, m.total_gib) + ("" if m.scope == "phase" else " (round)")


def ceiling_cell(eff: float | None, ceiling: float | None) -> str:
    """The run's tokens/p/s over its kernel ceiling, with the ceiling: ``72.9% of 12,641``. A ceiling
    below the run's own throughput is no ceiling (its kernels were timed on a busy or slowed
    device): a failed measurement, said so, never a percentage above 100."""
    if ceiling is None:
        return "-"
    if eff is not None and eff > 1.0:
        return f"failed: ceiling {ceiling:,.0f} below the run's own throughput (timed on a busy device?)"
    return f"{'-' if eff is None else _pct(eff)} of {ceiling:,.0f}"


def energy_cell(e: DeviceEnergy | None) -> str:
    """Tokens per joule per device over the window, with the mean power and its source:
    ``12.9 (510 W, energy counter)``; "-" where no monitor read a device's power."""
    if e is None:
        return "-"
    return f"{e.tokens_per_joule:,.2f} ({e.mean_power_w:,.0f} W, {e.source})"


def energy_text(e: DeviceEnergy) -> str:
    """``12.92 tokens per joule per device: 510 W mean per device over the window (NVML's energy counter, 1 GPU, 84 samples), power limit 700 W``."""
    source = "NVML's energy counter" if e.source == "energy counter" else "the mean of the power samples: no energy counter"
    limit = ", power limit " + " / ".join(f"{w:,.0f} W" for w in e.power_limit_w) if e.power_limit_w else ", power limit not read"
    return (
        f"{e.tokens_per_joule:,.2f} tokens per joule per device: {e.mean_power_w:,.0f} W mean per device over the window "
        f"({source}, {e.devices} GPU(s), {e.samples} samples){limit}"
    )


def energy_lines(res: RunResults) -> list[str]:
    """Energy per token of each phase, where a monitor read the devices' power."""
    out = [f"- round {r.round}, phase {p.phase}: {energy_text(p.device_energy)}" for r in res.rounds for p in r.phases if p.device_energy]
    return ["", "Energy over the tokens/p/s window:", *out] if out else []


def spread_cell(s: Spread | None) -> str:
    """The window's per-step tokens/p/s from its 10th to its 90th percentile: ``9,480-9,590``."""
    return "-" if s is None else f"{s.p10:,.1f}-{s.p90:,.1f}"


def repeats_note(ref: Reference | None) -> str:
    """A reference made from repeats: ``mean of 4 runs, spread 1.10%``; "" for one curve."""
    if ref is None or ref.spread is None:
        return ""
    return f"mean of {len(ref.repeats)} runs, spread {_mre(ref.spread)}"


def loss_cell(g: LossGate, ref: Reference | None = None, loss_final: float | None = None) -> str:
    """The gate's verdict; against a mean of repeats, with their spread (a not-judged reason says it);
    not judged: the phase's final loss and the reason."""
    note = repeats_note(ref)
    figure = _mre(g.mre) + (f", {g.noise_units:.1f} x noise" if g.noise_units is not None else "") + (f"; {note}" if note else "")
    if g.verdict == "aligned":
        return f"aligned ({figure})" + ("; numerics differ" if g.numerics_differ else "")
    if g.verdict == "not aligned":
        return g.reason if g.nonfinite_step is not None else f"NOT aligned ({figure})"
    return ("" if loss_final is None else f"loss {loss_final:.4f}; ") + f"not judged: {g.reason}"


def _mre(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def figure(text: str, status: str) -> str:
    """A round's figure as a table shows it: a round that is not ok carries its status in the cell."""
    return text if status == "ok" or text == "-" else f"{status}: {text}"


def status_text(error: str, width: int = 60) -> str:
    """An error's first line as a status cell holds it: about ``width`` characters, never cut
    inside a word (letters and digits); " ..." where it was cut."""
    line = error.splitlines()[0]
    if len(line) <= width:
        return line
    cut = next((i for i in range(width, 0, -1) if not (line[i - 1].isalnum() and line[i].isalnum())), width)
    return line[:cut].rstrip() + " ..."


def rows(res: RunResults) -> list[list[str]]:
    out = []
    fix = ", ".join(f"{o['param']}={o['value']}" for o in res.user_overrides) or "/"
    for rnd in res.rounds:
        status = rnd.status + (f": {status_text(rnd.error)}" if rnd.error and rnd.status != "ok" else "")
        for p in rnd.phases:
            fig = lambda text, status=rnd.status: figure(text, status)
            out.append(
                [
                    f"{res.config_name} r{rnd.round}",
                    p.phase,
                    str(res.settings["train"]["precision"]),
                    p.layout or rnd.layout or "-",
                    fix,
                    fig("-" if p.tokens_per_gpu_s is None else f"{p.tokens_per_gpu_s:.1f}"),
                    spread_cell(p.throughput_spread),
                    loss_cell(p.gate, p.reference, p.loss_final),
                    fig(allocated_cell(p.peak_mem_gib, p.reserved_mem_gib, rnd.total_mem_gib, p.alloc_retries)),
                    fig(device_mem(p.device_mem)),
                    fig(_pct(p.mfu_6n)),
                    fig(_pct(p.mfu_palm)),
                    fig(ceiling_cell(p.ceiling_efficiency, p.ceiling_tokens_per_gpu_s)),
                    fig(energy_cell(p.device_energy)),
                    status,
                ]
            )
    return out


def markdown(res: RunResults) -> str:
    hw = res.hardware_info
    peak = "unknown" if hw["peak_flops"] is None else f"{hw['peak_flops'] / 1e12:.0f} TFLOP/s"
    head = (
        f"# {res.case} on {res.vendor}\n\n"
        f"run `{res.run_id}`, {res.started}, config `{res.config_name}`"
        f"{'' if res.validated else ' (not yet validated on hardware)'}, "
        f"{res.nnodes} node(s) x {res.nprocs} process(es), peak {peak} "
        f"({hw['chip']} {hw['precision']})\n\n"
        f"status: **{res.status}**" + (f": {res.error}" if res.error else "") + "\n\n"
    )
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows(res)]
    notes = [
        "",
        "Memory: allocated is the framework allocator's peak over ranks (peak RSS on a CPU), over the device total the "
        "framework reports; in use is the busiest GPU the run used as the monitor saw it (NVML), over its total; "
        '"(round)" where the monitor had no sample inside the phase. A round that is not ok shows its figures with its status.',
        "",
        "Tokens/p/s: the steady window's tokens over its time (steps after the warm-up, a profiled step left out); "
        "steps p10-p90: each window step's own tokens/p/s, from the 10th to the 90th percentile (results.json: "
        "throughput_spread, with the median, lowest and highest).",
        "",
        "Of ceiling: tokens/p/s over the kernel ceiling the case measured on its device before training (its own "
        "GEMMs and attention alone, forward and backward, training/ceiling.py), with that ceiling in tokens/p/s.",
        "",
        "Tokens/J: tokens per joule per device over the same window, tokens/p/s over the GPUs' mean power there "
        "(NVML's energy counter, else the mean of the power samples; '-' where no monitor read a device's power).",
    ]
    notes += ["", "Data: " + data_text(res)]
    ov = res.overrides
    notes += ["", "Vendor overrides: " + (", ".join(f"`{o['param']}`={o['value']} (standard {o['standard']})" for o in ov) or "none")]
    if res.user_overrides:
        notes.append(
            "User overrides (not a standard run): "
            + ", ".join(f"`{o['param']}`={o['value']} (standard {o['standard']})" for o in res.user_overrides)
        )
    notes += conformance_lines(res)
    notes += startup_lines(res)
    notes += beside_lines(res.runtime_info)
    notes += clock_lines(res)
    notes += energy_lines(res)
    notes += breakdown_lines(res)
    return head + "\n".join(lines + notes) + "\n"


def conformance_text(c: dict | None) -> str:
    """One line of a round's conformance verdict (training/conformance/)."""
    if not c:
        return "not run"
    verdict = str(c.get("verdict"))
    if c.get("cached"):
        how = "the verdict of an earlier run on the same stack"
    elif c.get("check_s") is not None:
        how = f"{c['check_s']:.1f} s: probe {c.get('probe_s', 0):.1f} s, reference {c.get('reference_s', 0):.1f} s"
    else:
        how = ""
    return f"{verdict}: {c.get('message')}" + (f" ({how})" if how else "")


def startup_text(s: dict | None) -> str:
    """Rank 0's start-up phases (training/startup.py) in one line."""
    if not s or not s.get("phases"):
        return "not recorded"
    phases = s["phases"]
    parts = [f"{name.replace('_', ' ')} {secs:.1f} s" + (" (apart)" if name == "conformance" else "") for name, secs in phases.items()]
    total = s.get("to_first_step_s")
    tail = "" if total is None else f"; the first step ended {total:.1f} s after the process started, the check left out"
    return ", ".join(parts) + tail


def startup_lines(res: RunResults) -> list[str]:
    """Each round's start-up: where rank 0's time went before its first step ended."""
    out = [f"Start-up (round {r.round}): {startup_text(r.startup)}" for r in res.rounds if r.startup]
    return ["", *out] if out else []


def conformance_lines(res: RunResults) -> list[str]:
    """The conformance check of each round: its verdict, the largest difference, its time."""
    out = []
    for r in res.rounds:
        out.append(f"Conformance (round {r.round}): {conformance_text(r.conformance)}")
    return ["", *out] if out else []


def clock_cell(c: DeviceClocks | None) -> str:
    """The SM clock over a phase's steps in a table cell: ``1,530 (power cap 84%)``, the reason
    held most often beside the median; "-" where the monitor read no clock."""
    if c is None:
        return "-"
    top = max(c.held.items(), key=lambda x: x[1], default=None)
    return f"{c.sm_median_mhz:,.0f}" + (f" ({top[0]} {100 * top[1]:.0f}%)" if top else "")


def clock_text(c: DeviceClocks) -> str:
    """``SM median 1,755 MHz (p10 1,710) of 1,980, held down by the power cap in 64% of samples``."""
    text = f"SM median {c.sm_median_mhz:,.0f} MHz (p10 {c.sm_low_mhz:,.0f})" + (f" of {c.sm_max_mhz:,.0f}" if c.sm_max_mhz else "")
    held = [f"the {r} in {100 * share:.0f}% of samples" for r, share in sorted(c.held.items(), key=lambda x: -x[1])]
    return text + (", held down by " + ", ".join(held) if held else ", never held down")


def hold_text(hold_s: float | None) -> str:
    """``, each part after 3 s of its own load`` for a ceiling timed after a hold
    (``train.ceiling_hold_s``), "" for one timed in bursts."""
    return f", each part after {hold_s:g} s of its own load" if hold_s else ""


def ceiling_clock(p: PhaseResult) -> tuple[float | None, float]:
    """The SM clock the phase's kernel ceiling was timed at (training/ceiling.py), where recorded,
    and the seconds each part ran before it was timed (``train.ceiling_hold_s``; 0: none)."""
    c = (p.meta or {}).get(K_KERNEL_CEILING)
    c = c if isinstance(c, dict) else {}
    mhz, hold = c.get("sm_clock_mhz"), c.get("hold_s") or 0
    return (float(mhz) if isinstance(mhz, (int, float)) and not isinstance(mhz, bool) else None), float(hold)


def clock_lines(res: RunResults) -> list[str]:
    """The GPUs' SM clock over each phase's steps (the monitor's NVML samples of the GPUs the run
    used), and the clock its kernel ceiling was timed at, where either was recorded."""
    out = []
    for rnd in res.rounds:
        for p in rnd.phases:
            at, hold = ceiling_clock(p)
            if p.device_clocks is None and at is None:
                continue
            c = p.device_clocks
            steps = " (no samples)" if c is None else f" ({c.samples} samples): {clock_text(c)}"
            out.append(
                f"- round {rnd.round}, phase {p.phase}{steps}"
                + ("" if at is None else f"; the kernel ceiling was timed at {at:,.0f} MHz{hold_text(hold)}")
            )
    return ["", "GPU clocks over the phase's steps (NVML):", *out] if out else []


def beside_lines(info: dict[str, Any]) -> list[str]:
    """Where a local run claimed some devices of its host: which, and any run seen on the others."""
    claimed = info.get("devices_claimed")
    if not claimed:
        return []
    beside = info.get("runs_beside") or []
    devices = ", ".join(str(d) for d in claimed)
    if not beside:
        return ["", f"Devices: this run claimed device(s) {devices} of its host; no other run held a device of it meanwhile."]
    return [
        "",
        f"Devices: this run claimed device(s) {devices} of its host, beside {'; '.join(beside)} "
        "(other devices, the same host's CPUs, memory and links).",
    ]


def breakdown_lines(res: RunResults) -> list[str]:
    """A markdown table per profiled step (``train.profile_step``): where the step's time went."""
    out: list[str] = []
    for rnd in res.rounds:
        for p in rnd.phases:
            for rank, b in sorted(p.step_breakdown.items(), key=lambda kv: int(kv[0])):
                wall, ref = b["step_time_s"], b.get("window_step_time_s")

                def row(name: str, t: float | None, of_ref: bool = True, wall: float = wall, ref: float | None = ref) -> str:
                    if t is None:
                        return f"| {name} | - | - | - |"
                    return f"| {name} | {t:.3f} | {_pct(t / wall if wall else None)} | {_pct(t / ref if ref and of_ref else None)} |"

                out += [
                    "",
                    f"Step {b['step']} of round {rnd.round}, phase {p.phase}, rank {rank} "
                    f"(pipeline stage {b.get('pp_rank', 0)}), profiled from {b['source']}: {wall:.3f} s under the profiler, "
                    + (f"{ref:.3f} s for an ordinary step of the window" if ref else "no window step to compare"),
                    "",
                    "| part | time (s) | of the profiled step | of an ordinary step |",
                    "|---|---|---|---|",
                ]
                for name, c in b["categories"].items():
                    out.append(row(name, c["kernel_s"]))
                out.append(row("communication not overlapped", b["communication_exposed_s"]))
                out.append(row("idle under the profiler", b["idle_s"], of_ref=False))
                out.append(row("idle in an ordinary step (estimate)", b.get("idle_estimate_s")))
                out.append(row("optimizer region (host included)", b["optimizer_wall_s"]))
                out.append(row("of it with no kernel running", b.get("optimizer_idle_s")))
                out += largest_lines(b.get("largest") or {})
                out += gap_lines(b.get("gaps") or [])
                out.append(
                    f"\nTrace: `{b.get('trace')}` in the rank's output folder; the profiled step is left out of the "
                    "throughput window. Kernels on several streams overlap, so the parts may add up to more than the step."
                )
    return out


def gap_lines(gaps: list[dict[str, Any]], chars: int = 60) -> list[str]:
    """The longest stretches of a profiled step with no kernel running (``gaps`` of its breakdown)
    and the host event around each, as a markdown table."""
    if not gaps:
        return []
    rows = [
        f"| {g['s'] * 1e3:.1f} | {g['at_s']:.3f} | {('`' + g['host'][:chars].replace('`', chr(39)) + '`') if g['host'] else 'no torch operator'} |"
        for g in gaps
    ]
    return ["", "| no kernel running (ms) | from the first kernel (s) | on the host meanwhile |", "|---|---|---|", *rows]


def largest_lines(largest: dict[str, list[dict[str, Any]]], per_part: int = 3, chars: int = 100) -> list[str]:
    """The largest kernels of each part of a profiled step (``largest`` of its breakdown) as a
    markdown table, ``per_part`` a part, each name cut to ``chars``."""
    rows = [
        f"| {part} | `{k['name'][:chars].replace('`', chr(39))}` | {k['kernel_s']:.3f} | {k['calls']} |"
        for part, kernels in largest.items()
        for k in kernels[:per_part]
    ]
    if not rows:
        return []
    return [
        "",
        "Largest kernels of each part (summed over their calls):",
        "",
        "| part | kernel | time (s) | calls |",
        "|---|---|---|---|",
        *rows,
    ]


def data_text(res: RunResults) -> str:
    """Which data each phase read: synthetic, or its files and fingerprint (results.json's ``data``)."""
    from run_benchmarks.planning import datacheck

    phases = list(res.data or {}) or ["train"]
    return "; ".join(f"{ph}: {datacheck.identity_text((res.data or {}).get(ph))}" for ph in phases)


def print_table(res: RunResults, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze the table to 80 columns
        console.width = max(console.width, 1000)  # a table is as wide as its cells; never wrapped
    table = Table(title=f"{res.case} / {res.vendor} / {res.config_name}", caption="data " + data_text(res))
    for c in COLUMNS:
        table.add_column(c)
    for r in rows(res):  # cells as plain text: an error may hold brackets that rich would read as markup
        table.add_row(*(Text(c) for c in r), style=None if r[-1] == "ok" else "red")
    console.print(table)
    for line in conformance_lines(res)[1:]:
        console.print(Text(line))


#: a spare file in the run folder, as large as a few copies of results.json: when the disk
#: fills during the run, it is given up so that results.json can still be written (its status
#: and error above all); removed when the run has finished
RESERVE = ".results.reserve"
RESERVE_MIN = 256 * 1024
_FULL = (errno.ENOSPC, errno.EDQUOT)


def write(res: RunResults, run_dir: Path) -> None:
    """Write results.json and results.md atomically (finished rounds are never lost). A full
    disk gives up the run folder's reserve first; no temporary file is left behind."""
    run_dir.mkdir(parents=True, exist_ok=True)
    reserve = run_dir / RESERVE
    data = json.dumps(res.dump(), indent=2, default=str).encode()
    for name, text in (("results.json", data), ("results.md", markdown(res).encode())):
        _replace(run_dir / name, text, reserve)
    if res.finished:
        reserve.unlink(missing_ok=True)
    else:
        _keep_room(reserve, max(RESERVE_MIN, 4 * len(data)))


def _replace(path: Path, data: bytes, reserve: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    while True:
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
            return
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno not in _FULL:
                raise
            if reserve.exists():  # the room kept for this
                reserve.unlink()
                continue
            if _overwrite(path, data):
                return
            raise OSError(exc.errno, f"{os.strerror(exc.errno)}: {len(data):,} bytes needed for {path}", str(path)) from None


def _overwrite(path: Path, data: bytes) -> bool:
    """Write ``data`` over ``path`` in the blocks it already holds; False when they are too few."""
    try:
        if path.stat().st_blocks * 512 < len(data):
            return False
        with open(path, "r+b") as fh:
            fh.write(data)
            fh.truncate()
        return True
    except OSError:
        return False


def _keep_room(reserve: Path, size: int) -> None:
    """Hold ``size`` bytes of disk in ``reserve`` (best effort: a disk already full keeps none)."""
    try:
        if reserve.exists() and reserve.stat().st_size >= size:
            return
        fd = os.open(reserve, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError:
        reserve.unlink(missing_ok=True)
