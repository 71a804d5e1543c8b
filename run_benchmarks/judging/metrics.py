"""Round metrics from parsed metric-log records: throughput, MFU, memory, the loss gate.

Everything here works after a round, on what its ranks wrote: nothing runs per step.
The figures of a phase come from its step records alone (:func:`figures`), so --verify
recomputes them from the records kept in results.json with the same code.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from run_benchmarks.typed_results import DeviceClocks, DeviceEnergy, DeviceMemory, Spread, Step, Window
from training import metriclog as ml
from training.flops import mfu

GIB = 1024**3

# --------------------------------------------------------------------------- figures of a phase


def step_records(parsed: ml.ParsedLog, phase: str) -> list[Step]:
    """The phase's step records, one per step number (the reporting rank's), in step order."""
    by_step: dict[int, Step] = {}
    for r in parsed.of(ml.EV_STEP, ml.K_TRAIN_STEP):
        v = r.value
        if v.get("phase", "train") != phase or int(v["step"]) in by_step:
            continue
        by_step[int(v["step"])] = Step(
            step=int(v["step"]),
            t=r.t,
            loss=float(v["loss"]),
            tokens=float(v["tokens"]),
            step_time_s=float(v["step_time_s"]),
            lr=float(v["lr"]),
            data_s=None if v.get("data_s") is None else float(v["data_s"]),
            profiled=bool(v.get("profiled", False)),
            skipped=bool(v.get("skipped", False)),
        )
    return [by_step[k] for k in sorted(by_step)]


def figures(
    steps: Sequence[Step], warmup_steps: int, world_size: int, counts: Mapping[str, Any], peak_flops: float | None
) -> dict[str, Any]:
    """Everything a phase's step records determine: the window, tokens/p/s, step time, MFU both
    ways, the loss curve. --verify compares a results.json against this."""
    # a profiled step runs under the profiler's cost: never part of the throughput window
    after_warmup = [s for s in steps if s.step > warmup_steps]
    window = [s for s in after_warmup if not s.profiled]
    out: dict[str, Any] = {
        "steps_run": len(steps),
        "window": Window(warmup_steps=warmup_steps),
        "tokens_per_gpu_s": None,
        "step_time_s": None,
        "throughput_spread": None,
        "mfu_6n": None,
        "mfu_palm": None,
        "loss_final": steps[-1].loss if steps else None,
        "loss": {s.step: s.loss for s in steps},
    }
    if window:
        tokens = sum(s.tokens for s in window)
        seconds = sum(s.step_time_s for s in window)
        tps = tokens / seconds / world_size if seconds > 0 else None
        out["window"] = Window(
            first_step=window[0].step,
            last_step=window[-1].step,
            steps=len(window),
            warmup_steps=warmup_steps,
            excluded=[s.step for s in after_warmup if s.profiled],
        )
        out["tokens_per_gpu_s"] = tps
        out["step_time_s"] = seconds / len(window)
        out["throughput_spread"] = spread([s.tokens / s.step_time_s / world_size for s in window if s.step_time_s > 0])
        out["mfu_6n"] = mfu(counts["flops_per_token_6n"], tps, peak_flops)
        out["mfu_palm"] = mfu(counts["flops_per_token_palm"], tps, peak_flops)
    return out


def spread(values: Sequence[float]) -> Spread | None:
    """Median, 10th and 90th percentiles (linear between the ordered values), lowest and highest of
    ``values``; None for none."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        p10 = p90 = xs[0]
    else:
        deciles = statistics.quantiles(xs, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return Spread(steps=len(xs), median=statistics.median(xs), p10=p10, p90=p90, min=xs[0], max=xs[-1])


def step_breakdowns(parsed: ml.ParsedLog, phase: str, window_step_time_s: float | None) -> dict[str, dict[str, Any]]:
    """rank -> training.profiling.breakdown() of its profiled step, set against an ordinary step.

    The profiler slows the host, so its step idles more than the others: the busy time
    measured under it, set against an ordinary step of the window, estimates the true idle.
    """
    out = {str(r.rank): dict(r.value) for r in parsed.of(ml.EV_INFO, ml.K_STEP_BREAKDOWN) if r.value.get("phase", "train") == phase}
    if window_step_time_s is not None:
        for b in out.values():
            b["window_step_time_s"] = window_step_time_s
            b["idle_estimate_s"] = max(0.0, window_step_time_s - float(b["busy_s"]))
    return out


def phase_span(steps: Sequence[Step]) -> tuple[float, float] | None:
    """Wall-clock start of the phase's first step to the end of its last."""
    if not steps:
        return None
    return min(s.t - s.step_time_s for s in steps), max(s.t for s in steps)


def window_span(steps: Sequence[Step], window: Window) -> tuple[float, float] | None:
    """Wall-clock start of the steady window's first step to the end of its last (None: no window)."""
    if window.first_step is None or window.last_step is None:
        return None
    return phase_span([s for s in steps if window.first_step <= s.step <= window.last_step])


# --------------------------------------------------------------------------- memory


def memory_summary(parsed: ml.ParsedLog, phase: str | None = None) -> dict[str, Any]:
    """The allocator's peak over ranks (``peak_memory`` records), of one phase if given, the most
    its cache reserved on any rank and the most cache flushes for want of a free block on any rank
    (``alloc_retries``; each where reported), and the device total the framework reported."""
    per_rank: dict[int, dict[str, Any]] = {}
    for r in parsed.of(ml.EV_MEMORY, ml.K_PEAK_MEMORY):
        if phase is not None and r.value.get("phase", "train") != phase:
            continue
        cur = per_rank.get(r.rank)
        if cur is None or r.value["peak_bytes"] > cur["peak_bytes"]:
            per_rank[r.rank] = r.value
    if not per_rank:
        return {"peak_mem_gib": None, "reserved_mem_gib": None, "alloc_retries": None, "total_mem_gib": None, "per_rank_gib": {}}
    peak = max(v["peak_bytes"] for v in per_rank.values())
    totals = [v["total_bytes"] for v in per_rank.values() if v.get("total_bytes")]
    reserved = [v["reserved_bytes"] for v in per_rank.values() if v.get("reserved_bytes") is not None]
    retries = [v["alloc_retries"] for v in per_rank.values() if v.get("alloc_retries") is not None]
    return {
        "peak_mem_gib": peak / GIB,
        "reserved_mem_gib": (max(reserved) / GIB) if reserved else None,
        "alloc_retries": max(retries) if retries else None,
        "total_mem_gib": (max(totals) / GIB) if totals else None,
        "per_rank_gib": {str(k): v["peak_bytes"] / GIB for k, v in sorted(per_rank.items())},
    }


def read_monitor(path: Path) -> list[dict[str, Any]]:
    """A node's monitor samples (monitors.MonitorThread's JSON lines); none when it wrote none."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by the monitor's stop
            continue
    return out


MonitorNodes = Sequence[tuple[list[dict[str, Any]], set[int] | None]]


def used_gpu_samples(nodes: MonitorNodes, span: tuple[float, float] | None) -> Iterator[dict[str, Any]]:
    """Each GPU sample of the GPUs the run used (``nodes``: per node, its monitor samples and the
    GPU indices its ranks used, None: all), of the samples inside ``span`` (every sample without one)."""
    for samples, gpus in nodes:
        for s in samples:
            if span is not None and not span[0] <= float(s.get("t", 0)) <= span[1]:
                continue
            for g in s.get("gpus") or []:
                if gpus is None or int(g.get("index", -1)) in gpus:
                    yield g


def device_memory(nodes: MonitorNodes, span: tuple[float, float] | None) -> DeviceMemory | None:
    """Device memory in use on the busiest GPU the run used, as the monitor saw it.

    ``nodes``: per node, its monitor samples and the GPU indices its ranks used (None: all).
    Over the samples inside ``span`` (a phase) when there are any, else over the round.
    None when no monitor read a device (a CPU run).
    """

    def peak(within: tuple[float, float] | None) -> tuple[float, float | None] | None:
        found = [
            (float(g["mem_used_gib"]), g.get("mem_total_gib")) for g in used_gpu_samples(nodes, within) if g.get("mem_used_gib") is not None
        ]
        return max(found, key=lambda x: x[0], default=None)

    if span is not None and (got := peak(span)) is not None:
        return DeviceMemory(used_gib=got[0], total_gib=got[1], scope="phase")
    got = peak(None)
    return None if got is None else DeviceMemory(used_gib=got[0], total_gib=got[1], scope="round")


def device_clocks(nodes: MonitorNodes, span: tuple[float, float] | None) -> DeviceClocks | None:
    """The SM clock over a phase's steps (``span``), from every sample of every GPU the run used
    (``nodes`` as :func:`device_memory`'s): median, 10th percentile, the devices' maximum, and the
    share of samples the driver held the clock down for each reason. None without a span or
    without clock samples inside it (a CPU run, a monitor that does not read clocks)."""
    if span is None:
        return None
    clocks: list[float] = []
    maxima: list[float] = []
    held: dict[str, int] = {}
    for g in used_gpu_samples(nodes, span):
        if g.get("sm_clock_mhz") is None:
            continue
        clocks.append(float(g["sm_clock_mhz"]))
        if g.get("sm_clock_max_mhz") is not None:
            maxima.append(float(g["sm_clock_max_mhz"]))
        for reason in g.get("clock_held") or []:
            held[reason] = held.get(reason, 0) + 1
    if not clocks:
        return None
    clocks.sort()
    return DeviceClocks(
        samples=len(clocks),
        sm_median_mhz=statistics.median(clocks),
        sm_low_mhz=clocks[int(0.1 * (len(clocks) - 1))],
        sm_max_mhz=max(maxima) if maxima else None,
        held={r: n / len(clocks) for r, n in sorted(held.items())},
    )


def device_energy(
    nodes: MonitorNodes, span: tuple[float, float] | None, tokens_per_gpu_s: float | None, identities: Sequence[dict[str, Any] | None] = ()
) -> DeviceEnergy | None:
    """Tokens per joule per device over the steady window ``span``: each GPU the run used, its mean
    power there (NVML's energy counter's rise over the window's first to last sample where every
    GPU has one, else the mean of its power samples), averaged over the GPUs; tokens/p/s over that
    mean. ``identities``: per node, the monitor's device identities (their power limits). None
    without a window, a throughput or power samples (a CPU run)."""
    if span is None or not tokens_per_gpu_s:
        return None
    per_gpu: dict[tuple[int, int], list[tuple[float, dict[str, Any]]]] = {}
    for k, (samples, gpus) in enumerate(nodes):
        for s in samples:
            t = float(s.get("t", 0))
            if not span[0] <= t <= span[1]:
                continue
            for g in s.get("gpus") or []:
                if (gpus is None or int(g.get("index", -1)) in gpus) and g.get("power_w") is not None:
                    per_gpu.setdefault((k, int(g.get("index", -1))), []).append((t, g))
    if not per_gpu:
        return None
    counted = all(len(v) >= 2 and v[-1][0] > v[0][0] and all(g.get("energy_mj") is not None for _, g in v) for v in per_gpu.values())
    powers = []
    for v in per_gpu.values():
        v.sort(key=lambda x: x[0])
        if counted:
            (t0, g0), (t1, g1) = v[0], v[-1]
            powers.append((float(g1["energy_mj"]) - float(g0["energy_mj"])) / 1000.0 / (t1 - t0))
        else:
            powers.append(statistics.fmean(float(g["power_w"]) for _, g in v))
    mean_w = statistics.fmean(powers)
    if mean_w <= 0:
        return None
    limits = sorted(
        {
            float(d["power_limit_w"])
            for k, gpu in per_gpu
            for d in ((identities[k] or {}).get("gpus") or [] if k < len(identities) else [])
            if int(d.get("index", -1)) == gpu and d.get("power_limit_w") is not None
        }
    )
    return DeviceEnergy(
        source="energy counter" if counted else "power samples",
        devices=len(per_gpu),
        samples=sum(len(v) for v in per_gpu.values()),
        mean_power_w=mean_w,
        tokens_per_joule=float(tokens_per_gpu_s) / mean_w,
        power_limit_w=limits,
    )
