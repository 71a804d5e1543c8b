"""The plan: from a case name, a vendor and a cluster to what each node runs.

``build`` makes a run's ``Plan`` once, frozen: settings, layout, phases, the data read whole,
the reference files given, the command that re-runs it. Each round's ``RoundPlan`` (the nodes'
commands, the interpreter on them) is made when the round starts. Nothing here executes
anything; ``--dry-run`` prints the plan.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
import socket
from pathlib import Path
from typing import Any

import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning import datacheck, registry
from run_benchmarks.planning.casename import CaseName, check_name
from run_benchmarks.planning.config import STANDARD_RECIPE, CaseConfig, ClusterConfig, VendorConfig, phase_value
from run_benchmarks.planning.launchers import LAUNCHERS, LaunchSpec


@dataclasses.dataclass(frozen=True)
class NodePlan:
    host: str
    address: str
    node_rank: int
    command: list[str]
    env: dict[str, str]
    cwd: str
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # written beside resolved.json
    leftovers: list[str] = dataclasses.field(default_factory=list)  # glob patterns removed after the round


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """One round as planned when it starts: its folder, the interpreter on the nodes and each
    node's launcher command."""

    number: int
    dir: Path
    python: str
    nodes: tuple[NodePlan, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    run_id: str
    case: CaseName
    vendor: VendorConfig
    cluster: ClusterConfig
    case_dir: Path
    launcher: str
    entry: str  # the case's entry point, relative to the case folder
    phases: list[str]
    config_name: str
    config_file: Path
    validated: bool
    settings: dict[str, Any]  # train / parallel / data after all overrides
    model: dict[str, Any]  # the case.yaml model entry, shape included
    overrides: list[dict[str, Any]]  # vendor overrides: param, value, standard
    hook: str | None  # the vendor config's adapter hook ("module:function"), if any
    user_overrides: list[dict[str, Any]]
    counts: dict[str, dict[str, Any]]  # phase -> params and FLOPs per token
    hardware: dict[str, Any]
    run_dir: Path
    # --reference: compare the loss with this curve instead of the committed one; several: with their mean
    reference: list[Path] = dataclasses.field(default_factory=list)
    command: list[str] = dataclasses.field(default_factory=list)  # the start_task.py arguments, to re-run it
    data: dict[str, Any] | None = None  # phase -> the identity of its data, after the pre-launch check (datacheck.py)
    memory: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # phase -> lower bound of the states' memory
    recipe: str = STANDARD_RECIPE  # the named training recipe the settings start from (case.yaml)
    conformance: str | None = None  # the case's conformance probe, "module:function" (case.yaml)
    # phase -> planning.references.PhaseReference: its curve, read and checked, or why it has none
    references: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.case.world_size

    @property
    def data_parallel(self) -> int:
        """world / (tp * pp); check_layout has made sure it divides."""
        par = self.settings["parallel"]
        return self.world_size // (int(par.get("tp", 1)) * int(par.get("pp", 1)))

    def resolved(self, round_no: int, output_dir: str, cache_dir: str) -> dict[str, Any]:
        """The resolved.json a round's ranks read (docs/architecture.md)."""
        return ranks_config(
            self.case,
            self.config_name,
            self.model,
            self.settings,
            self.vendor,
            self.hook,
            self.run_id,
            round_no,
            output_dir,
            cache_dir,
            conformance=self.conformance,
        )

    def to_json(self, rnd: RoundPlan | None = None) -> dict[str, Any]:
        """The plan as JSON; with a round's plan, its interpreter and nodes too (plan.json, --dry-run)."""
        first = self.phases[0]
        nodes = rnd.nodes if rnd else ()
        return {
            "run_id": self.run_id,
            "case": str(self.case),
            "vendor": self.vendor.name,
            "config_name": self.config_name,
            "config_file": str(self.config_file),
            "validated": self.validated,
            "recipe": self.recipe,
            "backend": self.cluster.backend,
            "runtime": "local" if self.cluster.backend == "local" else self.cluster.runtime,
            "launcher": self.launcher,
            "python": rnd.python if rnd else "",
            "hosts": [{"name": n.host, "address": n.address} for n in nodes],
            "nodes": [dataclasses.asdict(n) for n in nodes],
            "settings": self.settings,
            "overrides": self.overrides,
            "user_overrides": self.user_overrides,
            "model": {"name": self.case.model, **self.counts[first], "per_phase": self.counts, "shape": self.model["shape"]},
            "hardware": self.hardware,
            "run_dir": str(self.run_dir),
            # one --reference file as a path (as ever), several as a list of paths
            "reference": [str(p) for p in self.reference] if len(self.reference) > 1 else next((str(p) for p in self.reference), None),
            "data": self.data,
            "command": self.command,
            "memory": self.memory,
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InputError(f"--set {text!r}: expected KEY=VALUE, e.g. train.steps=20")
    for part in key.split("."):
        if not part.isidentifier():
            raise InputError(f"--set {text!r}: {key!r} is not a dotted parameter name")
    if key.split(".")[0] not in ("train", "parallel", "data"):
        raise InputError(f"--set {text!r}: only train.*, parallel.* and data.* may be set")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise InputError(f"--set {text!r}: value is not YAML") from None
    if isinstance(value, dict) or isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        raise InputError(f"--set {text!r}: value must be a scalar or a list of scalars ([a, b])")
    return key, value


#: the share of a device's memory (of a host's, with offload) the states alone may take: the
#: rest holds activations, communication buffers, workspaces and the runtime itself
DEVICE_STATES_LIMIT = 0.90
HOST_STATES_LIMIT = 0.75


def memory_needs(model_fn: Any, counts: dict[str, dict[str, Any]], settings: dict[str, Any], cn: CaseName) -> dict[str, dict[str, Any]]:
    """phase -> the case's lower bound of its states' memory (training/memory.py), in GiB;
    {} when the case names no memory model."""
    if model_fn is None:
        return {}
    par = settings["parallel"]
    base = {k: v for k, v in par.items() if k != "phases"}
    out = {}
    for ph, c in counts.items():
        need = model_fn(c, registry.deep_merge(base, (par.get("phases") or {}).get(ph) or {}), cn.world_size, cn.nprocs)
        out[ph] = {
            "device_gib": round(need["device_bytes"] / 2**30, 2),
            "host_gib_per_node": round(need["host_bytes_per_node"] / 2**30, 2),
            "basis": need["basis"],
        }
    return out


def check_device_memory(memory: dict[str, dict[str, Any]], hardware: dict[str, Any], source: str) -> None:
    """A layout whose weights, gradients and optimizer states alone fill the device is refused."""
    cap = hardware.get("memory_gib")
    for ph, need in memory.items():
        if cap and need["device_gib"] > DEVICE_STATES_LIMIT * cap:
            raise InputError(
                f"{source}: {'' if ph == 'train' else ph + ': '}weights, gradients and optimizer states alone need "
                f"{need['device_gib']:.1f} GiB per {hardware['chip']} ({need['basis']}), more than "
                f"{DEVICE_STATES_LIMIT:.0%} of its {cap:g} GiB before any activation: use more devices, "
                "a larger tensor/pipeline split, a higher ZeRO or sharding stage, or offload the optimizer"
            )


def check_host_memory(memory: dict[str, dict[str, Any]], totals: dict[str, int], source: str) -> None:
    """With offload: the states a node's ranks keep in host memory against each host's total
    (bytes, from the runtime); a host that cannot hold them is named."""
    for ph, need in memory.items():
        for host, total in totals.items():
            if need["host_gib_per_node"] > HOST_STATES_LIMIT * total / 2**30:
                raise InputError(
                    f"{source}: {'' if ph == 'train' else ph + ': '}the optimizer states offloaded to host memory alone "
                    f"need {need['host_gib_per_node']:.1f} GiB per node ({need['basis']}), more than "
                    f"{HOST_STATES_LIMIT:.0%} of {host}'s {total / 2**30:.1f} GiB: the ranks would be killed for "
                    "host memory; use more devices, or a host with more memory"
                )


def check_layout(settings: dict[str, Any], phases: list[str], world: int, source: str) -> None:
    """The layout arithmetic, before launch, with the checks the ranks make (training.settings)."""
    from training.settings import SettingsError, data_parallel, grad_accum

    par = settings["parallel"]
    try:
        dp = data_parallel(world, int(par.get("tp", 1)), int(par.get("pp", 1)))
    except SettingsError as exc:
        raise InputError(f"{source}: {exc}") from None
    for phase in phases:
        gb = int(phase_value(settings["train"], phase, "global_batch"))
        mb = int(phase_value(settings["train"], phase, "micro_batch"))
        try:
            grad_accum(gb, mb, dp)
        except SettingsError as exc:
            raise InputError(f"{source}: {exc}" + (f" (phase {phase})" if phase != "train" else "")) from None


@dataclasses.dataclass
class Resolved:
    """A vendor config resolved against its case: what every run of it and ``check`` share."""

    recipe: str
    config_file: Path
    validated: bool
    hook: str | None
    settings: dict[str, Any]
    overrides: list[dict[str, Any]]
    user_overrides: list[dict[str, Any]]
    counts: dict[str, dict[str, Any]]
    hardware: dict[str, Any]
    memory: dict[str, dict[str, Any]]


def ranks_config(
    cn: CaseName,
    config_name: str,
    model: dict[str, Any],
    settings: dict[str, Any],
    vendor: VendorConfig,
    hook: str | None,
    run_id: str,
    round_no: int,
    output_dir: str,
    cache_dir: str,
    conformance: str | None = None,
) -> dict[str, Any]:
    """The resolved.json a round's ranks read (docs/architecture.md); ``model`` is the case.yaml
    model entry, shape included; ``conformance`` the case's probe (None: the case has none)."""
    return {
        "run_id": run_id,
        "round": round_no,
        "case": {
            "model": cn.model,
            "framework": cn.framework,
            "hardware": cn.hardware,
            "nnodes": cn.nnodes,
            "nprocs": cn.nprocs,
            "conformance": conformance,
        },
        "config_name": config_name,
        "model": {"name": cn.model, "params_nominal": model["params_nominal"], **model["shape"]},
        "train": settings["train"],
        "parallel": settings["parallel"],
        "data": {**settings["data"], "cache_dir": cache_dir},
        "vendor": {
            "name": vendor.name,
            "device": vendor.device,
            "dist_backend": vendor.dist_backend,
            "visible_devices_env": vendor.visible_devices_env,
            "memory_query": vendor.memory_query,
            "allocator_env": vendor.allocator_env,
            "recorded_env": list(vendor.recorded_env),
            "adapters": dict(vendor.adapters),
            "hooks": [hook] if hook else [],
        },
        "output_dir": output_dir,
    }


def check_case_settings(
    case: CaseConfig,
    cn: CaseName,
    vendor: VendorConfig,
    cfg_path: Path,
    settings: dict[str, Any],
    sets: list[str] | None = None,
) -> None:
    """The case's own settings check (case.yaml ``settings``), before anything starts: a
    combination its ranks would refuse (a switch that needs another, a kernel the vendor's device
    lacks) is refused here, naming the config file and the ``--set`` values, with the case's message."""
    check = registry.settings_check(case)
    if check is None:
        return
    from training.settings import SettingsError

    cfg = ranks_config(cn, cfg_path.stem, case.models[cn.model].model_dump(), settings, vendor, None, "", 0, "", "")
    try:
        check(cfg, cn.world_size)
    except SettingsError as exc:
        given = f" with --set {' '.join(sets)}" if sets else ""
        raise InputError(f"{cfg_path}{given}: {exc}") from None


def check_chip(vendor: VendorConfig, cn: CaseName) -> None:
    if cn.hardware not in vendor.chips:
        raise InputError(
            f"vendor {vendor.name!r} has no chip {cn.hardware!r} in vendors/{vendor.name}/vendor.yaml (known: {', '.join(vendor.chips)})"
        )


def resolve(
    cn: CaseName,
    vendor: VendorConfig,
    entry: registry.CaseEntry,
    cfg_path: Path,
    sets: list[str] | None = None,
    recipe: str = STANDARD_RECIPE,
) -> Resolved:
    """The one resolution of a vendor config, for runs (``build``), nightly and ``check``: the
    case's standard under the named recipe, the vendor's fair overrides, ``--set`` overrides, then
    every check that needs no cluster (layout arithmetic, memory of the states)."""
    case = entry.config
    check_chip(vendor, cn)
    vcfg = registry.load_vendor_case(cfg_path)
    standard = registry.standard_settings(case, cn.model, recipe)
    overrides = registry.fairness_check(vcfg.values(), case, standard, str(cfg_path))
    settings = registry.deep_merge(standard, vcfg.values())
    user_overrides = []
    for text in sets or []:
        key, value = parse_override(text)
        if not registry.known_setting(key, standard, case):
            raise InputError(
                f"--set {text!r}: the {case.family}/{case.framework} case ({entry.path / 'case.yaml'}) has no setting "
                f"{key!r}; {registry.unknown_setting_hint(key, standard, case)}"
            )
        if not datacheck.is_data_location(key):  # where the data is (like --data-dir), not how to train
            user_overrides.append({"param": key, "value": value, "standard": registry.get_path(standard, key)})
        registry.set_path(settings, key, value)
    check_layout(settings, case.phases, cn.world_size, str(cfg_path))
    allocator_options(vendor, settings["parallel"], str(cfg_path))
    count_fn = registry.counter(case)
    counts = {ph: count_fn(case.models[cn.model].model_dump(), ph) for ph in case.phases}
    chip = vendor.chips[cn.hardware]
    precision = str(settings["train"]["precision"])
    hardware = {
        "chip": cn.hardware,
        "precision": precision,
        "peak_flops": chip.peak_flops.get(precision),
        "memory_gib": chip.memory_gib,
        "peak_source": chip.source,
        "device_names": list(chip.device_names) or [re.escape(cn.hardware)],
    }
    memory = memory_needs(registry.memory_model(case), counts, settings, cn)
    check_device_memory(memory, hardware, str(cfg_path))
    check_case_settings(case, cn, vendor, cfg_path, settings, sets)
    return Resolved(recipe, cfg_path, vcfg.validated, vcfg.hook, settings, overrides, user_overrides, counts, hardware, memory)


def reference_files(paths: list[str], base: Path | None = None, label: str = "--reference") -> list[Path]:
    """The files of ``--reference`` (or a run list's ``reference``), absolute; relative ones are
    taken from ``base`` (None: the current folder). InputError for one that is not a file."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        path = (path if path.is_absolute() or base is None else base / path).resolve()
        if not path.is_file():
            raise InputError(f"{label} {path}: no such file")
        out.append(path)
    return out


def build(
    cn: CaseName,
    vendor_name: str,
    cluster: ClusterConfig,
    log_dir: Path,
    variant: str | None = None,
    sets: list[str] | None = None,
    data_dir: str | None = None,
    recipe: str = STANDARD_RECIPE,
    references: list[Path] | None = None,
    command: list[str] | None = None,
) -> Plan:
    """The run's plan, the one way start_task.py and a nightly run list make it: the case and the
    vendor's config resolved with ``sets`` on the ``recipe``, the cluster checked against the case,
    the data read whole (datacheck.check), ``references`` (--reference files, absolute) and
    ``command`` (the arguments that re-run it; None: made from the others). InputError, naming the
    file or field, for anything wrong; nothing is written."""
    vendor = registry.load_vendor(vendor_name)
    entry = registry.find_case(cn)
    check_chip(vendor, cn)  # before the config's path: the chip is the clearer cause
    if cluster.backend != "slurm" and len(cluster.hosts) < cn.nnodes:  # slurm allocates its nodes
        raise InputError(f"case {cn} needs {cn.nnodes} nodes but the cluster config names {len(cluster.hosts)} host(s)")
    if cluster.backend == "local" and cn.nnodes != 1:
        raise InputError(f"case {cn}: the local runtime runs one node; give --cluster with {cn.nnodes} hosts")
    r = resolve(cn, vendor, entry, registry.vendor_config_path(vendor.name, cn, variant), sets, recipe)
    settings = r.settings
    data_dir = data_dir or cluster.data_dir
    if data_dir:
        settings["data"]["data_dir"] = data_dir
        if cluster.backend == "local" and Path(data_dir).is_file():
            raise InputError(f"--data-dir {data_dir}: a file, not a folder (the folder that holds the data)")
        if cluster.backend == "local" and not Path(data_dir).is_dir():
            raise InputError(f"data dir {data_dir} does not exist on this host")
    else:
        settings["data"].setdefault("data_dir", None)
    given = [parse_override(t)[0] for t in sets or []]
    datacheck.settle(
        settings,
        registry.standard_settings(entry.config, cn.model, recipe),
        given,
        os.getcwd(),
        cluster.backend == "local",
        cluster.runtime == "container",
    )
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    run_id = f"{cn.model}_{cn.framework}_{cn.size}_{stamp}"
    plan = Plan(
        run_id=run_id,
        case=cn,
        vendor=vendor,
        cluster=cluster,
        case_dir=entry.path,
        launcher=entry.config.launcher,
        entry=entry.config.entry,
        phases=list(entry.config.phases),
        config_name=r.config_file.stem,
        config_file=r.config_file,
        validated=r.validated,
        settings=settings,
        model=entry.config.models[cn.model].model_dump(),
        overrides=r.overrides,
        hook=r.hook,
        user_overrides=r.user_overrides,
        counts=r.counts,
        hardware=r.hardware,
        memory=r.memory,
        recipe=r.recipe,
        conformance=entry.config.conformance,
        run_dir=log_dir / run_id,
        reference=list(references or []),
    )
    if command is None:
        command = command_line(plan, variant, list(sets or []), [str(p) for p in plan.reference])
    return with_references(dataclasses.replace(plan, command=list(command), data=datacheck.check(plan)))


def with_references(plan: Plan) -> Plan:
    """The plan with the references its data selects (the pre-launch check's identities, or what
    the hosts fingerprinted before training), read and checked (InputError naming the file): the
    one place a run's reference files are read."""
    from run_benchmarks.planning import references

    return dataclasses.replace(plan, references=references.resolve(plan))


def allocator_options(vendor: VendorConfig, parallel: dict[str, Any], source: str = "") -> dict[str, str]:
    """The allocator variable of the vendor with the allocator's switches: the vendor's own value
    of it (its ``env``) with ``expandable_segments:True`` for ``parallel.expandable_segments``, and
    ``pinned_use_cuda_host_register:True,pinned_num_register_threads:N`` for
    ``parallel.pinned_register_threads`` N (host memory pinned by registering it, N threads at a
    time, not allocated pinned: docs/results/probes/2026-12-01_h200x1_offload-build/); {} when both
    are off. The variable is set for the ranks before they start, so the allocator reads it at
    its first use. A vendor that declares no ``allocator_env`` cannot take a switch (InputError)."""
    where = source or "settings"
    on = parallel.get("expandable_segments", False)
    if not isinstance(on, bool):
        raise InputError(f"{where}: parallel.expandable_segments must be true or false, got {on!r}")
    threads = parallel.get("pinned_register_threads", 0)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 64:
        raise InputError(f"{where}: parallel.pinned_register_threads must be a whole number from 0 (off) to 64, got {threads!r}")
    options = (["expandable_segments:True"] if on else []) + (
        ["pinned_use_cuda_host_register:True", f"pinned_num_register_threads:{threads}"] if threads else []
    )
    if not options:
        return {}
    var = vendor.allocator_env
    if var is None:
        switch = "expandable_segments" if on else "pinned_register_threads"
        raise InputError(
            f"{where}: parallel.{switch}: vendor {vendor.name!r} declares no allocator_env in "
            f"vendors/{vendor.name}/vendor.yaml (the variable its torch allocator reads, e.g. PYTORCH_CUDA_ALLOC_CONF)"
        )
    ours = {o.split(":")[0] for o in options}
    kept = [o for o in vendor.env.get(var, "").split(",") if o.strip() and o.split(":")[0].strip() not in ours]
    return {var: ",".join([*kept, *options])}


def plan_nodes(plan: Plan, python: str, root: Path, round_dir: Path) -> list[NodePlan]:
    """Each node's launcher command for one round, with ``root`` the code's location there."""
    cluster = plan.cluster
    port = cluster.master_port if cluster.backend != "local" or "master_port" in cluster.model_fields_set else _free_port()
    master = cluster.hosts[0].address
    launcher = LAUNCHERS[plan.launcher]
    env = {
        **plan.vendor.env,
        **allocator_options(plan.vendor, plan.settings["parallel"]),
        "PYTHONPATH": str(root),
        "PYTHONUNBUFFERED": "1",
        "FB_RUN_ID": plan.run_id,
        "FB_ROUND": round_dir.name,
    }
    nodes = []
    for rank, host in enumerate(cluster.hosts[: plan.case.nnodes]):
        node_dir = round_dir / f"node{rank}"
        spec = LaunchSpec(
            python=python,
            nnodes=plan.case.nnodes,
            nprocs=plan.case.nprocs,
            node_rank=rank,
            master_addr=master,
            master_port=port,
            entry=str(root / plan.case_dir.relative_to(registry.ROOT) / plan.entry),
            config=str(round_dir / "resolved.json"),
            log_dir=str(node_dir / "ranks"),
            device=plan.vendor.device,
            rdzv_id=f"{plan.run_id}-{round_dir.name}",
        )
        nodes.append(
            NodePlan(
                host.name,
                host.address,
                rank,
                launcher.command(spec),
                # the ranks write their threads' stacks to stacks/rank<R>.txt when a step
                # (or a phase's build or finish) outlasts the stall timeout, or the start-up
                # is near its timeout (training/case.py),
                # and to their stderr when a fatal signal kills them (causes.fatal_signal_frames)
                {
                    **env,
                    **launcher.env(spec),
                    "FB_STALL_TIMEOUT_S": f"{cluster.stall_timeout_s:g}",
                    "FB_STARTUP_TIMEOUT_S": f"{cluster.startup_timeout_s:g}",
                    "FB_STACKS_DIR": str(node_dir / "stacks"),
                    "PYTHONFAULTHANDLER": "1",
                },
                str(root),
                launcher.files(spec),
                launcher.leftovers(spec),
            )
        )
    return nodes


def command_line(plan: Plan, variant: str | None, sets: list[str], references: list[str]) -> list[str]:
    """The start_task.py arguments that plan this run again (a run list's case as one command)."""
    cn = plan.case
    out = ["run_benchmarks/start_task.py", "--vendor", plan.vendor.name, "--case_name", str(cn)]
    out += ["--variant", variant] if variant else []
    out += ["--recipe", plan.recipe] if plan.recipe != STANDARD_RECIPE else []
    for text in sets:
        out += ["--set", text]
    for ref in references:
        out += ["--reference", ref]
    return out


def check_variant(variant: str | None) -> str | None:
    return check_name(variant, "variant") if variant else None
