"""The case author's tools: ``scaffold-case`` writes a runnable tiny case on the case contract.

    python -m run_benchmarks.tools.case_tools scaffold-case gpt2 deepspeed --model gpt2_tiny

writes, from the templates in run_benchmarks/tools/case_templates/<framework>/ (and common/):

    cases/<family>/<framework>/case.yaml     models (the tiny shape), standard settings, whitelist
    cases/<family>/<framework>/settings.py   the case's own keys on training/settings.py
    cases/<family>/<framework>/model.py      the model in the framework's plain modules (deepspeed, paddle)
    cases/<family>/<framework>/train.py      the lifecycle of training/case.py
    vendors/cpu/cases/<model>/<framework>/config_cpux1x2.yaml
    tests/test_<family>_<framework>_case.py  the run judged against its reference curve

and prints how to run it and record its first reference curve (docs/adding-a-case.md).
Templates: deepspeed (a GPT-2-style decoder in torch on training/deepspeed_loop.py),
megatron (a Llama-style decoder as megatron-core's GPTModel) and paddle (a GPT-2-style
decoder in paddle.nn, data parallel under fleet). Bad input (a name that is not a Python
identifier, a framework without a template, a case or model that exists) is one line and
exit status 2; nothing is written then.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from run_benchmarks.errors import InputError
from run_benchmarks.planning import registry
from training import flops, shapes

TEMPLATES = Path(__file__).resolve().parent / "case_templates"
#: framework -> (its name in prose, the case files its template has)
FRAMEWORKS = {
    "deepspeed": ("DeepSpeed", ("case.yaml", "settings.py", "model.py", "train.py")),
    "megatron": ("megatron-core", ("case.yaml", "settings.py", "train.py")),
    "paddle": ("paddle", ("case.yaml", "settings.py", "model.py", "train.py")),
}
_IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")


def _names(family: str, framework: str, model: str) -> None:
    if not _IDENT.match(family):
        raise InputError(f"family {family!r}: a case folder is a Python package name (lower case letters, digits, _)")
    if framework not in FRAMEWORKS:
        raise InputError(f"framework {framework!r}: scaffold-case has a template for {', '.join(FRAMEWORKS)}")
    if not _IDENT.match(model):
        raise InputError(f"model {model!r}: use lower case letters, digits and _ (it names folders and files)")


def template(framework: str, name: str) -> Path:
    """The framework's own template of ``name``, else the common one."""
    own = TEMPLATES / framework / f"{name}.tmpl"
    return own if own.is_file() else TEMPLATES / "common" / f"{name}.tmpl"


def planned_files(family: str, framework: str, model: str, root: Path) -> dict[Path, Path]:
    """target path -> template."""
    case_dir = root / "cases" / family / framework
    files = {case_dir / name: template(framework, name) for name in FRAMEWORKS[framework][1]}
    files[registry.vendor_config_dir("cpu", model, framework, root / "vendors") / "config_cpux1x2.yaml"] = template(
        framework, "vendor_config.yaml"
    )
    files[root / "tests" / f"test_{family}_{framework}_case.py"] = template(framework, "test_case.py")
    return files


def render(path: Path, values: dict[str, str]) -> str:
    text = path.read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def exact_params(case_yaml: str, model: str) -> int:
    """The parameter count of the template model's shape (training/shapes.py, training.flops)."""
    return flops.param_counts(shapes.case_shape(yaml.safe_load(case_yaml), model))["total"]


def scaffold_case(family: str, framework: str, model: str, root: Path = registry.ROOT) -> list[Path]:
    """Write the case's files; InputError (nothing written) when a name is bad or taken."""
    _names(family, framework, model)
    case_dir = root / "cases" / family / framework
    if case_dir.exists():
        raise InputError(f"{case_dir} exists: scaffold-case writes a new case only")
    taken = registry.cases(root / "cases")
    if any(key.split(":")[0] == model for key in taken):
        raise InputError(f"model {model!r} is served by an existing case ({', '.join(k for k in taken if k.startswith(model + ':'))})")
    files = planned_files(family, framework, model, root)
    for path in files:
        if path.exists():
            raise InputError(f"{path} exists")
    values = {
        "family": family,
        "framework": framework,
        "framework_name": FRAMEWORKS[framework][0],
        "model": model,
        "date": dt.date.today().isoformat(),
        "params": "0",
    }
    values["params"] = f"{exact_params(render(template(framework, 'case.yaml'), values), model):.4e}"
    written = []
    for package in (root / "cases" / family, case_dir):
        package.mkdir(parents=True, exist_ok=True)
        init = package / "__init__.py"
        if not init.exists():
            init.write_text("")
            written.append(init)
    for path, source in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(source, values))
        written.append(path)
    (case_dir / "reference" / model).mkdir(parents=True, exist_ok=True)
    return written


def next_steps(family: str, framework: str, model: str, root: Path) -> list[str]:
    case = f"{model}:{framework}:cpu:1:2"
    return [
        "next:",
        "  1. run it at three micro batches (curves that differ in rounding; a reference has 3 repeats at least):",
        f"                  for mb in 2 4 8; do python run_benchmarks/start_task.py --vendor cpu --case_name {case} --set train.micro_batch=$mb; done",
        "                  (exit 1, status unjudged: no reference curve yet)",
        "  2. record its reference curve from those runs:",
        "                  python run_benchmarks/start_task.py --record-reference logs/<run_id_1>/results.json logs/<run_id_2>/results.json logs/<run_id_3>/results.json",
        f"                  (writes cases/{family}/{framework}/reference/{model}/standard.json: the standard recipe)",
        f"  3. run it again: exit 0, loss aligned; python -m pytest tests/test_{family}_{framework}_case.py",
        "  4. put the real model in model.py and its shapes in case.yaml; docs/adding-a-case.md has the contract",
    ]


def scaffold_case_main(argv: list[str]) -> int:
    """``flagbench scaffold-case``."""
    return main(["scaffold-case", *argv], prog="flagbench")


def main(argv: list[str] | None = None, prog: str = "python -m run_benchmarks.tools.case_tools") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("scaffold-case", help="write a runnable tiny case on the case contract")
    sc.add_argument("family", help="the model family: cases/<family>/ (a Python package name)")
    sc.add_argument("framework", help=f"one of {', '.join(FRAMEWORKS)}")
    sc.add_argument("--model", required=True, help="the tiny model's name, e.g. <family>_tiny")
    args = ap.parse_args(argv)
    try:
        written = scaffold_case(args.family, args.framework, args.model)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(registry.ROOT)}")
    print("\n".join(next_steps(args.family, args.framework, args.model, registry.ROOT)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
