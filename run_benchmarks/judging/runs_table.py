"""docs/results/runs.md: one table of every committed run, generated from its results.json.

``flagbench runs-table`` writes the page; ``flagbench runs-table --check`` says whether the
committed page is the one the files make (the suite runs it), so a run added under
docs/results/runs/ is listed by running the command, never by typing a row. One row per round
and phase: date, case, vendor, cards, config, layout, recipe, the run's --set values,
tokens/p/s, MFU both ways, memory, the loss verdict and the round's status, linked to its file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from run_benchmarks import typed_results as tr
from run_benchmarks.errors import InputError
from run_benchmarks.planning import registry

RUNS = registry.ROOT / "docs" / "results" / "runs"
PAGE = registry.ROOT / "docs" / "results" / "runs.md"
HEADER = (
    "date",
    "case",
    "vendor",
    "cards",
    "config",
    "layout",
    "recipe",
    "set",
    "phase",
    "tokens/p/s",
    "MFU-6N",
    "MFU-PaLM",
    "allocated / in use (GiB)",
    "loss",
    "status",
    "file",
)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _loss(gate: tr.LossGate) -> str:
    mre = "" if gate.mre is None else f" ({100 * gate.mre:.2f}%)"
    return f"{gate.verdict}{mre}"


def committed(runs: Path = RUNS) -> Iterator[tuple[Path, tr.RunResults]]:
    """Each committed results file, in name order, with its typed results."""
    for path in sorted(runs.glob("*.json")):
        try:
            res = tr.load(path)
        except InputError as exc:
            raise InputError(f"{path}: not a results.json the results pages can read ({exc})") from None
        yield path, res


def rows(runs: Path = RUNS) -> list[list[str]]:
    out = []
    for path, res in committed(runs):
        sets = ", ".join(f"{o['param']}={o['value']}" for o in res.user_overrides) or "/"
        cards = f"{res.hardware} x {res.world_size}"
        link = f"[{path.stem}](runs/{path.name})"
        if not res.rounds:
            out.append(
                [res.started[:10], res.model, res.vendor, cards, res.config_name, "-", res.recipe, sets, "-", *"-----", res.status, link]
            )
            continue
        for rnd in res.rounds:
            in_use = rnd.device_mem.used_gib if rnd.device_mem else None
            memory = f"{_gib(rnd.peak_mem_gib)} / {_gib(in_use)}"
            for p in rnd.phases or []:
                figures = [f"{p.tokens_per_gpu_s:,.0f}" if p.tokens_per_gpu_s else "-", _pct(p.mfu_6n), _pct(p.mfu_palm)]
                out.append(
                    [res.started[:10], res.model, res.vendor, cards, res.config_name, rnd.layout or "-", res.recipe, sets, p.phase]
                    + figures
                    + [memory, _loss(p.gate), f"round {rnd.round} {rnd.status}", link]
                )
            if not rnd.phases:
                out.append([res.started[:10], res.model, res.vendor, cards, res.config_name, "-", res.recipe, sets, "-", *"----", "-"])
                out[-1] += [f"round {rnd.round} {rnd.status}", link]
    return out


def page(runs: Path = RUNS) -> str:
    body = [
        "# Every committed run",
        "",
        "Generated from `docs/results/runs/*.json` by `flagbench runs-table`; do not edit by hand (the suite",
        "checks that this page is the one the files make). history.md says what each run measured and why;",
        "a figure is a headline only as the median of three runs judged aligned ([README.md](README.md)).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    body += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows(runs)]
    return "\n".join(body) + "\n"


def _shown(path: Path) -> str:
    return str(path.relative_to(registry.ROOT)) if path.is_relative_to(registry.ROOT) else str(path)


def publish(argv: list[str] | None, prog: str, description: str, target: Path, make: Callable[[], str]) -> int:
    """A generated page's command: write ``target`` from ``make()``, or with --check say whether it is current."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed page is not the one the files make")
    args = ap.parse_args(argv)
    try:
        text = make()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = target.read_text() if target.is_file() else ""
        if current != text:
            print(f"{_shown(target)} is not current: run {prog}", file=sys.stderr)
            return 1
        print(f"{_shown(target)}: current")
        return 0
    target.write_text(text)
    print(f"wrote {_shown(target)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return publish(argv, "flagbench runs-table", __doc__.split("\n\n")[0], PAGE, lambda: page(RUNS))


if __name__ == "__main__":
    raise SystemExit(main())
