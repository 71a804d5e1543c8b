"""A round judged in one call: :func:`judge_round` turns the raw outcome the orchestrator hands
over (the ranks' parsed metric logs, the monitors' samples and summaries, what the processes
said made it fail, the nodes) into its RoundResult: every phase's figures and loss gate, the
records a clean round must have, the device check, and the round's status.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from run_benchmarks.judging import metrics, results
from run_benchmarks.judging.loss_gate import judge_loss, round_loss, round_status
from run_benchmarks.planning.plan import Plan
from run_benchmarks.typed_results import LossGate, PhaseResult, Reference, RoundResult
from training import metriclog as ml


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """What a round left, before anything is judged."""

    round_no: int
    duration_s: float
    parsed: ml.ParsedLog  # every rank's metric log, parsed once (training.metriclog)
    #: per node: its monitor samples and the device indices its ranks used (None: all)
    monitor_nodes: list[tuple[list[dict[str, Any]], set[int] | None]]
    monitors: dict[int, dict[str, Any] | None]  # per node rank: its monitor summary
    process_errors: list[str]  # the processes' own account of a failure, root cause first (running/orchestrator.py)
    nodes: list[dict[str, Any]]  # host, node rank, exit status and what the runtime adds


def _phase_result(
    plan: Plan,
    parsed: ml.ParsedLog,
    phase: str,
    monitor_nodes: list[tuple[list[dict[str, Any]], set[int] | None]],
) -> PhaseResult:
    warmup = int(plan.settings["train"]["warmup_steps"])
    steps = metrics.step_records(parsed, phase)
    fig = metrics.figures(steps, warmup, plan.world_size, plan.counts[phase], plan.hardware["peak_flops"])
    metas = [r.value for r in parsed.of(ml.EV_META, ml.K_RUN_META) if r.value.get("phase", "train") == phase]
    meta = metas[0] if metas else None
    mem = metrics.memory_summary(parsed, phase)
    reference = plan.references[phase].curve
    return PhaseResult(
        phase=phase,
        **fig,
        gate=phase_gate(fig["loss"], reference, warmup, plan.references[phase].why_none),
        reference=reference,
        meta=meta,
        step_breakdown=metrics.step_breakdowns(parsed, phase, fig["step_time_s"]),
        # each phase's own layout and memory (llava: ZeRO-2 then ZeRO-3)
        layout=results.layout({**plan.settings["parallel"], "dp": plan.data_parallel, **((meta or {}).get("parallel") or {})}),
        peak_mem_gib=mem["peak_mem_gib"],
        reserved_mem_gib=mem["reserved_mem_gib"],
        alloc_retries=mem["alloc_retries"],
        device_mem=metrics.device_memory(monitor_nodes, metrics.phase_span(steps)),
        device_clocks=metrics.device_clocks(monitor_nodes, metrics.phase_span(steps)),
        device_energy=metrics.device_energy(
            monitor_nodes,
            metrics.window_span(steps, fig["window"]),
            fig["tokens_per_gpu_s"],
            [next((s["identity"] for s in samples if "identity" in s), None) for samples, _ in monitor_nodes],
        ),
        steps=steps,
    )


def record_errors(plan: Plan, parsed: ml.ParsedLog, phases: list[PhaseResult], devices: list[str], failed: bool) -> list[str]:
    """What the records say is wrong: where the processes did not fail (``failed``), a missing
    run_end, phases short of their steps or without run_meta; always, ranks that ran on another
    chip than the case names, and metric lines that do not parse."""
    errors = []
    steps_expected = int(plan.settings["train"]["steps"])
    if not failed:
        if not parsed.of(ml.EV_END, ml.K_RUN_END):
            errors.append("the case exited without its run_end record")
        for p in phases:
            if p.steps_run < steps_expected:
                errors.append(f"phase {p.phase}: {p.steps_run} of {steps_expected} steps reported")
            if not p.meta:
                errors.append(f"phase {p.phase}: no run_meta record")
    wrong = [d for d in devices if not any(re.search(pat, d, re.I) for pat in plan.hardware["device_names"])]
    if wrong:
        errors.append(
            f"the case names {plan.case.hardware} but the ranks ran on {', '.join(wrong)} "
            f"(vendors/{plan.vendor.name}/vendor.yaml, chip {plan.case.hardware}, device_names "
            f"{plan.hardware['device_names']}): these are not {plan.case.hardware} figures; "
            "name the chip the cards are"
        )
    if parsed.errors:
        errors += [f"bad metric line {e.source}:{e.lineno}: {e.reason}" for e in parsed.errors[:3]]
    return errors


def phase_gate(loss: dict[int, float], reference: Reference | None, warmup: int, why_none: str | None) -> LossGate:
    """The loss gate (judge_loss); a phase without a reference says why, as its plan found it."""
    gate = judge_loss(loss, reference, warmup)
    if reference is None and why_none and gate.verdict == "not judged" and gate.nonfinite_step is None:
        gate = gate.model_copy(update={"reason": why_none})
    return gate


def judge_round(plan: Plan, outcome: RoundOutcome) -> RoundResult:
    """The round's result: every phase's figures and loss gate against the plan's references,
    and the round's status and why."""
    parsed = outcome.parsed
    phases = [_phase_result(plan, parsed, ph, outcome.monitor_nodes) for ph in plan.phases]
    devices = sorted({str(r.value.get("device")) for r in parsed.of(ml.EV_MEMORY, ml.K_PEAK_MEMORY) if r.value.get("device")})
    checks = parsed.of(ml.EV_INFO, ml.K_CONFORMANCE)
    conformance = checks[0].value if checks else None
    starts = parsed.of(ml.EV_INFO, ml.K_STARTUP)
    errors = outcome.process_errors + record_errors(plan, parsed, phases, devices, failed=bool(outcome.process_errors))
    status, reasons = round_status(errors, {p.phase: p.gate for p in phases}, conformance)
    mem = metrics.memory_summary(parsed)
    one = phases[0] if len(phases) == 1 else None  # round-level figures only where they cannot be mistaken
    loss_mre, loss_aligned = round_loss([p.gate for p in phases])
    return RoundResult(
        round=outcome.round_no,
        status=status,
        error="\n".join(reasons) or None,
        duration_s=outcome.duration_s,
        layout=", ".join(dict.fromkeys(p.layout for p in phases if p.layout)) or None,
        tokens_per_gpu_s=one.tokens_per_gpu_s if one else None,
        mfu_6n=one.mfu_6n if one else None,
        mfu_palm=one.mfu_palm if one else None,
        window=one.window if one else None,
        peak_mem_gib=mem["peak_mem_gib"],
        reserved_mem_gib=mem["reserved_mem_gib"],
        total_mem_gib=mem["total_mem_gib"],
        per_rank_mem_gib=mem["per_rank_gib"],
        device_mem=metrics.device_memory(outcome.monitor_nodes, None),
        devices=devices,
        loss_mre=loss_mre,
        loss_aligned=loss_aligned,
        phases=phases,
        monitor={f"node{k}": m for k, m in outcome.monitors.items()},
        reference={ph: (r.curve.path if r.curve else None) for ph, r in plan.references.items()},
        nodes=outcome.nodes,
        metric_parse_errors=len(parsed.errors),
        conformance=conformance,
        startup=({k: v for k, v in starts[0].value.items() if k != "phase"} if starts else None),
    )
