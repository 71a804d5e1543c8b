"""The vendor engineer's tools: ``check`` a vendor folder, ``scaffold`` a vendor or a config.

    python -m run_benchmarks.tools.vendor_tools check nvidia
    python -m run_benchmarks.tools.vendor_tools scaffold-vendor acme --chip X1 --framework megatron
    python -m run_benchmarks.tools.vendor_tools scaffold-config acme llama3_8b:megatron:X1:1:8 [--variant V]

``check`` runs nothing: it validates vendor.yaml, the image definitions, every
per-size config (``cases/<model>/<framework>/config_*.yaml``) against its case's
schema and fairness whitelist, the peak table and the monitor, and prints every
problem at once with file and field.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning import plan as planning
from run_benchmarks.planning import registry
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.planning.config import VendorCaseConfig, VendorConfig, load
from run_benchmarks.planning.config import problems as config_problems
from run_benchmarks.tools import config_validation

CONFIG_NAME = re.compile(
    r"^config_(?P<hw>[A-Za-z0-9][A-Za-z0-9.\-]*)x(?P<n>[0-9]+)x(?P<m>[0-9]+)(?:_(?P<variant>[A-Za-z0-9][A-Za-z0-9_.\-]*))?$"
)


def _function_defined(spec: str, root: Path) -> str | None:
    """Check 'module:function' exists without importing it (no framework needed)."""
    module, _, func = spec.partition(":")
    path = root / Path(*module.split("."))
    src = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
    if not src.is_file():
        found = importlib.util.find_spec(module.split(".")[0]) if module.split(".")[0] not in ("vendors", "cases", "training") else None
        return None if found else f"module {module} not found"
    tree = ast.parse(src.read_text(), str(src))
    if not any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body):
        return f"{src.relative_to(root)} defines no function {func}"
    return None


def check_vendor(name: str, vendors_dir: Path = registry.VENDORS_DIR, cases_dir: Path = registry.CASES_DIR) -> list[str]:
    """Every problem of a vendor folder, each as 'file: field: problem'."""
    problems: list[str] = []
    root = vendors_dir.parent
    vdir = vendors_dir / name
    vfile = vdir / "vendor.yaml"
    listed = config_problems(VendorConfig, vfile)
    if listed:
        return listed  # every field's problem at once; the rest needs a valid vendor.yaml
    vendor = load(VendorConfig, vfile)
    if vendor.name != name:
        problems.append(f"{vfile}: field 'name': {vendor.name!r} does not match the folder {name!r}")
    for chip, c in vendor.chips.items():
        if not c.peak_flops:
            problems.append(f"{vfile}: field 'chips.{chip}.peak_flops': empty peak table (write null for an unknown peak)")
        if PLACEHOLDER in c.source:
            problems.append(f"{vfile}: field 'chips.{chip}.source': still the scaffold's placeholder; name the datasheet of the peak")
        for prec, val in c.peak_flops.items():
            if val is not None and not (1e9 < val < 1e17):
                problems.append(f"{vfile}: field 'chips.{chip}.peak_flops.{prec}': {val} is not a plausible FLOP/s figure")
    if vendor.monitor == "nvml" and importlib.util.find_spec("pynvml") is None:
        problems.append(f"{vfile}: field 'monitor': nvml needs nvidia-ml-py installed")
    for field, spec in (("monitor", vendor.monitor), ("memory_query", vendor.memory_query)):
        err = _function_defined(spec, root) if spec and ":" in spec else None
        if err:
            problems.append(f"{vfile}: field '{field}': {err}")
    for fw, spec in vendor.adapters.items():
        err = _function_defined(spec, root)
        if err:
            problems.append(f"{vfile}: field 'adapters.{fw}': {err}")

    try:
        table = registry.cases(cases_dir)
    except InputError as exc:
        return problems + [str(exc)]
    frameworks_used: set[str] = set()
    for cfg_file, framework in vendor_configs(vdir / "cases", table, problems):
        model = cfg_file.parent.parent.name
        m = CONFIG_NAME.match(cfg_file.stem)
        if not m:
            problems.append(f"{cfg_file}: file name must be config_<HW>x<N>x<M>[_<variant>].yaml")
            continue
        entry = table[f"{model}:{framework}"]
        frameworks_used.add(framework)
        if m["hw"] not in vendor.chips:
            problems.append(f"{cfg_file}: chip {m['hw']!r} is not in {vfile} chips ({', '.join(vendor.chips)})")
            continue
        listed = config_problems(VendorCaseConfig, cfg_file)
        if listed:
            problems += listed
            continue
        changed = registry.flatten(registry.load_vendor_case(cfg_file).values())
        barred = [p for p in sorted(changed) if not registry.allowed(p, entry.config.vendor_may_change)]
        if barred:  # each at once; the checks below need a fair config
            allowed = ", ".join(entry.config.vendor_may_change)
            problems += [f"{cfg_file}: parameter '{p}' may not be changed by a vendor for this case (allowed: {allowed})" for p in barred]
            continue
        try:
            # the resolution every run of this config goes through: fairness, layout, memory
            cn = CaseName(model, framework, m["hw"], int(m["n"]), int(m["m"]))
            r = planning.resolve(cn, vendor, entry, cfg_file)
            if r.hook:
                err = _function_defined(r.hook, root)
                if err:
                    problems.append(f"{cfg_file}: field 'hook': {err}")
            not_validated = config_validation.validation_problem(cfg_file)
            if not_validated:
                problems.append(f"{cfg_file}: field 'validated': {not_validated}")
            prec = r.settings["train"]["precision"]
            if prec not in vendor.chips[m["hw"]].peak_flops:
                problems.append(f"{vfile}: field 'chips.{m['hw']}.peak_flops': no entry for precision {prec!r} used by {cfg_file.name}")
        except InputError as exc:
            problems.append(str(exc))
    for fw in sorted(frameworks_used):
        for f in ("Dockerfile", "requirements.txt"):
            if not (vdir / fw / f).is_file():
                problems.append(f"{vdir / fw / f}: missing (image definition for framework {fw})")
        problems += image_problems(vdir / fw, fw)
    return problems


def vendor_configs(cases_root: Path, table: dict[str, registry.CaseEntry], problems: list[str]) -> list[tuple[Path, str]]:
    """(file, framework) of every yaml in ``cases/<model>/<framework>/`` whose case exists.

    What is not in that layout goes to ``problems``: a yaml outside a framework folder (with
    the move to make), a model folder no case serves, a framework folder of a framework
    that does not serve the model (with the frameworks that do).
    """
    found: list[tuple[Path, str]] = []
    if not cases_root.is_dir():
        return found
    for path in sorted(cases_root.iterdir()):
        if path.is_file() and path.suffix == ".yaml":
            problems.append(f"{path}: not read: configs live in {cases_root}/<model>/<framework>/")
        if not path.is_dir():
            continue
        model = path.name
        serving = registry.frameworks_serving(model, table)
        if not serving:
            known = sorted({k.split(":")[0] for k in table if ":" in k})
            problems.append(f"{path}: no case serves model {model!r}; the cases serve {', '.join(known) or 'none'}")
            continue
        for item in sorted(path.iterdir()):
            if item.is_file() and item.suffix == ".yaml":
                to = " or ".join(str(path / fw / item.name) for fw in serving)
                problems.append(f"{item}: not read: configs live in a framework folder; move it to {to}")
            elif item.is_dir() and item.name not in serving:
                problems.append(f"{item}: framework {item.name!r} does not serve model {model!r}; it is served by {', '.join(serving)}")
            elif item.is_dir():
                found += [(f, item.name) for f in sorted(item.glob("*.yaml"))]
    return found


#: what the scaffold writes where only the vendor knows the value
PLACEHOLDER = "fill in"
PLACEHOLDER_IMAGE = "fill-in/"
#: what a framework environment must install for the cases and the harness's node side: the
#: framework package the cases import (a base image may provide it: then say so in a comment
#: naming it), and psutil for the monitors that run under that environment's Python
NEEDED = {"megatron": ("megatron-core", "psutil"), "deepspeed": ("deepspeed", "psutil"), "paddle": ("paddlenlp", "psutil")}


def image_problems(folder: Path, framework: str) -> list[str]:
    """A framework's image definition: no scaffold placeholder left, requirements complete."""
    out = []
    docker, req = folder / "Dockerfile", folder / "requirements.txt"
    if docker.is_file() and PLACEHOLDER_IMAGE in docker.read_text():
        out.append(f"{docker}: BASE_IMAGE is still the scaffold's placeholder; name the vendor's base image")
    if req.is_file():
        text = req.read_text().lower().replace("_", "-")
        for pkg in NEEDED.get(framework, ()):
            if pkg not in text:
                out.append(
                    f"{req}: does not name {pkg} (needed by {framework} cases and the node monitors; "
                    "if the base image provides it, say so in a comment naming it)"
                )
    return out


VENDOR_TEMPLATE = """\
# Vendor {name}: fill in every field; `python -m run_benchmarks.tools.vendor_tools check {name}` validates.
name: {name}
description: {name} accelerators
device: cuda                 # torch's device type of the vendor's build: cuda, npu, mlu, xpu, musa, ... or cpu
dist_backend: nccl           # its torch.distributed backend: nccl, hccl, cncl, bkcl, mccl, ... or gloo
visible_devices_env: CUDA_VISIBLE_DEVICES
recorded_env: [NCCL_]        # prefixes of the variables each rank records in run_meta (collective and runtime tuning)
monitor: none                # nvml | ixsmi | none | "vendors.{name}.monitor:sample" (the vendor's own sampler)
chips:
  {chip}:
    # dense peak FLOP/s per precision from the vendor's public datasheet; null if not public
    peak_flops: {{bf16: null, fp16: null, fp32: null}}
    memory_gib: null
    source: fill in the datasheet the peak comes from
env: {{}}
adapters: {{}}               # framework: "vendors.{name}.adapters.<module>:install"
container:
  shm_size: 16g
"""

DOCKERFILE_TEMPLATE = """\
# {name} image for {framework} cases: start from the vendor's base image holding its
# torch (or paddle) build, then install requirements.txt beside this file.
ARG BASE_IMAGE=fill-in/base-image:tag
FROM ${{BASE_IMAGE}}
COPY requirements.txt /opt/flagbench/requirements.txt
RUN python3 -m pip install --no-cache-dir -r /opt/flagbench/requirements.txt
ENV PYTHONUNBUFFERED=1
LABEL org.flagbench.vendor={name} org.flagbench.framework={framework}
"""


def scaffold_vendor(name: str, chip: str, frameworks: list[str], vendors_dir: Path = registry.VENDORS_DIR) -> list[Path]:
    check_name(name, "vendor")
    check_name(chip, "chip")
    vdir = vendors_dir / name
    if vdir.exists():
        raise InputError(f"{vdir} exists already")
    written = []
    vdir.mkdir(parents=True)
    (vdir / "vendor.yaml").write_text(VENDOR_TEMPLATE.format(name=name, chip=chip))
    (vdir / "__init__.py").write_text("")
    (vdir / "adapters").mkdir()
    (vdir / "adapters" / "__init__.py").write_text('"""Adapters of this vendor: functions install(cfg: dict) -> None."""\n')
    written += [vdir / "vendor.yaml", vdir / "adapters" / "__init__.py"]
    for fw in frameworks:
        check_name(fw, "framework")
        (vdir / fw).mkdir()
        (vdir / fw / "Dockerfile").write_text(DOCKERFILE_TEMPLATE.format(name=name, framework=fw))
        (vdir / fw / "requirements.txt").write_text(f"# packages for {fw} cases on top of the base image\npyyaml\n")
        written += [vdir / fw / "Dockerfile", vdir / fw / "requirements.txt"]
    return written


def scaffold_config(vendor: str, case_name: str, variant: str | None, vendors_dir: Path = registry.VENDORS_DIR) -> Path:
    cn = CaseName.parse(case_name)
    check_name(vendor, "vendor")
    entry = registry.find_case(cn)
    standard = registry.standard_settings(entry.config, cn.model)
    path = registry.vendor_config_dir(vendor, cn.model, cn.framework, vendors_dir) / f"{registry.config_stem(cn, variant)}.yaml"
    if path.exists():
        raise InputError(f"{path} exists already")
    values: dict[str, Any] = {}
    for p in entry.config.vendor_may_change:
        v = registry.get_path(standard, p)
        if v is not None and not p.startswith("phases."):
            registry.set_path(values, p, v)
    standard_text = yaml.safe_dump(values, sort_keys=False).rstrip()
    lines = [
        f"# {vendor} config for {cn.model} on {cn.size}. Uncomment and change only what this hardware",
        "# needs; every value set here is listed in results.json as an override of the standard.",
        "# Allowed keys: " + ", ".join(entry.config.vendor_may_change),
        f"description: {cn.model} on {cn.nnodes} x {cn.nprocs} {cn.hardware}",
        "validated: false   # true with validated_by: docs/results/runs/<file>.json, a run of it judged aligned",
        "# the case's standard values:",
        *("# " + ln for ln in standard_text.splitlines()),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def check_main(argv: list[str]) -> int:
    """``flagbench check``."""
    return main(["check", *argv], prog="flagbench")


def scaffold_vendor_main(argv: list[str]) -> int:
    """``flagbench scaffold-vendor``."""
    return main(["scaffold-vendor", *argv], prog="flagbench")


def scaffold_config_main(argv: list[str]) -> int:
    """``flagbench scaffold-config``."""
    return main(["scaffold-config", *argv], prog="flagbench")


def main(argv: list[str] | None = None, prog: str = "python -m run_benchmarks.tools.vendor_tools") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate a vendor folder without running anything")
    c.add_argument("vendor")
    sv = sub.add_parser("scaffold-vendor", help="create vendors/<name>/ from templates")
    sv.add_argument("vendor")
    sv.add_argument("--chip", required=True)
    sv.add_argument("--framework", action="append", default=[], help="megatron, deepspeed, paddle (repeatable)")
    sc = sub.add_parser("scaffold-config", help="create a per-size config for a case")
    sc.add_argument("vendor")
    sc.add_argument("case_name")
    sc.add_argument("--variant")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            check_name(args.vendor, "vendor")
            problems = check_vendor(args.vendor)
            for p in problems:
                print(p)
            print(f"{args.vendor}: {len(problems)} problem(s)" if problems else f"{args.vendor}: ok")
            return 1 if problems else 0
        if args.cmd == "scaffold-vendor":
            for p in scaffold_vendor(args.vendor, args.chip, args.framework or ["megatron"]):
                print(f"wrote {p}")
            return 0
        print(f"wrote {scaffold_config(args.vendor, args.case_name, args.variant)}")
        return 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
