"""The dependency rules of docs/architecture.md, checked on the source (module-level imports
read with ast, nothing imported):

1. the host side (run_benchmarks/) never imports a framework or numerical library, at any level;
2. the in-process side (training/) imports only the standard library, numpy, torch and itself
   at module level (a framework only inside the function that needs it), never run_benchmarks;
3. what runs on every node outside the framework environment (the node agent, the Slurm node
   wrapper, the launchers, the progress writer, the metric-log protocol) is standard library only;
4. a case never imports the host side;
5. what a case.yaml names for the host to call (``flops``, ``memory``, ``settings``) imports,
   at module level and through the repository's own modules it imports, the standard library only;
6. the host side's stages (planning, judging, running, nightly, tools) import only the stages
   below them, at any level, and no module of the host side is part of an import circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from run_benchmarks.planning import registry
from run_benchmarks.planning.registry import ROOT

FRAMEWORKS = {
    "torch",
    "deepspeed",
    "megatron",
    "paddle",
    "paddlenlp",
    "transformers",
    "numpy",
    "triton",
    "liger_kernel",
    "apex",
    "transformer_engine",
    "PIL",
}
STDLIB = set(sys.stdlib_module_names)
NODE_SIDE = [
    "run_benchmarks/planning/__init__.py",
    "run_benchmarks/running/__init__.py",
    "run_benchmarks/running/node_agent.py",
    "run_benchmarks/running/slurm_node.py",
    "run_benchmarks/running/lease.py",
    "run_benchmarks/planning/launchers.py",
    "run_benchmarks/running/progress.py",
    "training/metriclog.py",
]


def module_file(name: str) -> Path | None:
    """The repository's file of a module name, None for one outside it."""
    base = ROOT / Path(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imported(path: Path, module_level: bool) -> set[str]:
    """Absolute module names imported by a file: at module level (also under if/try there),
    or anywhere."""
    tree = ast.parse(path.read_text(), str(path))
    scope: list[ast.AST] = []
    if module_level:
        for node in tree.body:
            scope += list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else [node]
    else:
        scope = list(ast.walk(tree))
    out: set[str] = set()
    for node in scope:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)  # and ``from pkg import sub`` as pkg.sub where that is a module of the repository
            out |= {f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}")}
    return out


def module_name(path: Path) -> str:
    """A repository file's module name (a package's ``__init__.py``: the package's)."""
    name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    return name.removesuffix(".__init__")


def relative_imports(path: Path) -> set[str]:
    """The absolute names of a file's relative imports (``from .ssh import X``), at any level."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            mod = f"{base}.{node.module}" if node.module else base
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names if module_file(f"{mod}.{a.name}")}
    return out


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_host_side_imports_no_framework():
    bad = {f"{f.relative_to(ROOT)}: {m}" for f in files("run_benchmarks") for m in imported(f, False) if top(m) in FRAMEWORKS}
    assert not bad, sorted(bad)


def test_the_in_process_side_imports_only_stdlib_numpy_torch_at_module_level():
    allowed = STDLIB | {"numpy", "torch", "training", "__future__"}
    bad = {f"{f.relative_to(ROOT)}: {m}" for f in files("training") for m in imported(f, True) if top(m) not in allowed}
    assert not bad, sorted(bad)
    host = {f"{f.relative_to(ROOT)}: {m}" for f in files("training") for m in imported(f, False) if top(m) == "run_benchmarks"}
    assert not host, sorted(host)


@pytest.mark.parametrize("rel", NODE_SIDE)
def test_what_runs_on_every_node_is_standard_library_only(rel):
    path = ROOT / rel
    own = {module_name(ROOT / p) for p in NODE_SIDE} | {"run_benchmarks", "training"}
    bad = {m for m in imported(path, True) if top(m) not in STDLIB | {"__future__"} and m not in own}
    assert not bad, f"{rel}: {sorted(bad)}"


def test_a_case_never_imports_the_host_side():
    bad = {f"{f.relative_to(ROOT)}: {m}" for f in files("cases") for m in imported(f, False) if top(m) == "run_benchmarks"}
    assert not bad, sorted(bad)


#: the host side's stages, lowest first (docs/architecture.md); each imports only those before it
STAGES = ["planning", "judging", "running", "nightly", "tools"]
#: below every stage: the errors, the records' base, the typed results and reference records, and
#: the curves' arithmetic that planning (reading references) and judging (the gate) both need
BELOW = {"run_benchmarks", "run_benchmarks.errors", "run_benchmarks.schema", "run_benchmarks.typed_results", "run_benchmarks.curve_math"}
ABOVE = {"run_benchmarks.start_task", "run_benchmarks.cli"}  # the entry points, above every stage


def stage_rank(module: str) -> int | None:
    """Where a host-side module stands: -1 below the stages, a stage's index, len(STAGES) for an
    entry point, None for a module outside the host side or in no stage."""
    if module in BELOW:
        return -1
    if module in ABOVE:
        return len(STAGES)
    parts = module.split(".")
    return STAGES.index(parts[1]) if parts[0] == "run_benchmarks" and len(parts) > 1 and parts[1] in STAGES else None


def host_graph(module_level: bool) -> dict[str, set[str]]:
    """Host-side module -> the host-side modules it imports (absolute and relative imports)."""
    graph = {}
    for f in files("run_benchmarks"):
        names = imported(f, module_level) | relative_imports(f)
        graph[module_name(f)] = {m for m in names if top(m) == "run_benchmarks" and module_file(m)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: its strongly connected parts of more than one module (or one
    importing itself), each sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(part) > 1 or v in graph.get(v, ()):
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_every_host_module_is_in_a_stage():
    loose = sorted(m for m in host_graph(True) if stage_rank(m) is None)
    assert not loose, f"modules of run_benchmarks/ in no stage ({', '.join(STAGES)}): {loose}"


def test_a_stage_imports_only_the_stages_below_it():
    graph = host_graph(False)
    bad = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if stage_rank(m) is not None and (stage_rank(d) or 0) > stage_rank(m)
    )
    assert not bad, bad


def test_the_host_side_has_no_import_circle():
    assert circles(host_graph(False)) == []


def non_stdlib_imports(name: str, seen: set[str] | None = None) -> set[str]:
    """What module ``name`` imports at module level, and the repository modules it imports in
    turn, that is neither the standard library nor the repository's own, each as 'module: import'."""
    seen = set() if seen is None else seen
    path = module_file(name)
    if name in seen or path is None:
        return set()
    seen.add(name)
    bad: set[str] = set()
    for m in imported(path, True):
        if module_file(m) is not None:
            bad |= non_stdlib_imports(m, seen)
        elif top(m) not in STDLIB | {"__future__"}:
            bad.add(f"{name}: {m}")
    return bad


def test_what_a_case_names_for_the_host_imports_the_standard_library_only():
    named = {
        (key, field, spec)
        for key, entry in registry.cases().items()
        if ":" not in key
        for field in ("flops", "memory", "settings")
        if (spec := getattr(entry.config, field))
    }
    assert {spec for _, field, spec in named if field == "settings"} >= {"cases.llama3.megatron.settings:from_config"}
    bad = {f"{key} {field}: {b}" for key, field, spec in named for b in non_stdlib_imports(spec.partition(":")[0])}
    assert not bad, sorted(bad)
    assert non_stdlib_imports("training.accelerator") == {"training.accelerator: torch"}  # the check bites


def test_the_checks_see_a_violation(tmp_path):
    """The reader finds imports where they hide: under try, in a function, as from-imports."""
    f = tmp_path / "m.py"
    f.write_text("import os\ntry:\n    import torch\nexcept ImportError:\n    pass\n\ndef g():\n    from megatron.core import mpu\n")
    assert imported(f, True) == {"os", "torch"}
    assert imported(f, False) == {"os", "torch", "megatron.core"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}, "b": set()}) == [["a"]]
    assert stage_rank("run_benchmarks.planning.plan") < stage_rank("run_benchmarks.judging.loss_gate") < stage_rank("run_benchmarks.cli")


def test_the_loss_gate_is_a_function_of_curves():
    """judging/loss_gate.py reads no file and asks no plan: at any level it imports only the
    standard library's math and typing helpers and the typed records of the curves it judges."""
    path = ROOT / "run_benchmarks" / "judging" / "loss_gate.py"
    allowed = {"__future__", "math", "typing", "collections.abc", "run_benchmarks.typed_results", "run_benchmarks.curve_math"}
    assert imported(path, module_level=False) <= allowed, imported(path, module_level=False) - allowed


def test_the_orchestrator_hands_a_round_to_judging_once():
    """running/orchestrator.py judges nothing itself: a round's raw outcome goes to
    judging/rounds.py's judge_round in one call; the gate and the figures are judging's."""
    path = ROOT / "run_benchmarks" / "running" / "orchestrator.py"
    uses = imported(path, module_level=False)
    assert "run_benchmarks.judging.rounds" in uses
    assert not uses & {"run_benchmarks.judging.loss_gate", "run_benchmarks.judging.recording"}, uses
    text = path.read_text()
    assert text.count("rounds.judge_round(") == 1 and "judge_phase" not in text and "round_status" not in text


#: the run flow after planning: what runs the rounds and judges them
RUN_FLOW = [
    "run_benchmarks/running",
    "run_benchmarks/judging/rounds.py",
    "run_benchmarks/judging/results.py",
    "run_benchmarks/judging/metrics.py",
]
#: what finds and reads reference files: planning's (the offline commands, verify, judge, compare and
#: record-reference, read them by design)
READS_REFERENCES = {"run_benchmarks.planning.references", "run_benchmarks.planning.curves"}


def test_nothing_after_planning_reads_a_reference_file():
    """A run's references are found, read and checked while it is planned (planning/references.py,
    held by the Plan); the rounds and their judging take them from the plan."""
    flow = [f for d in RUN_FLOW for f in ((ROOT / d).rglob("*.py") if (ROOT / d).is_dir() else [ROOT / d])]
    assert len(flow) > 10, flow
    bad = {module_name(f): sorted(imported(f, False) & READS_REFERENCES) for f in flow}
    assert not {m: r for m, r in bad.items() if r}, bad
    plan = (ROOT / "run_benchmarks" / "planning" / "plan.py").read_text()
    assert "references.resolve(plan)" in plan  # the one place a plan takes them
