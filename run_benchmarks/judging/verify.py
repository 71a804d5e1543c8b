"""``flagbench verify RESULTS.json [...]`` (``start_task.py --verify``): recompute every figure of a results.json from its
per-step records and recorded config, and name each one that does not match.

Recomputed per phase with the code that made them (metrics.figures, loss_gate.judge_loss):
the window, tokens/p/s, step time, the per-step spread (where the file records one), MFU both
ways from the recorded model counts and peak,
the loss curve and its gate verdict against the reference curve the file holds (or the
recorded reference path, re-read when the file is here; a mean of repeats and its spread
recomputed from the repeats it keeps); per round, the one-phase figures
and the loss aggregates, and a status that agrees with the phases' verdicts. A schema-1
file has no per-step records: what cannot be recomputed is said in one line, and MFU
(from tokens/p/s and the counts) and the loss verdict (from its recorded curve) are checked.
A ``code_version`` that is not a commit of the repository the harness runs from (a full clone),
or one no branch or tag reaches (a clone would not get it), is said in a note.

Exit status: 0 every figure matches, 1 a mismatch (listed), 2 a file that cannot be read.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from run_benchmarks import typed_results as tr
from run_benchmarks.errors import InputError
from run_benchmarks.judging import loss_gate, metrics
from run_benchmarks.planning import curves, registry
from run_benchmarks.planning.code_version import git
from training.flops import mfu

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
REL_TOL = 1e-9  # the figures are recomputed from the same floats: only last-bit differences are allowed
FIGURES = ("steps_run", "window", "tokens_per_gpu_s", "step_time_s", "mfu_6n", "mfu_palm", "loss_final", "loss")
GATE_FIELDS = ("verdict", "mre", "compared_steps", "first_step", "last_step", "nonfinite_step")
GATE_FIELDS_SCHEMA1 = ("verdict", "mre", "compared_steps")  # schema 1 recorded no compared range


def same(a: Any, b: Any) -> bool:
    """Equal, floats to REL_TOL (NaN equals NaN), through models, lists and dicts."""
    if isinstance(a, BaseModel) and isinstance(b, BaseModel):
        return same(a.model_dump(), b.model_dump())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
            return False
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)
    return a == b


def _show(x: Any) -> str:
    if isinstance(x, BaseModel):
        x = x.model_dump()
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


class Check:
    """Collects the mismatches and notes of one file."""

    def __init__(self, path: Path) -> None:
        self.path, self.mismatches, self.notes = path, [], []  # type: Path, list[str], list[str]

    def field(self, where: str, name: str, recorded: Any, recomputed: Any) -> None:
        if not same(recorded, recomputed):
            self.mismatches.append(f"{self.path}: {where}: {name} recorded {_show(recorded)}, recomputed {_show(recomputed)}")


def _reference(res: tr.RunResults, rnd: tr.RoundResult, p: tr.PhaseResult, check: Check) -> tuple[bool, tr.Reference | None]:
    """The curve the phase was judged against: kept in the file, else re-read from its recorded path.
    (False, None) when it cannot be had. A mean of repeats is recomputed from the repeats it
    keeps, and its mean curve and spread checked against them."""
    if p.reference is not None:
        return True, _repeats(p.reference, f"round {rnd.round} phase {p.phase}", check)
    path = rnd.reference.get(p.phase)
    if path is None:
        return True, None  # judged without a reference
    if not Path(path).is_absolute():  # a repository-relative path, as results name committed references
        path = str(registry.ROOT / path)
    if not Path(path).is_file():
        check.notes.append(
            f"{check.path}: round {rnd.round} phase {p.phase}: the loss verdict is not recomputed: its reference {path} is not here"
        )
        return False, None
    try:
        return True, curves.read_reference(Path(path), p.phase)
    except ValueError as exc:
        raise InputError(f"{check.path}: round {rnd.round} phase {p.phase}: its reference: {exc}") from None


def _repeats(ref: tr.Reference, where: str, check: Check) -> tr.Reference:
    """A phase's kept reference, its mean and spread recomputed from its repeats when it has them."""
    if not ref.repeats:
        check.field(where, "reference spread", ref.spread, None)  # one curve has no spread
        return ref
    try:
        mean = curves.mean_reference(ref.path, ref.repeats)
    except loss_gate.BadReference as exc:
        raise InputError(f"{check.path}: {where}: its reference repeats: {exc}") from None
    check.field(where, "reference loss (the mean of its repeats)", ref.loss, mean.loss)
    check.field(where, "reference spread", ref.spread, mean.spread)
    return mean


def _gate(
    res: tr.RunResults, rnd: tr.RoundResult, p: tr.PhaseResult, loss: dict[int, float], check: Check, where: str
) -> tr.LossGate | None:
    found, ref = _reference(res, rnd, p, check)
    if not found:
        return None
    try:
        gate = loss_gate.judge_loss(loss, ref, int(res.settings["train"]["warmup_steps"]))
    except loss_gate.BadReference as exc:
        raise InputError(f"{check.path}: {where}: {exc}") from None
    for name in GATE_FIELDS if res.schema_ >= 2 else GATE_FIELDS_SCHEMA1:
        check.field(where, f"loss gate {name}", getattr(p.gate, name), getattr(gate, name))
    return gate


def _phase(res: tr.RunResults, rnd: tr.RoundResult, p: tr.PhaseResult, check: Check) -> tr.LossGate | None:
    where = f"round {rnd.round} phase {p.phase}"
    counts, peak = res.model_counts[p.phase], res.hardware_info.get("peak_flops")
    if not p.steps:  # schema 1: MFU from the recorded throughput, the verdict from the recorded curve
        check.field(where, "mfu_6n", p.mfu_6n, mfu(counts["flops_per_token_6n"], p.tokens_per_gpu_s, peak))
        check.field(where, "mfu_palm", p.mfu_palm, mfu(counts["flops_per_token_palm"], p.tokens_per_gpu_s, peak))
        return _gate(res, rnd, p, p.loss, check, where)
    fig = metrics.figures(p.steps, int(res.settings["train"]["warmup_steps"]), res.world_size, counts, peak)
    for name in FIGURES:
        check.field(where, name, getattr(p, name), fig[name])
    if p.throughput_spread is not None:  # files made before the spread was recorded have none to check
        check.field(where, "throughput_spread", p.throughput_spread, fig["throughput_spread"])
    return _gate(res, rnd, p, fig["loss"], check, where)


def _round(res: tr.RunResults, rnd: tr.RoundResult, check: Check) -> None:
    gates = {p.phase: _phase(res, rnd, p, check) for p in rnd.phases}
    if res.schema_ < 2:
        return  # schema 1 judged rounds by other rules: its round figures were the first phase's
    where = f"round {rnd.round}"
    one = rnd.phases[0] if len(rnd.phases) == 1 else None
    for name in ("tokens_per_gpu_s", "mfu_6n", "mfu_palm", "window"):
        check.field(where, name, getattr(rnd, name), getattr(one, name) if one else None)
    loss_mre, loss_aligned = loss_gate.round_loss([p.gate for p in rnd.phases])
    check.field(where, "loss_mre", rnd.loss_mre, loss_mre)
    check.field(where, "loss_aligned", rnd.loss_aligned, loss_aligned)
    if rnd.status != "failed" and all(g is not None for g in gates.values()):
        # a round that did not fail has the status its phases' verdicts give
        check.field(where, "status", rnd.status, loss_gate.round_status([], {ph: g for ph, g in gates.items() if g is not None})[0])


def commit_note(path: Path, version: str | None) -> str | None:
    """A note where ``version`` (results.json's ``code_version``, maybe ``+changes``) names no commit
    of the repository the harness runs from; None where it does, where none is recorded, or where
    this is no full git clone (no git, or a shallow one: its history cannot tell)."""
    from run_benchmarks.planning.registry import ROOT

    if not version or git("rev-parse", "--is-shallow-repository") != "false":
        return None
    commit = version.removesuffix("+changes")
    if git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return (
            f"{path}: code_version {version} is not a commit of this repository ({ROOT}): "
            "the code that made it cannot be checked out from here"
        )
    if git("for-each-ref", "--contains", commit, "--format=%(refname)") == "":
        # an object left behind by a rewrite: here, but no clone of this repository gets it
        return f"{path}: code_version {version} is on no branch or tag of this repository ({ROOT}): a clone cannot check it out"
    return None


def verify_file(path: Path) -> Check:
    """Every mismatch and note of one file; InputError when it cannot be read."""
    res = tr.load(path)
    check = Check(path)
    if res.schema_ < 2:
        check.notes.append(
            f"{path}: schema {res.schema_} keeps no per-step records: the window, tokens/p/s, step time and "
            "loss curve cannot be recomputed; checked: MFU from tokens/p/s and the model counts, the loss verdict"
        )
    for rnd in res.rounds:
        _round(res, rnd, check)
    note = commit_note(path, res.code_version)
    if note:
        check.notes.append(note)
    if not check.mismatches:
        check.notes.append(
            f"{path}: every figure of {len(res.rounds)} round(s) matches its records"
            if res.schema_ >= 2
            else f"{path}: every figure that can be recomputed matches"
        )
    return check


def run(paths: list[Path]) -> Iterator[tuple[int, str]]:
    """(exit status of the line, line) per finding, file by file."""
    for path in paths:
        try:
            check = verify_file(path)
        except InputError as exc:
            yield EXIT_BAD_INPUT, f"error: {exc}"
            continue
        for line in check.mismatches:
            yield EXIT_MISMATCH, line
        for line in check.notes:
            yield EXIT_OK, line


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="flagbench verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", metavar="RESULTS.json", help="results.json files to check")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors are bad input
        return int(exc.code or 0) and EXIT_BAD_INPUT
    status = EXIT_OK
    for code, line in run([Path(p) for p in args.files]):
        print(line, file=sys.stderr if code == EXIT_BAD_INPUT else sys.stdout)
        status = max(status, code)  # unreadable (2) over a mismatch (1) over all matching (0)
    return status
