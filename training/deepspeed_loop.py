"""The one DeepSpeed training loop, shared by every deepspeed case.

A case's trainer (training/case.py) does, per phase (a case without phases has
one, ``train``)::

    # build()
    device = deepspeed_loop.init_distributed(cfg)     # after training.runtime.setup()
    c = training.settings.from_config(cfg, world, phase)   # or the case's reader on top of it
    ds_config = deepspeed_loop.build_ds_config(c, hidden_size)
    with deepspeed_loop.model_init_context(ds_config):  # deepspeed.zero.Init under ZeRO-3
        model = build_my_model()
    deepspeed_weights.starting_weights(model, seed, rule, device)  # the same under every layout
    self.loop = deepspeed_loop.DeepSpeedPhase(
        cfg, c, model, micro_batches, ds_config=ds_config, logger=logger,
        meta={...},                                    # the case's run_meta fields
        trainable=lambda name: ...,                    # None: keep requires_grad as set
    )
    self.loop.build()                                  # engine, effective config, run_meta
    # step(k)
    self.loop.step(k)
    # finish()
    self.loop.finish()                                 # peak_memory
    deepspeed_loop.release(self.loop.result)           # or keep result.engine.module

``micro_batches`` yields dicts of CPU tensors, one per micro-batch, in order
(``grad_accum`` of them per optimizer step). Keys starting with ``num_`` are
metadata and not passed to the model; ``num_tokens`` (else
``attention_mask.sum()``) is the micro-batch's token count. The default loss is
``engine(**inputs).loss``; pass ``loss_fn(engine, inputs) -> loss`` otherwise.

Settings: the common keys of training/settings.py for the phase (steps, batch
sizes, precision, the learning-rate schedule, AdamW's values, clip_grad,
profile_step, recompute none|full: ``model.gradient_checkpointing_enable()``),
and ``parallel.zero`` (``stage`` and the ZeRO options of :data:`ZERO_KEYS`, see
:func:`zero_section`). tp and pp must be 1: ZeRO data parallelism only.

Records (``training.metriclog``), each value with ``"phase"``: ``run_meta`` and
``train_step`` from rank 0, ``peak_memory`` from every rank (``run_end`` and
``run_error`` are the driver's, training/case.py). A step's time follows the one
rule of ``training/steptimer.py``: from fetching its first micro-batch to the end
of its optimizer step, with a device synchronize and a barrier at both ends;
``data_s`` in each ``train_step`` is the fetch time within it. The token count
and the loss, summed over all data-parallel ranks, are reduced after the
step, outside its time. The DeepSpeed config the engine
resolved is written to ``cfg["output_dir"]/ds_config_<phase>.json`` and its
path is in ``run_meta["ds_config_path"]``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from training.accelerator import Accelerator
from training.metriclog import K_STEP_BREAKDOWN, MetricLogger
from training.profiling import StepProfiler
from training.runtime import allocator_options, dist_info, process_group_timeout, recorded_env, visible_devices
from training.settings import Common, Train
from training.steptimer import StepClock

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass
class PhaseResult:
    phase: str
    steps: int
    losses: list[float]
    tokens: list[int]
    step_times: list[float]
    ds_config_path: str | None
    engine: Any  # the DeepSpeed engine; ``engine.module`` is the trained model


def init_distributed(cfg: dict) -> torch.device:
    """Join the process group (the vendor's ``dist_backend``) and make this rank's device of the
    vendor's type current; DeepSpeed's accelerator (which its engine and ZeRO use) must be of
    that type too."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    vendor = cfg.get("vendor") or {}
    acc = Accelerator(vendor)
    if not vendor.get("dist_backend"):
        raise ValueError("resolved config: vendor.dist_backend is missing (the vendor's torch.distributed backend)")
    timeout = process_group_timeout()
    deepspeed.init_distributed(dist_backend=vendor["dist_backend"], **({"timeout": timeout} if timeout else {}))
    theirs = get_accelerator().device_name()
    if theirs != acc.type:
        raise RuntimeError(
            f"vendor.device is {acc.type!r} but DeepSpeed's accelerator is {theirs!r}: the vendor's adapter "
            "must make DeepSpeed use the vendor's device (its accelerator plug-in, or DS_ACCELERATOR in vendor.yaml's env)"
        )
    return acc.device(dist_info().local_rank)


ZERO_KEYS = (
    "stage",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "leaf_modules",
    "memory_efficient_linear",
    "offload_optimizer",
    "offload_param",
)
#: keys DeepSpeed reads under ZeRO-3 alone (dropped from the config below it)
STAGE3_ONLY = tuple(k for k in ZERO_KEYS if k.startswith("stage3_")) + ("leaf_modules", "memory_efficient_linear")


def zero_section(zero: dict, hidden_size: int) -> dict:
    """DeepSpeed's ``zero_optimization`` from ``parallel.zero``.

    Size keys given as null are derived from the hidden size h as DeepSpeed's
    integrations do (``reduce_bucket_size`` h*h, ``stage3_prefetch_bucket_size``
    0.9*h*h, ``stage3_param_persistence_threshold`` 10*h); ``offload_*`` are
    ``none`` or ``cpu``; the keys of :data:`STAGE3_ONLY` are dropped below stage 3.
    ``leaf_modules`` (a list of module class names; default none) makes each module of those
    classes one unit for ZeRO-3's hooks (DeepSpeed's ``leaf_module.classes``): its parameters are
    fetched and released together and its children get no hooks of their own;
    ``run_meta["zero_leaf_modules"]`` counts the modules that became such units, and a name that
    matches no module of the model is refused before the engine starts (DeepSpeed itself only warns).
    ``memory_efficient_linear`` (a boolean; DeepSpeed's default true) has ``deepspeed.zero.Init``
    replace ``torch.nn.functional.linear`` for the rest of the process by DeepSpeed's own autograd
    function (which gathers a partitioned weight again in its backward); false keeps torch's.
    """
    unknown = sorted(set(zero) - set(ZERO_KEYS))
    if unknown:
        raise ValueError(f"parallel.zero has unknown keys {unknown}; known: {', '.join(ZERO_KEYS)}")
    stage = int(zero.get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero.stage must be 0..3, got {stage}")
    derived = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    out: dict[str, Any] = {"stage": stage}
    for key in ZERO_KEYS[1:]:
        if key in STAGE3_ONLY and stage != 3 or (key not in zero and key not in derived):
            continue
        value = zero.get(key)
        if key == "leaf_modules":
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"parallel.zero.leaf_modules must be a list of module class names, got {value!r}")
            if value:
                out["leaf_module"] = {"classes": list(value)}
        elif key == "memory_efficient_linear":
            if not isinstance(value, bool):
                raise ValueError(f"parallel.zero.memory_efficient_linear must be true or false, got {value!r}")
            out[key] = value
        elif key.startswith("offload_"):
            device = str(value or "none")
            if device not in ("none", "cpu"):
                raise ValueError(f"parallel.zero.{key} must be none or cpu, got {value!r}")
            if device == "cpu":
                out[key] = {"device": "cpu", "pin_memory": True}
        elif isinstance(value, bool):
            out[key] = value
        else:
            out[key] = int(float(derived[key] if value is None else value))
    return out


def lr_at(train: Train, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to ``lr``
    (``lr * (step + 1) / lr_warmup_steps``), then cosine to ``min_lr`` at ``lr_decay_steps``."""
    lr, min_lr, warm, decay = train.lr, train.min_lr, train.lr_warmup_steps, train.lr_decay_steps
    if step < warm:
        return lr * (step + 1) / warm
    frac = min(1.0, max(0.0, (step - warm) / max(1, decay - warm)))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def build_ds_config(c: Common, hidden_size: int) -> dict:
    """The DeepSpeed config of one phase, every value from its settings.

    The optimizer is torch's AdamW (fused on accelerators) through DeepSpeed's
    ``torch_adam`` switch: no JIT-built DeepSpeed op. The schedule (:func:`lr_at`)
    is a client scheduler that :class:`DeepSpeedPhase` attaches.
    """
    tr = c.train
    if c.parallel.tp != 1 or c.parallel.pp != 1:
        raise ValueError("parallel.tp and parallel.pp must be 1: the DeepSpeed loop is ZeRO data parallel only")
    zero = zero_section(c.sections["parallel"].get("zero") or {}, hidden_size)
    extra = {"zero_force_ds_cpu_optimizer": False} if "offload_optimizer" in zero else {}  # torch's AdamW on CPU
    return {
        "train_batch_size": tr.global_batch,
        "train_micro_batch_size_per_gpu": tr.micro_batch,
        "gradient_accumulation_steps": tr.grad_accum,
        "gradient_clipping": tr.clip_grad,
        "bf16": {"enabled": tr.precision == "bf16"},
        "fp16": {"enabled": tr.precision == "fp16", "initial_scale_power": 16},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": tr.lr,
                "betas": [tr.adam_beta1, tr.adam_beta2],
                "eps": tr.adam_eps,
                "weight_decay": tr.weight_decay,
                "torch_adam": True,
                "fused": True,
            },
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **extra,
    }


def model_init_context(ds_config: dict) -> contextlib.AbstractContextManager:
    """``deepspeed.zero.Init`` under ZeRO-3 (parameters partitioned as they are made), else nothing."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=ds_config)


def _param_groups(model: torch.nn.Module) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            shape = getattr(p, "ds_shape", p.shape)
            (decay if len(shape) >= 2 else no_decay).append(p)
    return [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def effective_ds_config(engine: Any, requested: dict) -> dict:
    """The config as the engine resolved it: values read back from the engine."""
    eff = copy.deepcopy(requested)
    eff.update(
        {
            "train_batch_size": engine.train_batch_size(),
            "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "gradient_clipping": engine.gradient_clipping(),
            "bf16": {"enabled": bool(engine.bfloat16_enabled())},
            "fp16": {"enabled": bool(engine.fp16_enabled())},
            "zero_optimization": json.loads(engine._config.zero_config.model_dump_json(by_alias=True)),
            "optimizer": {
                "type": engine.optimizer_name(),
                "params": engine.optimizer_params(),
                "class": f"{type(engine.basic_optimizer).__module__}.{type(engine.basic_optimizer).__name__}",
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.basic_optimizer.param_groups],
            },
            "scheduler": {
                "type": engine.scheduler_name(),
                "params": engine.scheduler_params(),
                "class": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
                "lr_now": [g["lr"] for g in engine.basic_optimizer.param_groups],
            },
            "zero_optimization_stage": engine.zero_optimization_stage(),
            "dp_world_size": engine.dp_world_size,
            "wrapper_optimizer": type(engine.optimizer).__name__,
        }
    )
    eff["zero_optimization"]["stage"] = engine.zero_optimization_stage()
    return eff


def _default_loss(engine: Any, inputs: dict) -> torch.Tensor:
    return engine(**inputs).loss


def _count(batch: dict) -> int:
    if "num_tokens" in batch:
        return int(batch["num_tokens"])
    return int(batch["attention_mask"].sum())


def _to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    out = {}
    for k, v in batch.items():
        if k.startswith("num_"):
            continue
        if isinstance(v, torch.Tensor):
            v = v.to(device, dtype=dtype if v.is_floating_point() else None, non_blocking=True)
        out[k] = v
    return out


def _next_batch(it: Iterator[dict], step: int) -> dict:
    try:
        return next(it)
    except StopIteration:
        raise RuntimeError(
            f"the micro-batches ran out in step {step}: the case's iterator must yield steps x gradient_accumulation_steps of them"
        ) from None


@dataclasses.dataclass
class _Stepper:
    """One optimizer step: its micro-batches fetched inside the timed step (training/steptimer.py)."""

    engine: Any
    batches: Iterator[dict]
    loss_fn: Callable[[Any, dict], torch.Tensor]
    count_tokens: Callable[[dict], int]
    device: torch.device
    dtype: torch.dtype
    clock: StepClock
    prof: StepProfiler

    def run(self, step: int) -> tuple[torch.Tensor, int]:
        """This rank's summed micro-batch loss and token count of step ``step``."""
        ga = self.engine.gradient_accumulation_steps()
        total, tokens = torch.zeros((), dtype=torch.float32, device=self.device), 0
        with self.clock.step(), self.prof.step(step):
            for k in range(ga):
                batch = self.clock.fetch(lambda: _next_batch(self.batches, step))
                tokens += self.count_tokens(batch)
                loss = self.loss_fn(self.engine, _to_device(batch, self.device, self.dtype))
                self.engine.backward(loss)
                # the last micro-batch's engine.step() is the optimizer step (ZeRO's included)
                with self.prof.optimizer() if k == ga - 1 else contextlib.nullcontext():
                    self.engine.step()
                total += loss.detach().float()
        return total, tokens


def _prepare_model(model: torch.nn.Module, recompute: str, trainable: Callable[[str], bool] | None) -> None:
    """Freeze what ``trainable`` leaves out and turn on activation recompute."""
    if trainable is not None:
        for name, p in model.named_parameters():
            p.requires_grad_(bool(trainable(name)))
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif recompute != "none":
        raise ValueError(f"parallel.recompute {recompute!r} is not one of none, full")


def _initialize(
    model: torch.nn.Module, train: Train, ds_config: dict, optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None
) -> tuple[Any, list[dict], bool]:
    """The DeepSpeed engine; the trainable parameter counts of its groups; whether the
    client schedule (:func:`lr_at`) drives the learning rate."""
    import deepspeed

    groups = _param_groups(model)
    group_sizes = [
        {"weight_decay": g.get("weight_decay"), "num_params": sum(_numel(p) for p in g["params"])} for g in groups
    ]  # before DeepSpeed takes the groups over
    if ("optimizer" in ds_config) == (optimizer is not None):
        raise ValueError("give the optimizer either in ds_config or as the optimizer factory, exactly once")
    schedule = (
        None if "scheduler" in ds_config else (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(train, s) / train.lr))
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=None if optimizer else groups,
        optimizer=optimizer(groups) if optimizer else None,
        lr_scheduler=schedule,
        config=ds_config,
    )
    return engine, group_sizes, schedule is not None


def _write_effective_config(c: Common, engine: Any, ds_config: dict, group_sizes: list[dict], client_schedule: bool) -> tuple[dict, str]:
    """The config as the engine resolved it, written (by rank 0) to ``ds_config_<phase>.json``."""
    eff = effective_ds_config(engine, ds_config) | {"activation_checkpointing": c.parallel.recompute}
    default_wd = (eff["optimizer"]["params"] or {}).get("weight_decay")
    eff["optimizer"]["trainable_params_per_group"] = [
        {**g, "weight_decay": default_wd if g["weight_decay"] is None else g["weight_decay"]} for g in group_sizes
    ]
    if client_schedule:
        given = c.sections["train"]
        eff["scheduler"] |= {
            "type": "client: training.deepspeed_loop.lr_at (linear warmup, cosine decay)",
            "params": {k: given.get(k) for k in ("lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "steps")},
        }
    path = os.path.join(c.output_dir, f"ds_config_{c.phase}.json")
    if dist.get_rank() == 0:
        os.makedirs(c.output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(eff, fh, indent=2, sort_keys=True, default=str)
    return eff, path


def _run_meta(c: Common, eff: dict, meta: dict, path: str, model: torch.nn.Module, engine: Any, vendor: dict) -> dict:
    import deepspeed

    return {
        "framework": "deepspeed",
        "framework_version": deepspeed.__version__,
        "world_size": dist.get_world_size(),
        "precision": c.train.precision,
        "global_batch": eff["train_batch_size"],
        **meta,
        "phase": c.phase,
        "micro_batch": eff["train_micro_batch_size_per_gpu"],
        "grad_accum": eff["gradient_accumulation_steps"],
        "zero_stage": eff["zero_optimization_stage"],
        "recompute": eff["activation_checkpointing"],
        "ds_config_path": path,
        "steps": c.train.steps,
        "params_trainable": sum(_numel(p) for p in model.parameters() if p.requires_grad),
        "parallel": {"dp": engine.dp_world_size, "tp": 1, "pp": 1, "zero_stage": eff["zero_optimization_stage"]},
        "visible_devices": visible_devices(vendor),
        "allocator": allocator_options(vendor),
        "environment": recorded_env(vendor),
        "cpu_threads": torch.get_num_threads(),  # torch's intra-op threads in this rank
        # what nn.Linear layers called: torch's, or DeepSpeed's ZeRO-3 replacement (memory_efficient_linear)
        "functional_linear": _qualified(torch.nn.functional.linear),
        "zero_leaf_modules": leaf_modules(model),
    }


def leaf_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each class ZeRO-3 treats as one unit; empty when none is."""
    from deepspeed.utils import get_z3_leaf_modules

    return dict(Counter(type(m).__name__ for m in get_z3_leaf_modules(model)))


def check_leaf_modules(ds_config: dict, model: torch.nn.Module, phase: str) -> None:
    """Each class named in ``parallel.zero.leaf_modules`` names a module of the model, by the rule
    DeepSpeed matches with (the class's name, or its module and qualified name), checked before the
    engine starts: DeepSpeed only logs a warning for a name it does not find, and the run would go
    on hooking every module."""
    asked = ds_config["zero_optimization"].get("leaf_module", {}).get("classes", [])
    names = {n for m in model.modules() for n in (type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}")}
    missing = [name for name in asked if name not in names]
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"parallel.zero.leaf_modules: no module of class {', '.join(missing)} in the {phase} phase's model "
            f"(its classes: {', '.join(classes)})"
        )


def _qualified(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _profiler(cfg: dict, c: Common, device: torch.device) -> StepProfiler:
    multi = len((cfg.get("train") or {}).get("phases") or {}) > 1
    return StepProfiler(c.train.profile_step, c.output_dir, dist.get_rank(), device.type, tag=c.phase if multi else "")


class DeepSpeedPhase:
    """One phase trained with DeepSpeed: :meth:`build`, :meth:`step` per optimizer step,
    :meth:`finish` (the lifecycle of training/case.py; see the module docstring).

    ``optimizer``: a factory of a client optimizer from the parameter groups, for a
    ``ds_config`` without an ``optimizer`` section. The learning rate follows
    :func:`lr_at` of the phase's settings unless ``ds_config`` has a ``scheduler`` section.
    """

    def __init__(
        self,
        cfg: dict,
        c: Common,
        model: torch.nn.Module,
        micro_batches: Iterable[dict],
        *,
        ds_config: dict,
        logger: MetricLogger,
        meta: dict,
        trainable: Callable[[str], bool] | None = None,
        loss_fn: Callable[[Any, dict], torch.Tensor] | None = None,
        count_tokens: Callable[[dict], int] | None = None,
        optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
    ):
        self.cfg, self.c, self.model, self.micro_batches = cfg, c, model, micro_batches
        self.ds_config, self.logger, self.meta = ds_config, logger, meta
        self.trainable, self.optimizer = trainable, optimizer
        self.loss_fn, self.count_tokens = loss_fn or _default_loss, count_tokens or _count
        self.steps = c.train.steps
        self.acc = Accelerator(cfg.get("vendor") or {})  # training/accelerator.py: vendor.device's calls
        self.result: PhaseResult | None = None

    def build(self) -> None:
        """Freeze and recompute as set, start the engine, write its effective config,
        send ``run_meta``; the allocator's peak is reset after."""
        c = self.c
        _prepare_model(self.model, c.parallel.recompute, self.trainable)
        check_leaf_modules(self.ds_config, self.model, c.phase)
        engine, group_sizes, client_schedule = _initialize(self.model, c.train, self.ds_config, self.optimizer)
        self.device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
        eff, path = _write_effective_config(c, engine, self.ds_config, group_sizes, client_schedule)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.rank == 0:
            self.logger.meta(**_run_meta(c, eff, self.meta, path, self.model, engine, self.cfg.get("vendor") or {}))
        self.acc.reset_peak(self.device)
        self.result = PhaseResult(c.phase, 0, [], [], [], path if self.rank == 0 else None, engine)
        self.stepper = _Stepper(
            engine,
            iter(self.micro_batches),
            self.loss_fn,
            self.count_tokens,
            self.device,
            DTYPES[c.train.precision],
            StepClock(self._sync),
            _profiler(self.cfg, c, self.device),
        )
        engine.train()

    def _sync(self) -> None:
        self.acc.synchronize(self.device)
        dist.barrier()

    def step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based), timed by the clock; its sums over the ranks taken
        after it, outside its time; rank 0 sends the ``train_step``."""
        stepper, result, phase = self.stepper, self.result, self.c.phase
        engine = stepper.engine
        lr = float(engine.get_lr()[0])
        total, local_tokens = stepper.run(step)
        dt = stepper.clock.step_time_s
        parts = stepper.prof.result(step, dt, reduce=self.rank == 0)
        if parts is not None:
            self.logger.info(K_STEP_BREAKDOWN, {**parts, "pp_rank": 0}, phase=phase)
        tokens = torch.tensor([local_tokens], dtype=torch.int64, device=stepper.device)
        dist.all_reduce(tokens)
        total /= engine.gradient_accumulation_steps() * self.world
        dist.all_reduce(total)
        result.steps, value = step, float(total)
        result.losses.append(value), result.tokens.append(int(tokens)), result.step_times.append(dt)
        if self.rank == 0:
            norm = engine.get_global_grad_norm()
            self.logger.step(
                step,
                value,
                int(tokens),
                dt,
                lr,
                phase=phase,
                data_s=stepper.clock.data_s,
                grad_norm=None if norm is None else float(norm),
                **({"profiled": True} if step == self.c.train.profile_step else {}),
            )

    def finish(self) -> None:
        """Every rank's ``peak_memory`` (on the CPU: the process's resident peak since it
        started, not the phase's, against the host's memory)."""
        peak, total, name = self.acc.memory(self.device)
        self.logger.peak_memory(
            peak,
            total,
            name,
            phase=self.c.phase,
            reserved_bytes=self.acc.max_reserved(self.device),
            alloc_retries=self.acc.alloc_retries(self.device),
        )


def release(result: PhaseResult | None, device: torch.device | None = None) -> None:
    """Drop an engine (and the optimizer state it holds) and return its memory to the device
    (the engine's, else ``device``)."""
    if result is not None and result.engine is not None:
        engine = result.engine
        device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
        if hasattr(engine, "destroy"):
            engine.destroy()
        result.engine = engine = None
    gc.collect()
    if device is not None:
        Accelerator.of(device).empty_cache()
