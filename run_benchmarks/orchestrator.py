"""Runs a planned case round by round and turns its logs into results."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from run_benchmarks import metrics, results
from run_benchmarks.monitors import summarize
from run_benchmarks.plan import Plan
from run_benchmarks.runtimes.base import NodeOutcome, Runtime
from training import metriclog as ml

TAIL_LINES = 20


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def reference_path(plan: Plan, phase: str = "train") -> Path | None:
    """The curve a phase is compared with: ``--reference`` if given, else the committed curve
    of the exact config, else of the size's default config.

    Files are ``reference/<model>/<config>.json`` (phase ``train``) or
    ``<config>.<phase>.json``.
    """
    if plan.reference is not None:  # --reference: an earlier run or a curve file, every phase
        return plan.reference
    base = plan.case_dir / "reference" / plan.case.model
    suffix = "" if phase == "train" else f".{phase}"
    for name in (plan.config_name, f"config_{plan.case.size}"):
        if (base / f"{name}{suffix}.json").is_file():
            return base / f"{name}{suffix}.json"
    return None


def metric_files(node_dir: Path) -> list[Path]:
    """Per-rank logs written by the launcher (the metric lines' source)."""
    ranks = node_dir / "ranks"
    files = sorted(p for p in ranks.rglob("*") if p.is_file()) if ranks.is_dir() else []
    if not files and (node_dir / "stdout.log").is_file():
        files = [node_dir / "stdout.log"]
    return files


def tail(path: Path, n: int = TAIL_LINES) -> str:
    if not path.is_file():
        return ""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _failed_rank_tail(outcome: NodeOutcome) -> str:
    """The last lines of the first rank log that reports an error, else the node's stdout."""
    for f in metric_files(outcome.node_dir):
        text = f.read_text(encoding="utf-8", errors="replace")
        if "Traceback" in text or "Error" in text:
            return f"{f.relative_to(outcome.node_dir.parent)}:\n{tail(f)}"
    return f"{outcome.node_dir.name}/stdout.log:\n{tail(outcome.node_dir / 'stdout.log')}"


def evaluate_round(plan: Plan, round_no: int, outcomes: list[NodeOutcome], started: float) -> dict[str, Any]:
    parsed = ml.ParsedLog([], [])
    for o in outcomes:
        for f in metric_files(o.node_dir):
            parsed.extend(ml.parse_file(f))
    warmup = int(plan.settings["train"]["warmup_steps"])
    refs = {ph: reference_path(plan, ph) for ph in plan.phases}
    phases = [
        metrics.phase_metrics(parsed, ph, warmup, plan.world_size, plan.counts[ph], plan.hardware["peak_flops"],
                              metrics.load_reference(refs[ph], ph) if refs[ph] else None)
        for ph in plan.phases
    ]  # fmt: skip
    mem = metrics.memory_summary(parsed)
    for p in phases:  # each phase's own layout and memory (llava: ZeRO-2 then ZeRO-3)
        p["layout"] = results.layout({**plan.settings["parallel"], "dp": plan.data_parallel, **((p.get("meta") or {}).get("parallel") or {})})
        pm = metrics.memory_summary(parsed, p["phase"])
        p["peak_mem_gib"] = pm["peak_mem_gib"] if pm["peak_mem_gib"] is not None else mem["peak_mem_gib"]
    mon = {f"node{o.node_rank}": summarize(o.node_dir / "monitor.jsonl") for o in outcomes}
    # a monitor's view of device memory (used/total as nvidia-smi shows it) fills the seeds' mem column
    for m in mon.values():
        for g in (m or {}).get("gpus", {}).values():
            if g.get("mem_total_gib") and mem["total_mem_gib"] is None:
                mem["total_mem_gib"] = g["mem_total_gib"]

    errors: list[str] = []
    for o in outcomes:
        if o.error:
            errors.append(f"node{o.node_rank} ({o.host}): {o.error}")
        elif o.timed_out:
            errors.append(f"node{o.node_rank} ({o.host}): round deadline of {plan.cluster.round_timeout_s:.0f} s passed")
        elif o.returncode != 0:
            errors.append(f"node{o.node_rank} ({o.host}): exit status {o.returncode}; {_failed_rank_tail(o)}")
    ends = parsed.of(ml.EV_END, ml.K_RUN_END)
    for e in parsed.of(ml.EV_ERROR):
        errors.append(f"rank {e.rank}: {e.value.get('message', '')}")
    steps_expected = int(plan.settings["train"]["steps"])
    if not errors:
        if not ends:
            errors.append("the case exited without its run_end record")
        for p in phases:
            if p["steps_run"] < steps_expected:
                errors.append(f"phase {p['phase']}: {p['steps_run']} of {steps_expected} steps reported")
            if not p["meta"]:
                errors.append(f"phase {p['phase']}: no run_meta record")
    devices = sorted({str(r.value.get("device")) for r in parsed.of(ml.EV_MEMORY, ml.K_PEAK_MEMORY) if r.value.get("device")})
    wrong = [d for d in devices if not any(re.search(pat, d, re.I) for pat in plan.hardware["device_names"])]
    if wrong:
        errors.append(f"the case names {plan.case.hardware} but the ranks ran on {', '.join(wrong)} "
                      f"(vendors/{plan.vendor.name}/vendor.yaml, chip {plan.case.hardware}, device_names "
                      f"{plan.hardware['device_names']}): these are not {plan.case.hardware} figures; "
                      "name the chip the cards are")  # fmt: skip
    if parsed.errors:
        errors += [f"bad metric line {e.source}:{e.lineno}: {e.reason}" for e in parsed.errors[:3]]

    first = phases[0]
    return {
        "round": round_no,
        "status": "ok" if not errors else "failed",
        "error": "\n".join(errors) or None,
        "duration_s": round(time.monotonic() - started, 3),
        "layout": first["layout"],
        "tokens_per_gpu_s": first["tokens_per_gpu_s"],
        "mfu_6n": first["mfu_6n"],
        "mfu_palm": first["mfu_palm"],
        "peak_mem_gib": mem["peak_mem_gib"],
        "total_mem_gib": mem["total_mem_gib"],
        "per_rank_mem_gib": mem["per_rank_gib"],
        "devices": devices,  # as the ranks name them
        "loss_mre": first["loss_mre"],
        "loss_aligned": first["loss_aligned"],
        "window": first["window"],
        "phases": phases,
        "monitor": mon,
        "reference": {ph: (str(p) if p else None) for ph, p in refs.items()},
        "nodes": [{"host": o.host, "node_rank": o.node_rank, "returncode": o.returncode, **o.extra} for o in outcomes],
        "metric_parse_errors": len(parsed.errors),
    }


def base_results(plan: Plan) -> dict[str, Any]:
    return {
        "schema": 1,
        "run_id": plan.run_id,
        "case": str(plan.case),
        "model": plan.case.model,
        "framework": plan.case.framework,
        "vendor": plan.vendor.name,
        "hardware": plan.case.hardware,
        "nnodes": plan.case.nnodes,
        "nprocs": plan.case.nprocs,
        "world_size": plan.world_size,
        "config_name": plan.config_name,
        "config_file": str(plan.config_file),
        "validated": plan.validated,
        "launcher": plan.launcher,
        "backend": plan.cluster.backend,
        "runtime": "local" if plan.cluster.backend == "local" else plan.cluster.runtime,
        "started": _now(),
        "finished": None,
        "system": results.system_info(),
        "settings": plan.settings,
        "overrides": plan.overrides,
        "hook": plan.hook,
        "user_overrides": plan.user_overrides,
        "command": plan.command,
        "model_counts": plan.counts,
        "hardware_info": plan.hardware,
        "rounds": [],
    }


def _node_times(o: NodeOutcome) -> tuple[float | None, float | None]:
    """When the node's launcher started and ended: the node agent's report, else the runtime's note."""
    report = o.node_dir / "node.json"
    if report.is_file():
        try:
            rep = json.loads(report.read_text())
            return rep.get("started"), rep.get("finished")
        except ValueError:
            pass
    return o.extra.get("launched_at"), o.extra.get("exited_at")


def orchestration_overhead(rnd: dict[str, Any], outcomes: list[NodeOutcome], begin: float, written: float) -> dict[str, Any] | None:
    """The harness's own time in a round, apart from the framework's start-up and shut-down.

    round begin (the command's start for round 1) -> last launcher started, plus last
    launcher exited -> results written.
    """
    times = [_node_times(o) for o in outcomes]
    steps = [(s["t"], s["step_time_s"]) for p in rnd["phases"] for s in p.get("step_times", [])]
    if not steps or any(a is None or b is None for a, b in times):
        return None
    launched, exited = max(a for a, _ in times), max(b for _, b in times)
    first_start, last_end = min(t - dt for t, dt in steps), max(t for t, _ in steps)
    to_launch, after = launched - begin, written - exited
    return {
        "to_launch_s": round(to_launch, 3),
        "framework_startup_s": round(first_start - launched, 3),
        "framework_shutdown_s": round(exited - last_end, 3),
        "after_exit_s": round(after, 3),
        "overhead_s": round(to_launch + after, 3),
    }


def run(plan: Plan, runtime: Runtime, console: Console | None = None, t0: float | None = None) -> dict[str, Any]:
    """Run every round; ``t0`` (wall clock) is when the command started, for the overhead figure."""
    console = console or Console(stderr=True)
    t0 = t0 if t0 is not None else time.time()
    run_dir = plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    res = base_results(plan)
    results.write(res, run_dir)
    try:
        with console.status(f"preparing {plan.case.framework} environment"):
            python, root = runtime.prepare(plan, run_dir / "env_build.log")
        plan.python = python
        res["python"] = python
        res["runtime_info"] = runtime.describe()
        for r in range(1, plan.case.repeat + 1):
            round_dir = run_dir / f"round{r}"
            round_dir.mkdir(parents=True, exist_ok=True)
            nodes = runtime.node_plans(plan, python, root, round_dir)
            plan.nodes = nodes
            (round_dir / "resolved.json").write_text(
                json.dumps(plan.resolved(r, str(round_dir / "output"), str(_cache_dir(plan, root))), indent=2)
            )
            for name, text in nodes[0].files.items():  # launcher files (e.g. DeepSpeed's hostfile)
                (round_dir / name).write_text(text)
            (round_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2, default=str))
            started = time.monotonic()
            begin = t0 if r == 1 else time.time()
            with console.status(f"round {r}/{plan.case.repeat}: {plan.case} on {len(nodes)} node(s)"):
                outcomes = runtime.run_round(plan, round_dir, nodes, plan.cluster.round_timeout_s)
            rnd = evaluate_round(plan, r, outcomes, started)
            rnd["orchestration"] = orchestration_overhead(rnd, outcomes, begin, time.time())
            for p in rnd["phases"]:
                p.pop("step_times", None)
            res["rounds"].append(rnd)
            res["runtime_info"] = runtime.describe()
            results.write(res, run_dir)
            console.print(f"round {r}: {rnd['status']}" + (f" - {rnd['error'].splitlines()[0]}" if rnd["error"] else ""))
    finally:
        runtime.cleanup()
        res["runtime_info"] = runtime.describe()
        res["finished"] = _now()
        results.write(res, run_dir)
    return res


def _cache_dir(plan: Plan, root: Path) -> Path:
    """Where a case writes its synthetic corpus: a cache shared across runs on that host."""
    from run_benchmarks.registry import ROOT

    if root == ROOT:
        return Path.home() / ".cache" / "flagbench" / "data"
    return Path(plan.cluster.work_dir) / "cache" / "data"
