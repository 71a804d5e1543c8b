"""``flagbench conformance`` (``start_task.py --conformance``): a case's conformance check alone.

The check every run makes before training (training/conformance/): the case's probe builds one
decoder layer, the embedding and the loss head on this host's first device as the run would
(the vendor config, variant and ``--set`` values given, the vendor's adapter and hooks), and an
isolated float64 numpy reference of the architecture judges its outputs and gradients. Nothing
trains; no run folder. ``--hook`` gives the check alone a vendor hook (``module:function``) in
place of the config's own, to see what a defect does to it (examples/defects.py); given several
times, one process checks each in turn, its probes forked once their imports are made;
``--each-set KEY=VALUE`` given several times does the same for settings, each value alone.
``--no-cache`` checks again where this stack already has a verdict.

Exit status: 0 passed (every check), 1 failed (or the probe could not finish, or the case has no probe),
2 bad input (nothing ran).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.judging.results import conformance_text
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.planning.config import MODSPEC
from run_benchmarks.running.runtimes import select
from run_benchmarks.tools.ceiling import process_env


def check(plans: list[planning.Plan], python: str, root: Path, cache: Path, no_cache: bool, timeout_s: float = 900) -> list[dict[str, Any]]:
    """The verdicts of the case's probe on this host, one per plan, in order, from one check
    process (RuntimeError where it fails)."""
    with tempfile.TemporaryDirectory(prefix="flagbench-conformance-") as tmp:
        cmd = [python, "-m", "training.conformance", *(["--no-cache"] if no_cache else [])]
        for i, plan in enumerate(plans):
            cfg = Path(tmp) / f"resolved-{i}.json"
            cfg.write_text(json.dumps(plan.resolved(0, str(Path(tmp) / "output"), str(cache)), indent=2))
            cmd += ["--config", str(cfg)]
        limit = timeout_s * len(plans)
        try:
            proc = subprocess.run(cmd, cwd=str(root), env=process_env(plans[0], root), capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the conformance check ran past {limit:.0f} s") from None
    sys.stderr.write("".join(f"{line}\n" for line in proc.stderr.splitlines() if line.startswith(("probe:", "reference:"))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(lines) != len(plans):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the conformance check exited {proc.returncode} after {len(lines)} of {len(plans)} verdicts: {tail[0]}")
    return [json.loads(line) for line in lines]


def _print(cn: CaseName, vendor: str, label: dict[str, str], verdict: dict[str, Any]) -> None:
    what = "".join(f", {k} {v}" for k, v in label.items())
    print(f"conformance of {cn} ({vendor}{what}): {conformance_text(verdict)}")
    for row in verdict.get("failed") or []:
        where = f" at positions {row['positions'][0]:,}-{row['positions'][1]:,}" if row.get("positions") else ""
        print(f"  {row['tensor']}{where}: {100 * row['error']:.3g} % (tolerance {100 * row['tolerance']:.3g} %)")


def main(argv: list[str]) -> int:
    from run_benchmarks.planning.options import load_cluster, parser

    ap = parser()
    ap.prog = "flagbench conformance"
    ap.add_argument(
        "--hook",
        action="append",
        default=[],
        help="a vendor hook for the check alone, module:function (examples/defects.py), in place of the config's own; "
        "repeat to check each in turn in one process",
    )
    ap.add_argument(
        "--each-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a --set of one check: repeat to check each value alone in one process (not with --hook)",
    )
    ap.add_argument("--no-cache", action="store_true", help="check again where this stack already has a verdict")
    args = ap.parse_args(argv)
    try:
        for flag, given in (("--cluster", args.cluster), ("--reference", args.reference), ("--nightly", args.nightly)):
            if given:
                raise InputError(f"the conformance check runs on this host's first device alone; {flag} does not apply")
        for hook in args.hook:
            if not MODSPEC.match(hook):
                raise InputError(f"--hook {hook!r}: must be 'module:function'")
        if args.hook and args.each_set:
            raise InputError("--hook and --each-set: give one of them (each makes checks of its own)")
        check_name(args.vendor, "vendor")
        cn = CaseName.parse(args.case_name)
        cluster = load_cluster(args)

        def planned(sets: list[str]) -> planning.Plan:
            return planning.build(cn, args.vendor, cluster, Path(tempfile.gettempdir()), planning.check_variant(args.variant), sets)

        plan = planned(args.sets)
        if not plan.conformance:
            raise InputError(f"case {cn.model}:{cn.framework} has no conformance probe (case.yaml: conformance)")
        # one check per hook, or per --each-set value, or the one config; each labelled in the output
        checks = (
            [({"hook": hook}, dataclasses.replace(plan, hook=hook)) for hook in args.hook]
            or [({"set": kv}, planned([*args.sets, kv])) for kv in args.each_set]
            or [({}, plan)]
        )
        plans = [p for _, p in checks]
        runtime = select(cluster, args.python)
        python, root = runtime.prepare(plan, Path(tempfile.gettempdir()) / f"flagbench-conformance-env-{plan.run_id}.log")
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cache = Path.home() / ".cache" / "flagbench" / "data"  # the cache a local run's check uses
    try:
        verdicts = check(plans, python, root, cache, args.no_cache)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:  # one check: its verdict; several: the list, each naming its hook or --each-set value
        print(json.dumps(verdicts[0] if len(checks) == 1 else [{**label, **v} for (label, _), v in zip(checks, verdicts)], indent=2))
    else:
        for (label, _), verdict in zip(checks, verdicts):
            _print(cn, args.vendor, label, verdict)
    return 0 if all(v.get("verdict") == "passed" for v in verdicts) else 1
