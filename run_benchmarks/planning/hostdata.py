"""Data on a cluster's hosts only: checked and fingerprinted there, before training (docs/datasets.md).

Where a phase's ``data_dir`` is not on the machine that runs start_task.py (datacheck marks its
identity ``on_hosts``), the runtime runs this module on every host of the round, with the node
environment's Python (inside the vendor's container where the run uses one), before training:

    python -m run_benchmarks.planning.hostdata SPEC_JSON

``SPEC_JSON`` (:func:`node_spec`) holds those phases' data settings, the model's shape and the
checkpoints loaded by path that are not on this machine. The node side checks the data with the
readers and the check this machine uses (``datacheck.check_phase``: numpy, Pillow for images,
hashlib's SHA-256), so one data set has one fingerprint wherever it is taken; it keeps its digests
under ``FLAGBENCH_CACHE_DIR`` by stat keys that hold the ctime, as this machine does. It prints one
line, ``flagbench-data: {...}`` (each phase's identity, each checkpoint's content); bad data exits 2
with ``error: <one line naming the file>``.

Back here :func:`agree` requires every host's fingerprints to be one (else one line naming two
hosts and their fingerprints) and puts them into the plan's identities, chained as a locally
checked phase's are. The standard library, numpy and the harness's data readers only.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from run_benchmarks.errors import InputError
from run_benchmarks.planning import datacheck

#: what starts the node side's one line of output
MARK = "flagbench-data: "


def hosted(identities: dict[str, dict[str, Any]] | None) -> list[str]:
    """The phases whose data is on the hosts only (fingerprinted there, or to be)."""
    return [ph for ph, ident in (identities or {}).items() if ident.get("on_hosts")]


def pending(identities: dict[str, dict[str, Any]] | None) -> list[str]:
    """The phases whose data is to be fingerprinted on the hosts (not yet)."""
    return [ph for ph in hosted(identities) if not (identities or {})[ph].get("checked")]


def node_spec(plan: Any) -> dict[str, Any] | None:
    """What the node side checks: the hosted phases' settings, the model's shape, and the first
    phase's checkpoints loaded by path that are not on this machine; None when no phase is hosted."""
    phases = hosted(plan.data)
    if not phases:
        return None
    data = plan.settings["data"]
    first = datacheck.phase_data(data, plan.phases[0])
    checkpoints = {
        str(first[key]): f"data.{key}"
        for key in datacheck.CHECKPOINT_KEYS
        if first.get(key) and not os.path.exists(os.path.expanduser(str(first[key])))
    }
    found = {ph: datacheck.unchain(plan.data[ph]) for ph in phases if plan.data[ph].get("checked")}  # by an earlier round's hosts
    return {
        "phases": {ph: datacheck.phase_data(data, ph) for ph in phases},
        "shape": plan.model["shape"],
        "model": plan.case.model,
        "checkpoints": checkpoints,
        "found": {ph: {"fingerprint": ident["fingerprint"], "on": ident.get("checked_on") or []} for ph, ident in found.items()},
    }


def node_argv(python: str, spec: dict[str, Any]) -> list[str]:
    """The node side's command line (an argument list: the runtime quotes it where a shell reads it)."""
    return [python, "-m", "run_benchmarks.planning.hostdata", json.dumps(spec, sort_keys=True, default=str)]


def node_check(spec: dict[str, Any]) -> dict[str, Any]:
    """On a host: every phase of ``spec`` checked and fingerprinted, every checkpoint's content.
    InputError naming the file otherwise."""
    phases = {ph: datacheck.check_phase(d, spec["shape"], spec["model"], ph) for ph, d in spec["phases"].items()}
    checkpoints = {}
    for path, setting in (spec.get("checkpoints") or {}).items():
        if not os.path.exists(os.path.expanduser(path)):
            raise InputError(f"{setting} {path}: no such file or directory on this host")
        checkpoints[path] = datacheck.checkpoint_content(path)
    return {"phases": phases, "checkpoints": checkpoints}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m run_benchmarks.planning.hostdata SPEC_JSON", file=sys.stderr)
        return 2
    try:
        report = node_check(json.loads(args[0]))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(MARK + json.dumps(report, sort_keys=True, default=str), flush=True)
    return 0


def report(host: str, rc: int, output: str, errors: str = "") -> dict[str, Any]:
    """The node side's answer from ``host`` (its exit status, stdout and stderr; a container's log
    is both in one): its report, or InputError naming the host and what it said."""
    lines = (output + "\n" + errors).splitlines()
    said = [ln[len(MARK) :] for ln in lines if ln.startswith(MARK)]
    if rc == 0 and said:
        try:
            return dict(json.loads(said[-1]))
        except ValueError:
            pass
    why = [ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")]
    if rc == 2 and why:
        raise InputError(f"host {host}: {why[-1]}")
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
    raise InputError(f"host {host}: the check of the data there failed (exit status {rc}): {last}")


def not_taken(plan: Any, backend: str) -> dict[str, dict[str, Any]]:
    """The plan's identities where the runtime takes no fingerprint on the hosts before its rounds:
    the pending phases recorded without one, so that no reference judges them."""
    out = {ph: dict(ident) for ph, ident in (plan.data or {}).items()}
    for phase in pending(plan.data):
        out[phase].update(
            on_hosts=False, reason=f"data_dir is not on this machine, and the {backend} backend takes no fingerprint on its hosts"
        )
    return out


def disagreement(reports: list[tuple[str, dict[str, Any]]], found: dict[str, Any] | None = None) -> str | None:
    """One line naming two hosts whose reports differ, and both fingerprints (or contents), or
    the hosts whose data is other than what an earlier round's hosts ``found`` (node_spec's);
    None when every host found the same data."""
    if not reports:
        return None
    (h1, first), *rest = reports
    for phase, earlier in (found or {}).items():
        now = first["phases"][phase]
        if now["fingerprint"] != earlier["fingerprint"]:
            return (
                f"the hosts of this round ({', '.join(h for h, _ in reports)}) hold other data in {now.get('dir')} than "
                f"those of an earlier round ({', '.join(earlier['on'])}): fingerprint {now['fingerprint']}, then {earlier['fingerprint']}"
            )
    for phase, ident in first["phases"].items():
        for h2, rep in rest:
            other = rep["phases"][phase]
            if other["fingerprint"] != ident["fingerprint"]:
                tag = "" if phase == "train" else f"phase {phase}: "
                return (
                    f"{tag}the hosts hold other data in {ident.get('dir')}: {h1} fingerprint {ident['fingerprint']}, "
                    f"{h2} fingerprint {other['fingerprint']} (every host of the round must hold the same data)"
                )
    for path, content in (first.get("checkpoints") or {}).items():
        for h2, rep in rest:
            if rep["checkpoints"][path] != content:
                return (
                    f"{path}: the hosts hold other checkpoints there: {h1} content {content}, {h2} content "
                    f"{rep['checkpoints'][path]} (every host of the round must hold the same one)"
                )
    return None


def agree(plan: Any, reports: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The plan's identities with the hosts' fingerprints for its hosted phases, chained as
    ``datacheck.check`` chains them; ``reports``: (host, its report) for every host of the round.
    InputError, in one line naming two hosts and both fingerprints, where the hosts disagree, or
    where they found other data than an earlier round's hosts."""
    spec = node_spec(plan) or {}
    why = disagreement(reports, spec.get("found"))
    if why:
        raise InputError(why)
    hosts = [h for h, _ in reports]
    first = reports[0][1]
    raw = {ph: datacheck.unchain(ident) for ph, ident in (plan.data or {}).items()}
    for phase in hosted(plan.data):
        before = raw[phase]
        raw[phase] = {**first["phases"][phase], "on_hosts": True, "checked_on": before.get("checked_on") or hosts}
    return datacheck.chain(plan, raw, dict(first.get("checkpoints") or {}))


if __name__ == "__main__":
    raise SystemExit(main())
