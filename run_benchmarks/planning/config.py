"""Typed configs, validated at load.  Every error names the file and the field.

Four kinds of YAML file:

- cluster config (``--cluster FILE``): hosts, SSH, ports, directories;
- ``vendors/<vendor>/vendor.yaml``: chips and peaks, device, container options;
- ``cases/<family>/<framework>/case.yaml``: models, standard settings, whitelist;
- ``vendors/<vendor>/cases/<model>/<framework>/config_*.yaml``: the vendor's per-size values.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from run_benchmarks.errors import InputError
from run_benchmarks.planning.casename import check_name
from run_benchmarks.schema import FieldError, M, Strict, problem_line, validate

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-.]{0,252})$")
_MODSPEC = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")
MODSPEC = _MODSPEC  # "module:function", as configs name code
_ENVNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENVPREFIX = re.compile(r"^[A-Z][A-Z0-9_]*$")  # upper case: a prefix matches every variable it begins
# what reaches a remote host as a login name or a path: no shell metacharacters, no spaces
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_REMOTE_PATH = re.compile(r"^/[A-Za-z0-9_.+@%,:=/-]*$")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")


def parse_duration(text: str) -> float:
    """Seconds of a duration written ``90``, ``90s``, ``30m`` or ``2h``."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r} (write 90s, 30m or 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def check_user(v: str | None) -> str | None:
    if v is not None and not _USER.match(v):
        raise ValueError("not a user name (letters, digits, '_', '.', '-'; at most 32; starting with a letter or '_')")
    return v


def check_remote_path(v: str | None) -> str | None:
    """An absolute path on a host, of characters that need no quoting, without '..'."""
    if v is None:
        return v
    if not _REMOTE_PATH.match(v) or ".." in v.split("/"):
        raise ValueError("not an absolute path of letters, digits and _.+@%,:=/- without '..'")
    return v.rstrip("/") or "/"


# --------------------------------------------------------------------------- cluster


class SSHConfig(Strict):
    user: str = "root"
    port: int = Field(22, ge=1, le=65535)
    key_file: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool = False  # explicit opt-in, never silent
    connect_timeout_s: float = Field(10.0, gt=0)
    command_timeout_s: float = Field(60.0, gt=0)
    lost_after_s: float = Field(30.0, ge=3)  # a host silent this long is lost, in every phase

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str | None:
        return check_user(v)


class HostConfig(Strict):
    name: str
    address: str = ""  # needed by the ssh backend; Slurm's nodes are found by name
    user: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    key_file: str | None = None
    docker_url: str | None = None  # default: ssh://user@address:port
    work_dir: str | None = None  # default: the cluster's work_dir

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return check_user(v)

    @field_validator("work_dir")
    @classmethod
    def _work_dir(cls, v: str | None) -> str | None:
        return check_remote_path(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return check_name(v, "host name")
        except InputError as exc:  # reported by validate() with the file and field
            raise ValueError(str(exc)) from None

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            if not _HOSTNAME.match(v):
                raise ValueError(f"{v!r} is neither an IP address nor a host name") from None
            return v


_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}(:\d{1,2})?)?|UNLIMITED|INFINITE)$", re.I)


class SlurmConfig(Strict):
    """The ``slurm:`` section of a cluster file (backend ``slurm``, docs/slurm.md)."""

    partition: str | None = None
    account: str | None = None
    time_limit: str = "01:00:00"  # sbatch --time: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]], UNLIMITED
    extra_sbatch: list[str] = []  # more sbatch options, one per item, e.g. "--gres=gpu:8"
    container_runtime: Literal["none", "docker"] = "none"
    exclusive: bool = True  # whole nodes (sbatch --exclusive), as a benchmark needs
    srun_extra: list[str] = []  # more options for the srun step, e.g. "--mpi=none"
    slurm_conf: str | None = None  # SLURM_CONF for the client commands; default: the site's
    node_python: str | None = None  # runs the node wrapper and monitors; default: this Python
    image: str | None = None  # docker: image on the nodes; {vendor} and {framework} are filled in
    poll_interval_s: float = Field(1.0, gt=0)  # how often the job state is read
    #: the nodes end the job's ranks when the run's lease (running/lease.py) is not renewed for this long
    lease_s: float = Field(120.0, ge=5)
    #: how long the harness keeps trying a Slurm that does not answer (munge lost) before it gives the job up
    unreachable_s: float = Field(60.0, ge=5)

    @field_validator("extra_sbatch", "srun_extra")
    @classmethod
    def _options(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not opt.startswith("-") or any(c in opt for c in "\n\r\0"):
                raise ValueError(f"{opt!r} is not one command-line option (starts with '-', one line)")
        return v

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str) -> str:
        if not _SLURM_TIME.match(v):
            raise ValueError(f"{v!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]], UNLIMITED)")
        return v

    @model_validator(mode="after")
    def _container(self) -> SlurmConfig:
        if self.container_runtime == "docker" and not self.image:
            raise ValueError("container_runtime 'docker' needs image (the vendor image present on the nodes)")
        return self


class ClusterConfig(Strict):
    """Where a case runs.  The embedded default: this host, no SSH, no container."""

    backend: Literal["local", "ssh", "slurm"] = "local"
    runtime: Literal["process", "container"] = "process"
    hosts: list[HostConfig] = [HostConfig(name="localhost", address="127.0.0.1")]
    ssh: SSHConfig = SSHConfig()
    slurm: SlurmConfig | None = None
    master_port: int = Field(29500, ge=1024, le=65535)
    log_dir: str | None = None
    data_dir: str | None = None
    work_dir: str = "/tmp/flagbench"  # where the harness's code lands on remote hosts
    python: str | None = None  # use this Python as is (no environment built)
    image_build_args: dict[str, str] = {}  # e.g. {BASE_IMAGE: ...} for the vendor Dockerfiles
    round_timeout_s: float = Field(3600.0, gt=0)
    # launch to the first rank's run_meta (every node joined, the framework is up): a node
    # that never joins the rendezvous is found here, long before the round deadline
    startup_timeout_s: float = Field(900.0, gt=0)
    # once a rank has reported, the longest the ranks may go without a new record (a step, a
    # phase's start or end) before the round is stopped as hung; each rank writes its threads'
    # stacks at that age of its current step (training/case.py), and the round's error names
    # where each waited (run_benchmarks/running/causes.py)
    stall_timeout_s: float = Field(1800.0, gt=0)
    # how long a run waits for a host another run holds (start_task.py --wait); 0: refused at once
    lock_wait_s: float = Field(0.0, ge=0)
    # keep each host's <work_dir>/runs/<run> folder after the run (start_task.py --keep-remote)
    keep_remote: bool = False

    @field_validator("work_dir")
    @classmethod
    def _work_dir(cls, v: str) -> str | None:
        return check_remote_path(v)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        if self.backend == "ssh":  # one machine twice: the run would wait on its own lock
            seen: dict[tuple[str, int], str] = {}
            for h in self.hosts:
                where = (h.address, h.port or self.ssh.port)
                if where in seen:
                    raise ValueError(f"hosts: {seen[where]!r} and {h.name!r} are one host: both {where[0]} port {where[1]}")
                seen[where] = h.name
        if not self.hosts:
            raise ValueError("hosts: at least one host is needed")
        if self.backend != "slurm":
            bare = [h.name for h in self.hosts if not h.address]
            if bare:
                raise ValueError(f"hosts {', '.join(bare)}: field 'address' is needed with backend {self.backend!r}")
        if self.backend == "local" and self.runtime == "container":
            raise ValueError("runtime 'container' needs backend 'ssh' or 'slurm'")
        return self


# --------------------------------------------------------------------------- vendor


class ChipConfig(Strict):
    peak_flops: dict[str, float | None]  # precision -> FLOP/s; None: unknown
    memory_gib: float | None = None
    source: str  # where the peak figure comes from
    # how the framework names the device (torch's get_device_properties().name), as regular
    # expressions searched case-insensitively; none: the chip name itself. A round whose ranks
    # report another device fails: its figures would be filed under the wrong chip.
    device_names: list[str] = []


class ContainerOptions(Strict):
    shm_size: str | None = None
    ulimits: dict[str, int] = {}
    gpus: bool = False  # docker device request for all GPUs
    devices: list[str] = []
    privileged: bool = False
    privileged_reason: str | None = None
    extra_env: dict[str, str] = {}
    mounts: list[str] = []  # "src:dst[:ro]"
    # the image gives the OS only; the host-built framework environment and the
    # interpreter it was made from are mounted read-only (the cpu vendor in CI)
    mount_framework_env: bool = False

    @model_validator(mode="after")
    def _priv(self) -> ContainerOptions:
        if self.privileged and not self.privileged_reason:
            raise ValueError("privileged: true needs privileged_reason saying why")
        return self


#: device samplers the harness ships; a vendor names its own as "module:function" (a function
#: returning one dict per device, as run_benchmarks.running.monitors documents)
BUILTIN_MONITORS = ("nvml", "ixsmi", "none")
_DEVICE_TYPE = re.compile(r"^[a-z][a-z0-9_]*$")


class VendorConfig(Strict):
    name: str
    description: str = ""
    # torch's device type of the vendor's build (cuda, cpu, npu, mlu, xpu, musa, ...) and the
    # torch.distributed backend its collectives register (nccl, gloo, hccl, cncl, bkcl, mccl, ...)
    device: str
    dist_backend: str
    visible_devices_env: str | None = None
    monitor: str = "none"
    # "module:function" giving a rank's device memory (peak allocated, total, device name);
    # none: the device type's torch module (torch.cuda, torch.npu, ...) is asked
    memory_query: str | None = None
    # the environment variable the vendor's torch allocator reads its options from
    # (PYTORCH_CUDA_ALLOC_CONF for CUDA's caching allocator); none: a config cannot set them
    allocator_env: str | None = None
    # the environment each rank records in its run_meta (``environment``): every variable whose
    # name starts with one of these (NCCL_ for the collectives' tuning, ...), as the rank saw it,
    # so that two runs apart only by such a variable show it (start_task.py --compare)
    recorded_env: list[str] = []
    chips: dict[str, ChipConfig]
    env: dict[str, str] = {}
    adapters: dict[str, str] = {}  # framework -> "module:function"
    container: ContainerOptions = ContainerOptions()

    @field_validator("device", "dist_backend")
    @classmethod
    def _type_name(cls, v: str) -> str:
        if not _DEVICE_TYPE.match(v):
            raise ValueError(f"must be a lower-case name such as cuda, npu or nccl, hccl, got {v!r}")
        return v

    @field_validator("visible_devices_env", "allocator_env")
    @classmethod
    def _visible(cls, v: str | None) -> str | None:
        if v is not None and not _ENVNAME.match(v):
            raise ValueError(f"environment variable name {v!r} is not valid")
        return v

    @field_validator("recorded_env")
    @classmethod
    def _recorded(cls, v: list[str]) -> list[str]:
        for prefix in v:
            if not _ENVPREFIX.match(prefix):
                raise ValueError(f"must be names or name prefixes of environment variables such as NCCL_, got {prefix!r}")
        return v

    @field_validator("monitor")
    @classmethod
    def _monitor(cls, v: str) -> str:
        if v not in BUILTIN_MONITORS and not _MODSPEC.match(v):
            raise ValueError(f"must be one of {', '.join(BUILTIN_MONITORS)} or a vendor's 'module:function', got {v!r}")
        return v

    @field_validator("memory_query")
    @classmethod
    def _memory_query(cls, v: str | None) -> str | None:
        if v is not None and not _MODSPEC.match(v):
            raise ValueError(f"must be 'module:function', got {v!r}")
        return v

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: dict[str, str]) -> dict[str, str]:
        for fw, spec in v.items():
            if not _MODSPEC.match(spec):
                raise ValueError(f"adapter for {fw!r} must be 'module:function', got {spec!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENVNAME.match(k):
                raise ValueError(f"environment variable name {k!r} is not valid")
        return v


# --------------------------------------------------------------------------- case


class Recipe(Strict):
    """A named training recipe of one model: train values laid over its standard ones (the short
    runs every GPU measurement makes, chosen by measurement: docs/metrics.md)."""

    description: str
    train: dict[str, Any]
    data: dict[str, Any] = {}  # the synthetic corpus it trains on (``data.synthetic``), if not the standard one

    @field_validator("data")
    @classmethod
    def _data(cls, v: dict[str, Any]) -> dict[str, Any]:
        if set(v) - {"synthetic"}:
            raise ValueError(f"a recipe's data sets only synthetic (the corpus it trains on), not {sorted(set(v) - {'synthetic'})}")
        return v

    @field_validator("train")
    @classmethod
    def _train(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "micro_batch" in v or any("micro_batch" in (p or {}) for p in (v.get("phases") or {}).values()):
            raise ValueError("train.micro_batch is a layout's choice, not a recipe's")
        return v


#: the recipe a run trains under unless it names another: the case's standard settings as they are
STANDARD_RECIPE = "standard"


class ModelEntry(Strict):
    params_nominal: float = Field(gt=0)
    shape: dict[str, Any]
    train: dict[str, Any] = {}
    parallel: dict[str, Any] = {}
    data: dict[str, Any] = {}
    recipes: dict[str, Recipe] = {}  # name -> train values over the standard ones (``--recipe NAME``)

    @field_validator("recipes")
    @classmethod
    def _recipes(cls, v: dict[str, Recipe]) -> dict[str, Recipe]:
        for name in v:
            if name == STANDARD_RECIPE or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                raise ValueError(f"recipe name {name!r}: lower-case letters, digits and '_', not {STANDARD_RECIPE!r}")
        return v


class CaseStandard(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    train: dict[str, Any]
    parallel: dict[str, Any] = {}
    data: dict[str, Any] = {}

    @field_validator("train")
    @classmethod
    def _train(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in ("steps", "warmup_steps", "global_batch", "micro_batch", "precision"):
            if key not in v:
                raise ValueError(f"train.{key} is required")
        return v


class CaseConfig(Strict):
    family: str
    framework: str
    launcher: Literal["torchrun", "deepspeed", "paddle"]
    entry: str = "train.py"
    flops: str = "training.flops:decoder_flops"
    memory: str | None = None  # lower bound of the states' memory, e.g. training.memory:zero_states (none: not checked)
    settings: str | None = None  # the case's own settings check, fn(resolved, world_size), run before launch (none: in the ranks only)
    ceiling: bool = False  # the entry measures its kernel ceiling alone under --ceiling (training/ceiling.py)
    conformance: str | None = None  # the probe of the conformance check, fn(cfg, out) (training/conformance/)
    phases: list[str] = ["train"]
    shape_schema: str = "ModelShape"  # training/shapes.py's class every model's shape is read through
    shape_defaults: dict[str, Any] = {}  # the family's flags, stated once; a model block states what differs
    models: dict[str, ModelEntry]
    standard: CaseStandard
    vendor_may_change: list[str]
    reference_dir: str = "reference"
    description: str = ""

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, data: Any) -> Any:
        """Each model's whole shape, read through the schema (training/shapes.py): the family's
        ``shape_defaults`` with the model block over them, every field checked and resolved."""
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return data
        from training import shapes
        from training.settings import SettingsError

        models = {}
        for name, entry in data["models"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("shape"), dict):
                models[name] = entry  # the fields' own validation names what is wrong
                continue
            try:
                models[name] = {**entry, "shape": shapes.case_shape(data, name).as_dict()}
            except SettingsError as e:
                raise FieldError(e.loc or ("models", name, "shape"), e.reason) from None
        return {**data, "models": models}

    @field_validator("flops", "memory", "settings", "conformance")
    @classmethod
    def _flops(cls, v: str | None) -> str | None:
        if v is not None and not _MODSPEC.match(v):
            raise ValueError(f"must be 'module:function', got {v!r}")
        return v


class VendorCaseConfig(BaseModel):
    """A vendor's per-size config: meta keys plus nested values to override."""

    model_config = ConfigDict(extra="allow", frozen=True)
    description: str = ""
    validated: bool = False
    validated_by: str | None = None  # docs/results/runs/<file>.json: the run judged aligned that validates it
    hook: str | None = None  # "module:function", called as fn(cfg) in every rank, runtime only

    @field_validator("hook")
    @classmethod
    def _hook(cls, v: str | None) -> str | None:
        if v is not None and not _MODSPEC.match(v):
            raise ValueError(f"must be 'module:function', got {v!r}")
        return v

    def values(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


# --------------------------------------------------------------------------- loading


def phase_value(train: dict[str, Any], phase: str, key: str) -> Any:
    """A train setting of one phase: its ``phases.<phase>`` value, else the common one."""
    return ((train.get("phases") or {}).get(phase) or {}).get(key, train.get(key))


def read_yaml(path: str | os.PathLike[str]) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{p}: file not found") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{p}:{where}: YAML syntax error: {problem}") from None


def problems(model: type[BaseModel], path: str | os.PathLike[str]) -> list[str]:
    """Every problem of a YAML file against ``model``, each naming file and field ([] when valid)."""
    try:
        data = read_yaml(path)
    except InputError as exc:
        return [str(exc)]
    if not isinstance(data, dict):
        return [f"{path}: expected a mapping at the top level, got {type(data).__name__}"]
    try:
        model.model_validate(data)
    except ValidationError as exc:
        return [problem_line(model, err, str(path)) for err in exc.errors()]
    return []


def cluster_with(cluster: ClusterConfig, source: str, **values: Any) -> ClusterConfig:
    """The cluster config with values given beside it (start_task.py's options, a run list's
    keys; None: not given), validated as the file's own fields are, errors naming ``source``."""
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return cluster
    return validate(ClusterConfig, {**cluster.model_dump(exclude_unset=True), **given}, source)


def load(model: type[M], path: str | os.PathLike[str]) -> M:
    return validate(model, read_yaml(path), str(path))
