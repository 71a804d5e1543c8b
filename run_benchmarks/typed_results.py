"""The results.json models: a run, its rounds, each round's phases (docs/metrics.md).

The orchestrator builds these and results.write serializes them; every reader (the result
tables, --verify, the history, the nightly verdict and its report) loads a file through
:func:`load` and reads fields, never string keys.  Schema 2 adds the per-step records, the
loss gate's verdict and the reference curve of every phase, and device memory as the
monitor saw it; schema-1 files (no per-step records) still load, their loss figures turned
into a gate verdict as they were recorded.  Fields added to schema 2 since are optional, so
files made before them load as they are: the per-step throughput spread, a reference's
repeats and their spread (empty / null where the reference is one curve).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from run_benchmarks.errors import InputError
from run_benchmarks.schema import Strict, validate
from training.ceiling import efficiency

SCHEMA_VERSION = 2

Status = Literal["ok", "unjudged", "invalid", "failed"]
RunStatus = Literal["running", "ok", "unjudged", "invalid", "failed", "interrupted", "refused"]
#: rounds that ran fine and had nothing not aligned: their figures are results
CLEAN: tuple[str, ...] = ("ok", "unjudged")
#: rounds that ran to their end without an error; an ``invalid`` one's curve only differed from
#: the curve it was judged against, so it is a curve of its own that may judge other runs
RAN_THROUGH: tuple[str, ...] = (*CLEAN, "invalid")
Verdict = Literal["aligned", "not aligned", "not judged"]


class Step(Strict):
    """One optimizer step as the reporting rank's ``train_step`` line gave it."""

    step: int
    t: float  # wall clock when the line was written (the step's end)
    loss: float
    tokens: float
    step_time_s: float
    lr: float
    data_s: float | None = None  # the batch fetch's share of the step time
    profiled: bool = False  # ran under the profiler: never in the throughput window
    skipped: bool = False  # the optimizer skipped it (a loss-scale overflow)


class Window(Strict):
    """The steady window the throughput is taken over."""

    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    warmup_steps: int
    excluded: list[int] = []  # profiled steps after the warm-up


class Spread(Strict):
    """How the steps of the steady window spread: each step's own tokens/p/s (its tokens over
    its time, per GPU), their median and 10th / 90th percentiles (linear between the ordered
    steps), lowest and highest. The phase's ``tokens_per_gpu_s`` stays the window's tokens over
    its time; the spread says how far one step, or a shorter run, may fall from it."""

    steps: int
    median: float
    p10: float
    p90: float
    min: float
    max: float


class Repeat(Strict):
    """One of several runs of the same config whose per-step mean is a reference curve."""

    path: str  # the results.json (or curve file) it came from
    loss: dict[int, float]


class Reference(Strict):
    """The loss curve a phase is judged against, kept in results.json so --verify needs nothing else.

    Made from repeats (``--reference`` given several times, or a curve file that carries them):
    ``loss`` is their per-step mean, ``repeats`` the curves themselves and ``spread`` their noise
    floor, the largest MRE of one repeat against the mean of the others over the compared steps
    (references.mean_reference). One curve: no repeats, no spread (files made before repeats too)."""

    path: str  # the file; with several --reference files, their paths joined by "; "
    loss: dict[int, float]
    repeats: list[Repeat] = []
    spread: float | None = None


class LossGate(Strict):
    """The loss gate's verdict on one phase (references.judge_loss)."""

    verdict: Verdict
    mre: float | None = None  # mean relative error over the compared steps
    compared_steps: int = 0
    first_step: int | None = None  # the compared range
    last_step: int | None = None
    reason: str  # one line, e.g. "MRE 0.42% over steps 21-30", "steps 26-30 missing", "loss NaN at step 7"
    nonfinite_step: int | None = None  # a NaN or inf loss after the warm-up: the round fails
    # the MRE in units of the reference's own noise: its repeats' spread, at least the noise
    # floor (references.NOISE_FLOOR); None against a reference without repeats
    noise_units: float | None = None
    numerics_differ: bool = False  # aligned by the 2 % rule, but far outside the reference's noise

    @property
    def aligned(self) -> bool | None:
        """True aligned, False not aligned, None not judged."""
        return None if self.verdict == "not judged" else self.verdict == "aligned"


class DeviceMemory(Strict):
    """Device memory in use as the monitor (NVML, ixsmi) saw it: the busiest GPU the run used."""

    used_gib: float
    total_gib: float | None = None
    scope: Literal["phase", "round"]  # sampled over the phase's steps, or over the whole round


class DeviceClocks(Strict):
    """The SM clock of the GPUs the run used over a phase's steps, as the monitor saw it (NVML):
    what the run's speed and its share of the kernel ceiling (timed before training) stood on."""

    samples: int  # the GPU samples inside the phase (one per GPU per monitor interval)
    sm_median_mhz: float
    sm_low_mhz: float  # the 10th percentile of the samples
    sm_max_mhz: float | None = None  # the devices' maximum SM clock
    held: dict[str, float] = {}  # reason (monitors.HELD_REASONS) -> share of the samples the driver gave it


class DeviceEnergy(Strict):
    """Energy per token over a phase's steady window (the tokens/p/s window), per device: each used
    GPU's mean power there, from NVML's energy counter where every one has it (its rise from the
    window's first sample to its last), else from the mean of its power samples."""

    source: str  # "energy counter" | "power samples"
    devices: int  # the GPUs averaged
    samples: int  # their samples inside the window
    mean_power_w: float  # per device
    tokens_per_joule: float  # per device: tokens/p/s over the mean power
    power_limit_w: list[float] = []  # the enforced power limits of those GPUs (distinct values)


class PhaseResult(Strict):
    phase: str
    steps_run: int
    window: Window
    tokens_per_gpu_s: float | None = None
    mfu_6n: float | None = None
    mfu_palm: float | None = None
    step_time_s: float | None = None
    throughput_spread: Spread | None = None  # the window's per-step tokens/p/s (None in files made before it)
    loss_final: float | None = None
    loss: dict[int, float] = {}  # step -> loss
    gate: LossGate
    reference: Reference | None = None  # the curve the gate compared with (schema 2)
    meta: dict[str, Any] | None = None  # the run_meta record
    step_breakdown: dict[str, dict[str, Any]] = {}  # rank -> breakdown of its profiled step
    layout: str | None = None
    peak_mem_gib: float | None = None  # the allocator's peak over ranks (peak RSS on a CPU)
    reserved_mem_gib: float | None = None  # the most the allocator's cache held on a rank (accelerators)
    # the most times a rank's allocator gave its cache back for want of a free block (accelerators;
    # None where not reported, and in files made before it)
    alloc_retries: int | None = None
    device_mem: DeviceMemory | None = None  # the monitor's view; None where it saw no device
    device_clocks: DeviceClocks | None = None  # the SM clock over the phase's steps; None where the monitor gave none
    device_energy: DeviceEnergy | None = None  # tokens per joule per device over the window; None without power samples
    steps: list[Step] = []  # every step record (schema 2; empty in schema 1)
    # the kernel ceiling the case measured on its device (run_meta's kernel_ceiling, training/ceiling.py)
    # and the phase's tokens/p/s over it; None where none was measured
    ceiling_tokens_per_gpu_s: float | None = None
    ceiling_efficiency: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _ceiling(cls, data: Any) -> Any:
        """The ceiling figures from the run_meta record when the builder did not give them."""
        if not isinstance(data, dict) or "ceiling_tokens_per_gpu_s" in data:
            return data
        ceiling, eff = efficiency(data.get("meta"), data.get("tokens_per_gpu_s"))
        return {**data, "ceiling_tokens_per_gpu_s": ceiling, "ceiling_efficiency": eff} if ceiling is not None else data

    @model_validator(mode="before")
    @classmethod
    def _schema1(cls, data: Any) -> Any:
        """Schema 1 kept loss_mre / loss_aligned / loss_compared_steps flat: as a gate verdict."""
        if not isinstance(data, dict) or "gate" in data:
            return data
        data = dict(data)
        mre, flag, n = data.pop("loss_mre", None), data.pop("loss_aligned", None), data.pop("loss_compared_steps", 0)
        verdict = {True: "aligned", False: "not aligned", None: "not judged"}[flag]
        reason = "no reference" if flag is None else f"MRE {_pct(mre)} over {n} steps"
        data["gate"] = {"verdict": verdict, "mre": mre, "compared_steps": n or 0, "reason": reason}
        return data


class RoundResult(Strict):
    round: int
    status: Status
    error: str | None = None  # why the round is not ok: one line per problem
    duration_s: float | None = None
    layout: str | None = None  # the phases' layouts
    # the phase's figures when the case has one phase; None otherwise (read the phases)
    tokens_per_gpu_s: float | None = None
    mfu_6n: float | None = None
    mfu_palm: float | None = None
    window: Window | None = None
    peak_mem_gib: float | None = None  # the allocator's peak over phases and ranks
    reserved_mem_gib: float | None = None  # the most the allocator's cache held on a rank (accelerators)
    total_mem_gib: float | None = None  # the device's total as the framework reported it
    per_rank_mem_gib: dict[str, float] = {}
    device_mem: DeviceMemory | None = None  # the monitor's view over the round
    devices: list[str] = []  # as the ranks name them (absent in the earliest schema-1 files)
    loss_mre: float | None = None  # the largest MRE of the phases
    loss_aligned: bool | None = None  # True every phase aligned, False one was not, None otherwise
    phases: list[PhaseResult]
    monitor: dict[str, Any] = {}  # node -> monitors.monitor_summary()
    reference: dict[str, str | None] = {}  # phase -> the reference file
    nodes: list[dict[str, Any]] = []
    metric_parse_errors: int = 0
    orchestration: dict[str, Any] | None = None
    # the conformance check's verdict (training/conformance/): verdict, message, figures; None: not run
    conformance: dict[str, Any] | None = None
    # where rank 0's time went before its first step ended (training/startup.py); None: not recorded
    startup: dict[str, Any] | None = None

    @property
    def clean(self) -> bool:
        return self.status in CLEAN

    @property
    def nonconformant(self) -> bool:
        """Ended before training by a failed conformance check."""
        return bool(self.conformance) and self.conformance.get("verdict") == "failed"

    @property
    def ran_through(self) -> bool:
        """Ran to its end without an error (its loss gate's verdict aside): its curve can be a reference."""
        return self.status in RAN_THROUGH and not self.nonconformant


class RunResults(Strict):
    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    run_id: str
    case: str
    model: str
    framework: str
    vendor: str
    hardware: str
    nnodes: int
    nprocs: int
    world_size: int
    config_name: str
    config_file: str
    validated: bool
    recipe: str = "standard"  # the named training recipe (case.yaml); files before recipes trained under the standard one
    launcher: str
    backend: str
    runtime: str
    started: str
    finished: str | None = None
    system: dict[str, Any]
    settings: dict[str, Any]
    overrides: list[dict[str, Any]]
    hook: str | None = None
    user_overrides: list[dict[str, Any]]
    command: list[str] = []
    code_version: str | None = None  # the harness's git commit, "+changes" when the tree differed from it
    data: dict[str, dict[str, Any]] | None = None  # phase -> the identity of the data it trained on (datacheck.py)
    model_counts: dict[str, dict[str, Any]]  # phase -> params and FLOPs per token
    hardware_info: dict[str, Any]
    rounds: list[RoundResult] = []
    python: str | None = None
    runtime_info: dict[str, Any] = {}
    # the run as a whole: "running" until it ends, then the worst round's status, or "failed" /
    # "interrupted" with the one-line cause when it stopped before or between rounds
    status: RunStatus = "running"
    error: str | None = None

    model_config = {"populate_by_name": True}

    @model_validator(mode="after")
    def _known_schema(self) -> RunResults:
        if self.schema_ > SCHEMA_VERSION:
            raise ValueError(f"schema {self.schema_} is newer than this harness's ({SCHEMA_VERSION}); use a newer flagbench")
        return self

    @property
    def phases(self) -> list[str]:
        """The case's phases in order (those of the first round that has any, else the counts')."""
        for r in self.rounds:
            if r.phases:
                return [p.phase for p in r.phases]
        return list(self.model_counts)

    def dump(self) -> dict[str, Any]:
        """As written: JSON-ready, NaN and inf losses kept as such (JSON's NaN / Infinity)."""
        return self.model_dump(by_alias=True)


def recorded_environment(rounds: Iterable[RoundResult]) -> dict[str, str] | None:
    """The variables the ranks recorded of their environment (run_meta ``environment``, the
    vendor's ``recorded_env``) over ``rounds``, the first value of each name kept; None where no
    phase recorded any (a run from before the record, or a vendor naming none)."""
    recorded = [p.meta["environment"] for r in rounds for p in r.phases if isinstance((p.meta or {}).get("environment"), dict)]
    if not recorded:
        return None
    out: dict[str, str] = {}
    for env in recorded:
        for name, value in env.items():
            out.setdefault(str(name), str(value))
    return out


def environment_changes(now: dict[str, str] | None, then: dict[str, str] | None) -> list[tuple[str, str | None, str | None]]:
    """``(name, now, then)`` for each recorded variable whose value differs between two runs,
    None where a run recorded its environment without it; none where either run recorded no
    environment (nothing to compare)."""
    if now is None or then is None:
        return []
    return [(k, now.get(k), then.get(k)) for k in sorted({*now, *then}) if now.get(k) != then.get(k)]


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def parse(data: Any, source: str) -> RunResults:
    """A results.json's content; InputError naming ``source`` and the field otherwise."""
    if isinstance(data, dict) and "schema" not in data:
        raise InputError(f"{source}: not a results.json (no 'schema' field)")
    return validate(RunResults, data, source)


def load(path: str | Path) -> RunResults:
    """Read a results.json of schema 1 or 2; InputError naming the file when it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise InputError(f"{p}: not JSON ({exc})") from None
    return parse(data, str(p))


def run_outcome(rounds: list[RoundResult], stopped_by: BaseException | None, rounds_wanted: int) -> dict[str, Any]:
    """The run's own ``status`` and ``error``: what stopped it, else its worst round
    (failed > invalid > unjudged > ok), so a file that holds no round still says why."""
    if isinstance(stopped_by, KeyboardInterrupt):
        how = str(stopped_by) or "Ctrl-C"
        return {"status": "interrupted", "error": f"interrupted by {how} after {len(rounds)} of {rounds_wanted} round(s)"}
    if stopped_by is not None:
        text = str(stopped_by).strip().splitlines()
        cause = text[0] if text else type(stopped_by).__name__
        from run_benchmarks.errors import InputError

        if getattr(stopped_by, "refused", False):  # a busy host: the run did not start, nothing failed
            return {"status": "refused", "error": cause}
        if not isinstance(stopped_by, InputError):  # bad input speaks for itself; other errors say what they are
            cause = f"{type(stopped_by).__name__}: {cause}"
        return {"status": "failed", "error": f"stopped after {len(rounds)} of {rounds_wanted} round(s): {cause}"}
    if not rounds:
        return {"status": "failed", "error": "no round ran"}
    worst = max(rounds, key=lambda r: ("ok", "unjudged", "invalid", "failed").index(r.status))
    bad = [f"round {r.round} {r.status}" + (f": {r.error.splitlines()[0]}" if r.error else "") for r in rounds if r.status != "ok"]
    return {"status": worst.status, "error": "; ".join(bad) or None}
