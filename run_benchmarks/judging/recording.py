"""Recording a reference from runs (``--record-reference``) and judging a finished run again
(``--judge``), with the rule that keeps references honest: a reference changes only in a commit
of its own that says why (tests/test_reference_governance.py), never to absorb a run that
failed against it. Git keeps its earlier versions readable (``git log -p -- <file>``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from run_benchmarks import typed_results
from run_benchmarks import typed_results as tr
from run_benchmarks.curve_math import check_curve
from run_benchmarks.errors import InputError, parse_args
from run_benchmarks.judging.loss_gate import MIN_REPEATS, judge_loss, round_loss, round_status
from run_benchmarks.planning import datacheck, registry
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.planning.curves import (
    check_reference_data,
    combine,
    committed_path,
    distinct_curves,
    mean_reference,
    read_reference,
    same_training,
)
from run_benchmarks.planning.references import recipe_sets
from run_benchmarks.planning.registry import shown, shown_paths
from run_benchmarks.typed_results import Reference, Repeat


def _rounds_ran_through(res: tr.RunResults, path: Path) -> list[tr.RoundResult]:
    through = [r for r in res.rounds if r.ran_through]
    if not through:
        statuses = ", ".join(f"round {r.round} {r.status}" for r in res.rounds) or "no round"
        raise InputError(
            f"{path}: no round ran through (ok, unjudged or invalid by its own gate): {statuses}; a failed round is no reference"
        )
    return through


def _same_key(first: tr.RunResults, first_path: Path, res: tr.RunResults, path: Path) -> None:
    """Repeats of one reference: the same model, recipe, phases, global batch and data, any layout;
    InputError naming ``path``."""
    pairs = [
        ("model", first.model, res.model),
        ("recipe", first.recipe, res.recipe),
        ("phases", first.phases, res.phases),
        ("global batch", first.settings.get("train", {}).get("global_batch"), res.settings.get("train", {}).get("global_batch")),
        (
            "data",
            {ph: (d or {}).get("fingerprint") for ph, d in (first.data or {}).items()},
            {ph: (d or {}).get("fingerprint") for ph, d in (res.data or {}).items()},
        ),
    ]
    for what, theirs, ours in pairs:
        if theirs != ours:
            raise InputError(
                f"{path}: {what} {ours!r}, but {theirs!r} in {first_path}; a reference's repeats are runs of one recipe and data"
            )


def _provenance(res: tr.RunResults, rnd: tr.RoundResult, path: Path) -> dict[str, Any]:
    """Who made a repeat: its file, run, round, config and layout, command, host, devices, code."""
    identities = [m.get("identity") for m in rnd.monitor.values() if isinstance(m, dict) and m.get("identity")]
    return {
        "path": shown(path),
        "run_id": res.run_id,
        "round": rnd.round,
        "config": res.config_name,
        "layout": rnd.layout,
        "vendor": res.vendor,
        "hardware": f"{res.hardware} x{res.world_size}",
        "date": res.started[:10],
        "code_version": res.code_version,
        "command": res.command,
        "host": res.system.get("host"),
        "devices": [g for ident in identities for g in ident.get("gpus") or []] or rnd.devices,
    }


def _failed_against_model(model: str, rnd: tr.RoundResult, phase: str) -> tr.LossGate | None:
    """The gate of ``phase`` in ``rnd`` where it was judged not aligned against a committed
    reference of ``model`` (by whatever name that reference had then); None otherwise."""
    lineage = f"reference/{model}/"
    for p in rnd.phases:
        if p.phase == phase and p.gate.verdict == "not aligned" and lineage in str(rnd.reference.get(phase) or ""):
            return p.gate
    return None


def _refused_by(target: Path, res: tr.RunResults, path: Path, rnd: tr.RoundResult, phase: str, loss: dict[int, float]) -> str | None:
    """Why a repeat may not enter the reference ``target`` replaces: it was judged not aligned
    against it (as recorded, or judged now against the committed curve)."""
    failed = _failed_against_model(res.model, rnd, phase)
    if failed is not None:
        return f"{path} round {rnd.round} was judged not aligned against {shown(target)} ({failed.reason})"
    try:
        old = read_reference(target, phase)
    except ValueError:
        return None
    gate = judge_loss(loss, old, 0)
    if gate.verdict == "not aligned":
        return f"{path} round {rnd.round} is not aligned with {shown(target)} ({gate.reason})"
    return None


def record(paths: list[Path], why: str, replace: bool = False) -> list[str]:
    """Write the runs' curves as the reference of their model, phase, recipe and data (one file per
    phase, :func:`committed_path`); one line per file.

    Every round that ran through is a repeat (layouts and vendors may differ: the reference judges
    them all); their per-step mean is the curve, with the repeats, their provenance and their
    spread. ``why`` says why the reference is made or changed (its file keeps it). A reference
    already there is replaced only with ``replace``, and never by repeats of which one was judged
    not aligned against it: a reference changes to be right, not to absorb a run."""
    if replace and not why.strip():
        raise InputError("--record-reference --replace needs --why TEXT: why the reference changes (kept in it)")
    runs = [(path, tr.load(path)) for path in paths]
    path, res = runs[0]
    for other, r in runs:
        _same_key(res, path, r, other)
        if changed := recipe_sets(r.user_overrides, None, r.settings.get("train")):
            raise InputError(f"{other}: --set {', '.join(changed)} changes its {r.recipe} recipe: no reference of it")
    through = [(p, r, _rounds_ran_through(r, p)) for p, r in runs]
    try:
        case_dir = registry.find_case(CaseName.parse(res.case)).path
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    out = []
    for phase in res.phases:
        ident = (res.data or {}).get(phase) or {"kind": datacheck.SYNTHETIC, "fingerprint": datacheck.SYNTHETIC}
        fp = ident.get("fingerprint")
        if not fp:
            raise InputError(
                f"{path}: phase {phase}: its data has no fingerprint ({ident.get('reason', 'not checked')}); "
                "run where the data is readable to record a reference for it"
            )
        target = committed_path(case_dir, res.model, res.recipe, phase, fp)
        repeats, made, refused = [], [], []
        for p, r, qs in through:
            for q in qs:
                loss = next((x.loss for x in q.phases if x.phase == phase), None)
                if not loss:
                    raise InputError(f"{p}: round {q.round} has no loss curve for phase {phase!r}")
                if target.is_file():
                    refused.append(_refused_by(target, r, p, q, phase, loss))
                repeats.append(Repeat(path=shown(p) + ("" if len(qs) == 1 else f" (round {q.round})"), loss=loss))
                made.append({**_provenance(r, q, p), "path": repeats[-1].path})
        try:
            curve = mean_reference(shown(path), repeats) if len(repeats) > 1 else Reference(path=shown(path), loss=repeats[0].loss)
            check_curve(curve)
        except ValueError as exc:
            raise InputError(f"phase {phase}: {exc}") from None
        if target.is_file() and not replace:
            raise InputError(f"{shown(target)}: a reference of this model, recipe and data exists; --replace replaces it")
        if any(refused):
            why_not = next(x for x in refused if x)
            raise InputError(f"{why_not}: a reference is not changed to absorb a run that failed against it")
        if len(distinct := distinct_curves(repeats)) < MIN_REPEATS:
            raise InputError(
                f"phase {phase}: {len(repeats)} round(s) give {len(distinct)} distinct curve(s); a reference needs at least "
                f"{MIN_REPEATS} repeats that differ in rounding (other layouts or micro batches: on a CPU a run made again "
                "as it was gives the same curve), so that its spread is measured"
            )
        steps = sorted(curve.loss)
        doc: dict[str, Any] = {
            "model": res.model,
            "phase": phase,
            "recipe": res.recipe,
            "global_batch": planning.phase_value(res.settings.get("train") or {}, phase, "global_batch"),
            "data": {k: v for k, v in ident.items() if k in ("kind", "format", "fingerprint", "own_fingerprint", "starts_from", "sampled")},
            "why": why.strip() or f"the first reference of {res.model}'s {res.recipe} recipe: {len(repeats)} run(s) of {res.config_name}",
            "made": dt.date.today().isoformat(),
            "steps": steps,
            "loss": [curve.loss[s] for s in steps],
        }
        doc["spread"] = curve.spread
        doc["repeats"] = [{**m, "steps": sorted(r.loss), "loss": [r.loss[s] for s in sorted(r.loss)]} for m, r in zip(made, repeats)]
        out.append((target, doc))
    lines = []
    for target, doc in out:  # every phase checked before any file is written
        existed = target.is_file()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc, indent=1) + "\n")
        spread = f", spread {100 * doc['spread']:.3f}%" if "spread" in doc else ""
        lines.append(
            f"{'replaced' if existed else 'wrote'} {shown(target)} (phase {doc['phase']}, recipe {doc['recipe']}, "
            f"{len(doc['repeats'])} run(s){spread}, steps {doc['steps'][0]}-{doc['steps'][-1]})"
        )
    return lines


def judge_file(path: Path, files: list[Path]) -> list[str]:
    """A finished run judged against ``files`` (a reference made after it ran), written into its
    results.json: each phase's gate and reference, its rounds' status, the run's status, and in
    ``runtime_info.judged_again`` when and against what. The same gate as a live run's, on the
    curve the run recorded. Only rounds that ran through are judged; one line per round."""
    res = tr.load(path)
    _rounds_ran_through(res, path)
    lines, rounds = [], []
    for rnd in res.rounds:
        if not rnd.ran_through:
            rounds.append(rnd)
            continue
        phases, gates = [], {}
        for p in rnd.phases:
            ref = offline_reference(res, p.phase, files)
            gates[p.phase] = judge_loss(p.loss, ref, p.window.warmup_steps)
            phases.append(p.model_copy(update={"gate": gates[p.phase], "reference": ref}))
        status, reasons = round_status([], gates)
        mre, aligned = round_loss(list(gates.values()))
        reference = {**rnd.reference, **{p.phase: p.reference.path for p in phases if p.reference}}
        update = {"phases": phases, "status": status, "error": "\n".join(reasons) or None, "loss_mre": mre, "loss_aligned": aligned}
        rounds.append(rnd.model_copy(update={**update, "reference": reference}))
        lines.append(f"{path}: round {rnd.round} {status}: " + "; ".join(f"{ph} {g.verdict}: {g.reason}" for ph, g in gates.items()))
    again = [*(res.runtime_info.get("judged_again") or []), {"date": dt.date.today().isoformat(), "reference": [shown(f) for f in files]}]
    res = res.model_copy(
        update={
            "rounds": rounds,
            **typed_results.run_outcome(rounds, None, len(rounds)),
            "runtime_info": {**res.runtime_info, "judged_again": again},
        }
    )
    path.write_text(json.dumps(res.dump(), indent=2, default=str) + "\n")
    return lines


def offline_reference(res: tr.RunResults, phase: str, files: list[Path]) -> Reference:
    """``files`` as the reference of a finished run's phase (``--judge``): each checked as a live
    run's --reference is (data first, then model, phase, recipe, global batch), their mean where
    several. InputError naming the file otherwise."""
    ours = planning.phase_value(res.settings.get("train") or {}, phase, "global_batch")
    ident = (res.data or {}).get(phase)
    fp = datacheck.SYNTHETIC if ident is None else ident.get("fingerprint")  # None: not checked, judged by none
    files = files_of_phase(files, phase)
    for f in files:  # a curve of other data cannot judge it: both fingerprints named
        check_reference_data(f, phase, fp, res.model, (ident or {}).get("reason"))
    refs = []
    for f in files:
        try:
            ref = read_reference(f, phase)
            check_curve(ref)
            same_training(f, phase, res.model, ours, res.recipe)
        except ValueError as exc:
            raise InputError(f"--reference {exc}") from None
        refs.append(ref)
    try:
        ref = combine(refs)
    except ValueError as exc:
        raise InputError(f"--reference {exc}") from None
    return ref.model_copy(update={"path": shown_paths(ref.path)})


def files_of_phase(files: list[Path], phase: str) -> list[Path]:
    """The ``--reference`` files that can judge ``phase``: a committed reference names its one
    phase, and judges only that one; a results.json or a plain curve is read for every phase.
    InputError when none is left, naming the phases the files hold."""
    kept, named = [], []
    for f in files:
        try:
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            kept.append(f)  # read_reference names what is wrong with it
            continue
        their = doc.get("phase") if isinstance(doc, dict) else None
        if their is None or their == phase:
            kept.append(f)
        else:
            named.append(f"{shown(Path(f))} ({their})")
    if not kept:
        raise InputError(f"--reference: no file is a curve of phase {phase!r}: {', '.join(named)}")
    return kept


def absorbed_failures(path: Path) -> list[str]:
    """The repeats of a committed reference that were judged not aligned against a reference of
    the same model (an earlier version of it, by whatever name it had then): a reference made to
    absorb a run that failed against it. Repeats whose results.json is not in the repository are
    not checked."""
    doc = json.loads(path.read_text())
    model, out = doc["model"], []
    for rep in doc.get("repeats") or []:
        file = registry.ROOT / str(rep.get("path", "")).split(" (round ")[0]
        if not file.is_file():
            continue
        res = tr.load(file)
        for rnd in res.rounds:
            if _failed_against_model(model, rnd, doc["phase"]) is not None:
                ref = rnd.reference.get(doc["phase"])
                out.append(f"{shown(path)}: repeat {shown(file)} round {rnd.round} was judged not aligned against {ref}")
    return out


# --------------------------------------------------------------------------- the commands


def judge_again(paths: list[Path], files: list[Path]) -> list[dict[str, Any]]:
    """Each run's rounds that ran through, each phase's curve judged again by the loss gate
    (loss_gate.judge_loss) against the curve ``files``: what the run would have said against them. The
    runs' files are not changed. One row per run, round and phase, with the verdict recorded."""
    if not files:
        raise InputError("--judge needs at least one --reference FILE to judge against")
    rows = []
    for path in paths:
        res = tr.load(path)
        through = [r for r in res.rounds if r.ran_through]
        if not through:
            raise InputError(f"{path}: no round ran through (every round failed): nothing to judge")
        refs: dict[str, tr.Reference] = {}  # per phase: a run's rounds share its settings
        for rnd in through:
            for p in rnd.phases:
                if p.phase not in refs:  # checked as a live run's --reference is, data first
                    refs[p.phase] = offline_reference(res, p.phase, files)
                gate = judge_loss(p.loss, refs[p.phase], p.window.warmup_steps)
                rows.append(
                    {
                        "run": res.run_id,
                        "round": rnd.round,
                        "phase": p.phase,
                        "recorded": f"{p.gate.verdict}: {p.gate.reason}",
                        "verdict": gate.verdict,
                        "noise_units": gate.noise_units,
                        "reason": gate.reason,
                    }
                )
    return rows


def judged_status(verdicts: list[str]) -> int:
    """``--judge``'s exit status, as a run's: 0 every phase judged aligned, 1 a phase not aligned
    or not judged (bad input, 2, is refused before)."""
    return 0 if verdicts and all(v == "aligned" for v in verdicts) else 1


def print_judged(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="loss gate, judged again")
    for col in ("run", "round", "phase", "recorded", "verdict", "x noise", "reason"):
        t.add_column(col)
    for r in rows:
        units = "-" if r.get("noise_units") is None else f"{r['noise_units']:.1f}"
        t.add_row(r["run"], str(r["round"]), r["phase"], r["recorded"], r["verdict"], units, r["reason"])
    Console(width=240).print(t)


def _paths(names: list[str]) -> list[Path]:
    return [Path(a).expanduser().resolve() for a in names]


def judge_main(argv: list[str]) -> int:
    """``flagbench judge RESULTS.json ... --reference FILE ...`` (``start_task.py --judge``)."""
    ap = argparse.ArgumentParser(prog="flagbench judge", description="judge finished runs' loss curves again against --reference files")
    ap.add_argument("runs", nargs="+", metavar="RESULTS.json", help="the runs to judge (their files stay as they are without --update)")
    ap.add_argument(
        "--reference", action="append", default=[], metavar="FILE", help="a curve to judge against (repeatable: their mean and spread)"
    )
    ap.add_argument(
        "--update", action="store_true", help="write the verdicts into the runs' results.json (a reference made after they ran)"
    )
    args = parse_args(ap, argv)
    if isinstance(args, int):
        return args
    try:
        files = _paths(args.reference)
        if args.update:
            verdicts = []
            for path in _paths(args.runs):
                print("\n".join(judge_file(path, files)))
                verdicts += [p.gate.verdict for r in tr.load(path).rounds if r.ran_through for p in r.phases]
            return judged_status(verdicts)
        rows = judge_again(_paths(args.runs), files)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_judged(rows)
    return judged_status([r["verdict"] for r in rows])


def record_main(argv: list[str]) -> int:
    """``flagbench record-reference RESULTS.json ... [--why TEXT] [--replace]`` (``start_task.py --record-reference``)."""
    ap = argparse.ArgumentParser(
        prog="flagbench record-reference", description="make runs the reference of their model, phase, recipe and data"
    )
    ap.add_argument(
        "runs",
        nargs="+",
        metavar="RESULTS.json",
        help="a run's curves become the case's reference for its data; several runs of one config: their mean, with the runs and their spread",
    )
    ap.add_argument("--replace", action="store_true", help="replace a reference that exists")
    ap.add_argument("--why", default="", metavar="TEXT", help="why the reference is made or changed (kept in it)")
    args = parse_args(ap, argv)
    if isinstance(args, int):
        return args
    try:
        print("\n".join(record(_paths(args.runs), args.why, args.replace)))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
