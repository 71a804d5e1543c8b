"""Round metrics from parsed metric-log records: throughput, MFU, memory, loss alignment."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from training import metriclog as ml
from training.flops import mfu

ALIGN_FROM_STEP = 21  # seed 000: loss compared from step 21 on
ALIGN_TOLERANCE = 0.02  # aligned when the mean relative error is below 2 %
GIB = 1024**3


def loss_mre(loss: dict[int, float], reference: dict[int, float], from_step: int = ALIGN_FROM_STEP) -> tuple[float | None, int]:
    """Mean relative error of ``loss`` against ``reference`` over common steps >= from_step."""
    steps = sorted(s for s in loss if s >= from_step and s in reference)
    if not steps:
        return None, 0
    errs = []
    for s in steps:
        ref, got = reference[s], loss[s]
        if not math.isfinite(got):
            return math.inf, len(steps)
        errs.append(abs(got - ref) / abs(ref))
    return sum(errs) / len(errs), len(steps)


def is_aligned(mre: float | None, tolerance: float = ALIGN_TOLERANCE) -> bool | None:
    return None if mre is None else mre < tolerance


def load_reference(path: Path, phase: str = "train") -> dict[int, float] | None:
    """A loss curve: a committed reference file, or a phase of an earlier run's results.json.

    A reference file is ``{"steps": [...], "loss": [...]}``; a results.json gives the curve of
    its first round that finished ``ok``. None when the file is absent; ValueError (naming the
    file) when it is neither, or lacks the phase.
    """
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if isinstance(data, dict) and "rounds" in data:
        ok = [r for r in data["rounds"] if r.get("status") == "ok"]
        if not ok:
            raise ValueError(f"{path}: no round finished ok, so there is no loss curve to compare with")
        curves = {p.get("phase"): p.get("loss") or {} for p in ok[0].get("phases", [])}
        if not curves.get(phase):
            raise ValueError(f"{path}: round {ok[0].get('round')} has no loss curve for phase {phase!r} (has {', '.join(map(str, curves)) or 'none'})")
        return {int(s): float(v) for s, v in curves[phase].items()}
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list) or not isinstance(data.get("loss"), list):
        raise ValueError(f"{path}: neither a reference curve ({{\"steps\": [...], \"loss\": [...]}}) nor a results.json")
    return {int(s): float(v) for s, v in zip(data["steps"], data["loss"])}


def dedup_steps(records: Sequence[ml.Record]) -> list[dict[str, Any]]:
    """One step value per step number (the reporting rank's), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        by_step.setdefault(int(r.value["step"]), r.value)
    return [by_step[k] for k in sorted(by_step)]


def phase_metrics(
    parsed: ml.ParsedLog,
    phase: str,
    warmup_steps: int,
    world_size: int,
    counts: dict[str, Any],
    peak_flops: float | None,
    reference: dict[int, float] | None,
) -> dict[str, Any]:
    def in_phase(r: ml.Record) -> bool:
        return r.value.get("phase", "train") == phase

    step_recs = [r for r in parsed.of(ml.EV_STEP, ml.K_TRAIN_STEP) if in_phase(r)]
    steps = dedup_steps(step_recs)
    metas = [r.value for r in parsed.of(ml.EV_META, ml.K_RUN_META) if in_phase(r)]
    # a profiled step runs under the profiler's cost: never part of the throughput window
    after_warmup = [s for s in steps if int(s["step"]) > warmup_steps]
    window = [s for s in after_warmup if not s.get("profiled")]
    breakdowns = {str(r.rank): dict(r.value) for r in parsed.of(ml.EV_INFO, ml.K_STEP_BREAKDOWN) if in_phase(r)}
    out: dict[str, Any] = {
        "phase": phase,
        "steps_run": len(steps),
        "window": {"first_step": None, "last_step": None, "steps": 0, "warmup_steps": warmup_steps},
        "tokens_per_gpu_s": None,
        "mfu_6n": None,
        "mfu_palm": None,
        "step_time_s": None,
        "loss_final": float(steps[-1]["loss"]) if steps else None,
        "loss_mre": None,
        "loss_aligned": None,
        "loss_compared_steps": 0,
        "loss": {int(s["step"]): float(s["loss"]) for s in steps},
        "meta": metas[0] if metas else None,
        "step_breakdown": breakdowns,  # rank -> training.profiling.breakdown() of its profiled step
        # wall-clock end and duration of each step (for the harness's overhead figure)
        "step_times": [{"t": r.t, "step_time_s": float(r.value["step_time_s"])} for r in step_recs],
    }
    if window:
        tokens = sum(float(s["tokens"]) for s in window)
        seconds = sum(float(s["step_time_s"]) for s in window)
        tps = tokens / seconds / world_size if seconds > 0 else None
        out["window"].update(first_step=int(window[0]["step"]), last_step=int(window[-1]["step"]), steps=len(window),
                             excluded=[int(s["step"]) for s in after_warmup if s.get("profiled")])
        out["tokens_per_gpu_s"] = tps
        out["step_time_s"] = seconds / len(window)
        out["mfu_6n"] = mfu(counts["flops_per_token_6n"], tps, peak_flops)
        out["mfu_palm"] = mfu(counts["flops_per_token_palm"], tps, peak_flops)
        # the profiler slows the host, so its step idles more than the others: the busy time
        # measured under it, set against an ordinary step of the window, estimates the true idle
        for b in breakdowns.values():
            b["window_step_time_s"] = out["step_time_s"]
            b["idle_estimate_s"] = max(0.0, out["step_time_s"] - float(b["busy_s"]))
    if reference is not None:
        mre, n = loss_mre(out["loss"], reference)
        out.update(loss_mre=mre, loss_aligned=is_aligned(mre), loss_compared_steps=n)
    return out


def memory_summary(parsed: ml.ParsedLog, phase: str | None = None) -> dict[str, Any]:
    """Peak device memory over ranks (the seeds' mem column: used / total GiB), of one phase if given."""
    per_rank: dict[int, dict[str, Any]] = {}
    for r in parsed.of(ml.EV_MEMORY, ml.K_PEAK_MEMORY):
        if phase is not None and r.value.get("phase", "train") != phase:
            continue
        cur = per_rank.get(r.rank)
        if cur is None or r.value["peak_bytes"] > cur["peak_bytes"]:
            per_rank[r.rank] = r.value
    if not per_rank:
        return {"peak_mem_gib": None, "total_mem_gib": None, "per_rank_gib": {}}
    peak = max(v["peak_bytes"] for v in per_rank.values())
    totals = [v["total_bytes"] for v in per_rank.values() if v.get("total_bytes")]
    return {
        "peak_mem_gib": peak / GIB,
        "total_mem_gib": (max(totals) / GIB) if totals else None,
        "per_rank_gib": {str(k): v["peak_bytes"] / GIB for k, v in sorted(per_rank.items())},
    }
