"""``start_task.py --ceiling``: a case's kernel ceiling on this host's first device, printed alone.

The case's own entry point runs once, as one process, with ``--ceiling`` and the resolved
config of the case name, vendor config, variant and ``--set`` values given (the layout decides
the per-GPU shapes); it times the case's GEMMs and attention on its first device
(training/ceiling.py) and writes one ``kernel_ceiling`` record per phase (a case with phases,
such as llava's pretrain and finetune, has one ceiling each), which are read here with the
protocol's parser and printed, one table a phase (``--json``: the one ceiling of a case
without phases, else phase -> ceiling). No process group, model, data or run folder. Cases declare
that their entry supports it with ``ceiling: true`` in case.yaml.

Exit status: 0 measured, 1 the case failed, 2 bad input (nothing ran).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.judging.results import hold_text
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning import registry
from run_benchmarks.planning.casename import CaseName, check_name
from training import metriclog as ml


def _ms(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"


def table(
    ceiling: dict[str, Any], case: str, peak_flops: float | None, flops_per_token_6n: float, flops_per_token_palm: float | None = None
) -> str:
    """The ceiling as a few lines: the figure, the MFU it stands for, and each kernel's time
    (a GEMM's products that its step does not run show ``-``; an attention block its shape,
    causal or full length, and its time forward + backward or forward alone)."""
    tps = ceiling["tokens_per_gpu_s"]
    mfu = ""
    if peak_flops:
        mfu = f", MFU-6N {100 * flops_per_token_6n * tps / peak_flops:.1f}%"
        if flops_per_token_palm:
            mfu += f", MFU-PaLM {100 * flops_per_token_palm * tps / peak_flops:.1f}%"
        mfu += " at the ceiling"
    phase = f" phase {ceiling['phase']}" if ceiling.get("phase") else ""
    if "mean_seq_length" in ceiling:
        seq = f"mean sample length {ceiling['seq_length']} ({ceiling.get('seq_length_source', 'assumed')})"
        if "images_per_micro_batch" in ceiling:
            seq += f", {ceiling['images_per_micro_batch']} images"
    else:
        seq = f"sequence {ceiling['seq_length']}"
    attention_s = ceiling["attention_s"]
    att_rate = ceiling.get("attention_tflops")
    layers = f" over {ceiling['layers']} layers" if "layers" in ceiling and "vision_layers" not in ceiling else ""
    lines = [
        f"kernel ceiling of {case}{phase} on {ceiling['device']} (TP{ceiling['tp']}, micro batch {ceiling['micro_batch']}, "
        f"{seq}, {ceiling['dtype']}, attention {ceiling['attention']})",
        f"  {tps:,.0f} tokens/p/s{mfu}",
        f"  one micro batch: {1e3 * ceiling['micro_batch_s']:.1f} ms = GEMMs {1e3 * ceiling['gemm_s']:.1f} ms "
        f"({ceiling['gemm_tflops']:.3g} TFLOP/s) + attention {1e3 * attention_s:.1f} ms"
        + ("" if att_rate is None else f" ({att_rate:.3g} TFLOP/s)")
        + layers,
        f"  {'kernel':22s} {'shape':28s} {'count':>5s}   {'fwd ms':>8s} {'dgrad ms':>9s} {'wgrad ms':>9s}  TFLOP/s"
        + ("   SM MHz" if "sm_clock_mhz" in ceiling else ""),
    ]
    held = hold_text(ceiling.get("hold_s"))
    if "sm_clock_mhz" in ceiling:  # the clock each part ended its timing at (training/ceiling.py)
        lines.insert(3, f"  SM clock as the parts were timed: median {ceiling['sm_clock_mhz']:,.0f} MHz{held}")
    elif held:
        lines.insert(3, f"  timed{held}")
    for name, p in ceiling["parts"].items():
        count = f"x{p['count']}" if "count" in p else ""
        if "fwd_bwd_ms" in p or "kernel" in p:  # an attention block
            if "batch" in p:
                shape = f"{p['batch']} x {p['heads']} x {p['seq']} x {p['head_dim']}, {'causal' if p.get('causal', True) else 'full'}"
            else:
                shape = "(causal)"
            if "fwd_bwd_ms" in p:
                times = f"{'forward + backward':>18s} {p['fwd_bwd_ms']:>9.3f}"
            else:
                times = f"{p['fwd_ms']:>8.3f} {'(forward only)':>19s}"
            lines.append(f"  {name:22s} {shape:28s} {count:>5s}   {times:28s}  {p['tflops']:7.3g}" + _mhz(p))
        else:
            if "count" not in p:
                count = "" if p.get("per_layer", True) else "x1"
            shape = f"{p['m']} x {p['n']} x {p['k']}"
            times = f"{_ms(p.get('fwd_ms'), 8)} {_ms(p.get('dgrad_ms'), 9)} {_ms(p.get('wgrad_ms'), 9)}"
            lines.append(f"  {name:22s} {shape:28s} {count:>5s}   {times}  {p['tflops']:7.3g}" + _mhz(p))
    return "\n".join(lines)


def _mhz(part: dict[str, Any]) -> str:
    return f"  {part['sm_clock_mhz']:7,.0f}" if "sm_clock_mhz" in part else ""


def process_env(plan: planning.Plan, root: Path) -> dict[str, str]:
    """The environment of the one ``--ceiling`` process: this host's, the vendor's, one rank of
    one, and the code root first on PYTHONPATH with this host's PYTHONPATH after it, as a local
    round keeps it (runtimes/local.py), so packages carried there are found alike."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        **plan.vendor.env,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "FB_RUN_ID": plan.run_id,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }


def measure(plan: planning.Plan, python: str, root: Path, timeout_s: float = 600) -> dict[str, dict[str, Any]]:
    """Run the case's entry with ``--ceiling`` in a scratch folder; its kernel_ceiling record of
    every phase of the case (phase -> value; a case without phases has one, ``train``), or
    RuntimeError with what the case said."""
    entry = root / plan.case_dir.relative_to(registry.ROOT) / plan.entry
    with tempfile.TemporaryDirectory(prefix="flagbench-ceiling-") as tmp:
        cfg = Path(tmp) / "resolved.json"
        cfg.write_text(json.dumps(plan.resolved(0, str(Path(tmp) / "output"), str(Path(tmp) / "cache")), indent=2))
        env = process_env(plan, root)
        try:
            proc = subprocess.run(
                [python, str(entry), "--config", str(cfg), "--ceiling"],
                cwd=str(root),
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{entry} --ceiling ran past {timeout_s:.0f} s") from None
    parsed = ml.parse_lines(proc.stdout.splitlines(), source=f"{entry.name} --ceiling")
    found = {str(r.value.get("phase") or plan.phases[0]): r.value for r in parsed.of(ml.EV_INFO, ml.K_KERNEL_CEILING)}
    if proc.returncode == 0 and found:
        missing = [ph for ph in plan.phases if ph not in found]
        if missing:
            raise RuntimeError(f"{entry} --ceiling wrote no kernel_ceiling record for phase {', '.join(missing)}")
        return {ph: found[ph] for ph in plan.phases}
    said = [str(r.value.get("message", "")).strip().splitlines()[0] for r in parsed.of(ml.EV_ERROR) if r.value.get("message")]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"{entry} --ceiling exited {proc.returncode} without a kernel_ceiling record: {(said or tail)[0]}")


def main(argv: list[str]) -> int:
    from run_benchmarks.planning.options import load_cluster, parser
    from run_benchmarks.running.runtimes import select

    ap = parser()
    ap.prog = "flagbench ceiling"
    ap.description = "print the case's kernel ceiling on this host's first device alone"
    args = ap.parse_args(argv)
    try:
        for flag, given in (
            ("--cluster", args.cluster),
            ("--reference", args.reference),
            ("--nightly", args.nightly),
            ("--dry-run", args.dry_run),
        ):
            if given:
                raise InputError(f"--ceiling measures on this host's first device alone; {flag} does not apply")
        check_name(args.vendor, "vendor")
        cn = CaseName.parse(args.case_name)
        cluster = load_cluster(args)
        if not registry.find_case(cn).config.ceiling:
            raise InputError(f"case {cn.model}:{cn.framework} does not measure a kernel ceiling (no 'ceiling: true' in its case.yaml)")
        plan = planning.build(cn, args.vendor, cluster, Path(tempfile.gettempdir()), planning.check_variant(args.variant), args.sets)
        runtime = select(cluster, args.python)
        python, root = runtime.prepare(plan, Path(tempfile.gettempdir()) / f"flagbench-ceiling-env-{plan.run_id}.log")
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        value = measure(plan, python, root)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:  # a case without phases: its one ceiling; else phase -> ceiling
        print(json.dumps(value[plan.phases[0]] if len(plan.phases) == 1 else value, indent=2))
        return 0
    tables = []
    for phase, ceiling in value.items():
        counts = plan.counts[phase]
        tables.append(
            table(ceiling, args.case_name, plan.hardware["peak_flops"], counts["flops_per_token_6n"], counts.get("flops_per_token_palm"))
        )
    print("\n\n".join(tables))
    return 0
