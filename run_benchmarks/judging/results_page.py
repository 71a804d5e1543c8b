"""docs/results/README.md: the headline figures, generated from the committed results files.

``flagbench results-page`` writes the page; ``flagbench results-page --check`` says whether the
committed page is the one the files make (the suite runs it). A headline is the median of the runs
of one measurement (:func:`measurement`, the grouping rule) judged aligned in at least three runs;
a measurement judged aligned in one or two is listed run by run, as no headline. A run's share of
the kernel ceiling is against the ceiling it measured itself, and a ceiling below its throughput
is a failed measurement, never a share above 100 %.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from run_benchmarks import typed_results as tr
from run_benchmarks.judging import runs_table
from run_benchmarks.planning import registry

RUNS = runs_table.RUNS
PAGE = registry.ROOT / "docs" / "results" / "README.md"
#: judged-aligned runs a measurement needs for a headline
HEADLINE_RUNS = 3
#: settings whose names end so name a place on one machine, not how the run ran
PLACES = ("_dir", "_path", "_checkpoint")
RULE = (
    "Runs are one measurement when they share case, vendor, card, GPU count, config, layout, recipe,"
    " phase, hook and every resolved setting of results.json (`settings`; not the code version, run id,"
    f" paths or dates); a measurement judged aligned (round ok, loss gate aligned) in at least {HEADLINE_RUNS}"
    " runs is a headline: their median."
)
#: what names a measurement in both tables
MEASUREMENT = ("case", "vendor", "cards", "config", "layout", "recipe", "phase", "settings", "set")
FIGURES = ("MFU-6N", "allocated (GiB)", "tokens/J", "of own ceiling")
HEADLINE = (*MEASUREMENT, "tokens/p/s (median)", "range", "runs", *FIGURES, "date", "files")
SINGLE = ("date", *MEASUREMENT, "tokens/p/s", *FIGURES, "headline", "file")


def _settings(value: Any) -> Any:
    """The resolved settings without the ones that name a place."""
    if isinstance(value, dict):
        return {k: _settings(v) for k, v in value.items() if not str(k).endswith(PLACES)}
    return value


def measurement(res: tr.RunResults, rnd: tr.RoundResult, phase: tr.PhaseResult) -> tuple:
    """What two runs share when they are one measurement: the grouping rule (:data:`RULE`)."""
    settings = json.dumps(_settings(res.settings), sort_keys=True, default=str)
    layout = phase.layout or rnd.layout or "-"
    return (res.case, res.vendor, res.hardware, res.world_size, res.config_name, layout, res.recipe, phase.phase, res.hook, settings)


@dataclass(frozen=True)
class Run:
    """One round's phase of a committed file."""

    path: Path
    res: tr.RunResults
    rnd: tr.RoundResult
    phase: tr.PhaseResult

    @property
    def judged_aligned(self) -> bool:
        return self.rnd.status == "ok" and self.phase.gate.verdict == "aligned" and bool(self.phase.tokens_per_gpu_s)

    @property
    def allocated(self) -> float | None:
        return self.phase.peak_mem_gib if self.phase.peak_mem_gib is not None else self.rnd.peak_mem_gib

    @property
    def tokens_per_joule(self) -> float | None:
        return self.phase.device_energy.tokens_per_joule if self.phase.device_energy else None

    @property
    def ceiling_failed(self) -> bool:
        """The run's own ceiling came out below its throughput: no share of it can be given."""
        ceiling, tps = self.phase.ceiling_tokens_per_gpu_s, self.phase.tokens_per_gpu_s
        return ceiling is not None and tps is not None and ceiling < tps

    def link(self) -> str:
        prefix = f"{self.res.started[:10]}_{self.res.model}_"
        label = self.path.stem.removeprefix(prefix) if self.path.stem.startswith(prefix) else self.path.stem
        suffix = f" round {self.rnd.round}" if len(self.res.rounds) > 1 else ""
        return f"[{label}{suffix}](runs/{self.path.name})"


def load_runs(runs: Path = RUNS) -> list[Run]:
    return [Run(path, res, rnd, p) for path, res in runs_table.committed(runs) for rnd in res.rounds for p in rnd.phases]


def groups(runs: Iterable[Run]) -> dict[tuple, list[Run]]:
    """Every measurement's runs, in file order."""
    out: dict[tuple, list[Run]] = {}
    for run in runs:
        out.setdefault(measurement(run.res, run.rnd, run.phase), []).append(run)
    return out


def _median(runs: list[Run], figure: Callable[[Run], float | None], show: Callable[[float], str]) -> str:
    """The median over the runs that have the figure, how many when not all do."""
    values = [v for v in map(figure, runs) if v is not None]
    if not values:
        return "-"
    return show(median(values)) + ("" if len(values) == len(runs) else f" ({len(values)} of {len(runs)})")


def _int(x: float) -> str:
    return f"{x:,.0f}"


def ceiling_share(runs: list[Run]) -> str:
    """The median of each run's share of its own ceiling; a ceiling below the throughput is a failed measurement."""
    failed = [r for r in runs if r.ceiling_failed]
    if failed:
        shown = ", ".join(f"{_int(r.phase.ceiling_tokens_per_gpu_s)} < {_int(r.phase.tokens_per_gpu_s)}" for r in failed)
        return f"ceiling failed ({shown})"
    return _median(runs, lambda r: r.phase.ceiling_efficiency, runs_table._pct)


def _digest(run: Run) -> str:
    return hashlib.sha256(measurement(run.res, run.rnd, run.phase)[-1].encode()).hexdigest()[:7]


def _sets(runs: list[Run]) -> str:
    seen: list[str] = []
    for r in runs:
        text = ", ".join(f"{o['param']}={o['value']}" for o in r.res.user_overrides) or "none"
        if text not in seen:
            seen.append(text)
    return " or ".join(seen)


def _what(run: Run) -> list[str]:
    res = run.res
    return [res.model, res.vendor, f"{res.hardware} x {res.world_size}", res.config_name, run.phase.layout or run.rnd.layout or "-"]


def headline_rows(runs: Iterable[Run]) -> list[list[str]]:
    out = []
    for members in groups(runs).values():
        aligned = [r for r in members if r.judged_aligned]
        if len(aligned) < HEADLINE_RUNS:
            continue
        tps = [r.phase.tokens_per_gpu_s for r in aligned]
        first = aligned[0]
        out.append(
            _what(first)
            + [first.res.recipe, first.phase.phase, _digest(first), _sets(aligned)]
            + [_int(median(tps)), f"{_int(min(tps))}-{_int(max(tps))}", f"{len(aligned)} of {len(members)}"]
            + [_median(aligned, lambda r: r.phase.mfu_6n, runs_table._pct), _median(aligned, lambda r: r.allocated, runs_table._gib)]
            + [_median(aligned, lambda r: r.tokens_per_joule, lambda x: f"{x:.2f}"), ceiling_share(aligned)]
            + [", ".join(sorted({r.res.started[:10] for r in aligned})), " ".join(r.link() for r in aligned)]
        )
    return sorted(out)


def single_rows(runs: Iterable[Run]) -> list[list[str]]:
    out = []
    for members in groups(runs).values():
        aligned = [r for r in members if r.judged_aligned]
        if not 0 < len(aligned) < HEADLINE_RUNS:
            continue
        why = f"no: {len(aligned)} of {len(members)} runs judged aligned"
        for r in aligned:
            one = [r]
            out.append(
                [r.res.started[:10]]
                + _what(r)
                + [r.res.recipe, r.phase.phase, _digest(r), _sets(one), _int(r.phase.tokens_per_gpu_s)]
                + [runs_table._pct(r.phase.mfu_6n), runs_table._gib(r.allocated)]
                + [_median(one, lambda x: x.tokens_per_joule, lambda x: f"{x:.2f}"), ceiling_share(one), why, r.link()]
            )
    return sorted(out, key=lambda row: (row[0], row[-1]))


def _table(header: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(runs_table._cell(c) for c in row) + " |" for row in rows
    ]


def page(runs: Path = RUNS) -> str:
    loaded = load_runs(runs)
    body = [
        "# Results",
        "",
        RULE,
        "",
        "Generated from `docs/results/runs/*.json` by `flagbench results-page`; do not edit by hand (the",
        "suite checks that this page is the one the files make). [runs.md](runs.md) lists every run,",
        "[history.md](history.md) says what each measured and why. `settings` names the resolved settings",
        "(a digest: rows alike in it ran alike); `set` is what the runs gave by `--set`; `runs`, those",
        "judged aligned of all the measurement's runs; a share of the kernel ceiling is of the ceiling the",
        "run measured itself.",
        "",
        f"## Headlines: measurements judged aligned in at least {HEADLINE_RUNS} runs",
        "",
        *_table(HEADLINE, headline_rows(loaded)),
        "",
        f"## Single judged runs: measurements judged aligned in 1 to {HEADLINE_RUNS - 1} runs, no headline",
        "",
        *_table(SINGLE, single_rows(loaded)),
    ]
    return "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> int:
    return runs_table.publish(argv, "flagbench results-page", __doc__.split("\n\n")[0], PAGE, lambda: page(RUNS))


if __name__ == "__main__":
    raise SystemExit(main())
