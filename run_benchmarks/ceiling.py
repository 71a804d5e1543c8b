"""``start_task.py --ceiling``: a case's kernel ceiling on this host's first device, printed alone.

The case's own entry point runs once, as one process, with ``--ceiling`` and the resolved
config of the case name, vendor config, variant and ``--set`` values given (the layout decides
the per-GPU shapes); it times the case's GEMMs and attention on its first device
(training/ceiling.py) and writes one ``kernel_ceiling`` record, which is read here with the
protocol's parser and printed. No process group, model, data or run folder. Cases declare
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

from run_benchmarks import plan as planning
from run_benchmarks import registry
from run_benchmarks.casename import CaseName, check_name
from run_benchmarks.errors import InputError
from training import metriclog as ml


def table(ceiling: dict[str, Any], case: str, peak_flops: float | None, flops_per_token_6n: float) -> str:
    """The ceiling as a few lines: the figure, the MFU-6N it stands for, and each kernel's time."""
    tps = ceiling["tokens_per_gpu_s"]
    mfu = "" if not peak_flops else f", MFU-6N {100 * flops_per_token_6n * tps / peak_flops:.1f}% at the ceiling"
    lines = [
        f"kernel ceiling of {case} on {ceiling['device']} (TP{ceiling['tp']}, micro batch {ceiling['micro_batch']}, "
        f"sequence {ceiling['seq_length']}, {ceiling['dtype']}, attention {ceiling['attention']})",
        f"  {tps:,.0f} tokens/p/s{mfu}",
        f"  one micro batch: {1e3 * ceiling['micro_batch_s']:.1f} ms = GEMMs {1e3 * ceiling['gemm_s']:.1f} ms "
        f"({ceiling['gemm_tflops']:.3g} TFLOP/s) + attention {1e3 * ceiling['attention_s']:.1f} ms "
        f"({ceiling['attention_tflops']:.3g} TFLOP/s) over {ceiling['layers']} layers",
        "  kernel          m x n x k                  fwd ms   dgrad ms  wgrad ms  TFLOP/s",
    ]
    for name, p in ceiling["parts"].items():
        if name == "attention":
            lines.append(f"  {'attention':15s} {'(forward + backward, causal)':26s} {p['fwd_bwd_ms']:>26.3f}  {p['tflops']:7.3g}")
        else:
            shape = f"{p['m']} x {p['n']} x {p['k']}" + ("" if p["per_layer"] else " (once)")
            lines.append(f"  {name:15s} {shape:26s} {p['fwd_ms']:8.3f} {p['dgrad_ms']:9.3f} {p['wgrad_ms']:9.3f}  {p['tflops']:7.3g}")
    return "\n".join(lines)


def measure(plan: planning.Plan, python: str, root: Path, timeout_s: float = 600) -> dict[str, Any]:
    """Run the case's entry with ``--ceiling`` in a scratch folder; its kernel_ceiling record, or
    RuntimeError with what the case said."""
    entry = root / plan.case_dir.relative_to(registry.ROOT) / plan.entry
    with tempfile.TemporaryDirectory(prefix="flagbench-ceiling-") as tmp:
        cfg = Path(tmp) / "resolved.json"
        cfg.write_text(json.dumps(plan.resolved(0, str(Path(tmp) / "output"), str(Path(tmp) / "cache")), indent=2))
        env = {
            **os.environ,
            **plan.vendor.env,
            "PYTHONPATH": str(root),
            "PYTHONUNBUFFERED": "1",
            "FB_RUN_ID": plan.run_id,
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
        }
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
    found = [r.value for r in parsed.of(ml.EV_INFO, ml.K_KERNEL_CEILING)]
    if proc.returncode == 0 and found:
        return found[0]
    said = [str(r.value.get("message", "")).strip().splitlines()[0] for r in parsed.of(ml.EV_ERROR) if r.value.get("message")]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"{entry} --ceiling exited {proc.returncode} without a kernel_ceiling record: {(said or tail)[0]}")


def main(argv: list[str]) -> int:
    from run_benchmarks.start_task import load_cluster, make_runtime, parser

    ap = parser()
    ap.prog = "start_task.py --ceiling"
    ap.add_argument("--ceiling", action="store_true", help="print the case's kernel ceiling on this host's first device alone")
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
        runtime = make_runtime(cluster, args.python)
        python, root = runtime.prepare(plan, Path(tempfile.gettempdir()) / f"flagbench-ceiling-env-{plan.run_id}.log")
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        value = measure(plan, python, root)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    counts = plan.counts[plan.phases[0]]
    print(
        json.dumps(value, indent=2)
        if args.json
        else table(value, args.case_name, plan.hardware["peak_flops"], counts["flops_per_token_6n"])
    )
    return 0
