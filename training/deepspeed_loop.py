"""The one DeepSpeed training loop, shared by every deepspeed case.

A case's ``train.py`` does, per phase (a case without phases has one, ``train``)::

    cfg = training.runtime.setup()                    # before deepspeed is imported
    device = deepspeed_loop.init_distributed(cfg)
    settings = deepspeed_loop.phase_settings(cfg, phase)
    ds_config = deepspeed_loop.build_ds_config(settings, device)
    with deepspeed_loop.model_init_context(ds_config):  # deepspeed.zero.Init under ZeRO-3
        model = build_my_model()
    deepspeed_weights.starting_weights(model, seed, rule, device)  # the same under every layout
    result = deepspeed_loop.run_phase(
        cfg, phase, model, micro_batches, ds_config=ds_config, logger=logger,
        trainable=lambda name: ...,                    # None: keep requires_grad as set
        meta={...},                                    # the case's run_meta fields
    )
    deepspeed_loop.release(result)                     # or keep result.engine.module

``micro_batches`` yields dicts of CPU tensors, one per micro-batch, in order
(``grad_accum`` of them per optimizer step). Keys starting with ``num_`` are
metadata and not passed to the model; ``num_tokens`` (else
``attention_mask.sum()``) is the micro-batch's token count. The default loss is
``engine(**inputs).loss``; pass ``loss_fn(engine, inputs) -> loss`` otherwise.

Settings read (``phase_settings``: each section ``cfg[section]`` overlaid with
its ``cfg[section]["phases"][phase]``, as case.yaml's ``standard`` writes them):

``train``: steps, global_batch, micro_batch, precision (bf16|fp16|fp32), lr,
min_lr, lr_warmup_steps, lr_decay_steps (default: steps), weight_decay,
clip_grad, adam_beta1, adam_beta2 (or betas), adam_eps (default 1e-8),
gradient_accumulation_steps (optional; must equal global_batch / (micro_batch x dp)),
profile_step (optional; K > 0 profiles step K, see training/profiling.py).
``parallel``: tp = pp = 1, recompute (none|full: ``model.gradient_checkpointing_enable()``),
zero (``stage`` and the ZeRO options of :data:`ZERO_KEYS`, see :func:`zero_section`).

Records (``training.metriclog``), each value with ``"phase"``: ``run_meta`` and
``train_step`` from rank 0, ``peak_memory`` from every rank, ``run_end`` (and
``run_error`` on failure) from rank 0. A step's time follows the one rule of
``training/steptimer.py``: from fetching its first micro-batch to the end of
its optimizer step, with a device synchronize and a barrier at both ends;
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
import resource
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from training.metriclog import EV_END, EV_ERROR, EV_INFO, EV_MEMORY, K_PEAK_MEMORY, K_RUN_END, K_RUN_ERROR, K_STEP_BREAKDOWN, MetricLogger
from training.profiling import StepProfiler
from training.steptimer import StepClock
from training.runtime import dist_info

SECTIONS = ("train", "parallel", "data")
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


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def phase_settings(cfg: dict, phase: str) -> dict[str, dict]:
    """``{"train", "parallel", "data"}`` of one phase: each section of the resolved
    config overlaid with its ``phases.<phase>`` entry (which is then dropped)."""
    out = {}
    for s in SECTIONS:
        sec = dict(cfg.get(s) or {})
        over = (sec.pop("phases", None) or {}).get(phase) or {}
        out[s] = _merge(sec, over)
    return out


def init_distributed(cfg: dict) -> torch.device:
    """Join the process group (the vendor's backend) and pick this rank's device."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=cfg["vendor"]["dist_backend"])
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    local = dist_info().local_rank
    acc.set_device(local)
    return torch.device(acc.device_name(local))


def grad_accum_steps(train: dict, dp: int) -> int:
    micro, gbs = int(train["micro_batch"]), int(train["global_batch"])
    if micro < 1 or gbs % (micro * dp):
        raise ValueError(f"train.global_batch {gbs} is not a multiple of train.micro_batch {micro} x dp {dp}: "
                         "change micro_batch in the vendor config or the number of processes")
    ga = gbs // (micro * dp)
    if train.get("gradient_accumulation_steps") not in (None, ga):
        raise ValueError(f"train.gradient_accumulation_steps {train['gradient_accumulation_steps']} != global_batch "
                         f"{gbs} / (micro_batch {micro} x dp {dp}) = {ga}: the global batch is fixed")
    return ga


ZERO_KEYS = ("stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
             "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
             "stage3_max_live_parameters", "stage3_max_reuse_distance", "offload_optimizer", "offload_param")


def zero_section(zero: dict, hidden_size: int) -> dict:
    """DeepSpeed's ``zero_optimization`` from ``parallel.zero``.

    Size keys given as null are derived from the hidden size h as DeepSpeed's
    integrations do (``reduce_bucket_size`` h*h, ``stage3_prefetch_bucket_size``
    0.9*h*h, ``stage3_param_persistence_threshold`` 10*h); ``offload_*`` are
    ``none`` or ``cpu``; stage-3 keys are dropped below stage 3.
    """
    unknown = sorted(set(zero) - set(ZERO_KEYS))
    if unknown:
        raise ValueError(f"parallel.zero has unknown keys {unknown}; known: {', '.join(ZERO_KEYS)}")
    stage = int(zero.get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero.stage must be 0..3, got {stage}")
    derived = {"reduce_bucket_size": hidden_size * hidden_size,
               "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
               "stage3_param_persistence_threshold": 10 * hidden_size}
    out: dict[str, Any] = {"stage": stage}
    for key in ZERO_KEYS[1:]:
        if key.startswith("stage3_") and stage != 3 or (key not in zero and key not in derived):
            continue
        value = zero.get(key)
        if key.startswith("offload_"):
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


def lr_at(train: dict, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to ``lr``
    (``lr * (step + 1) / lr_warmup_steps``), then cosine to ``min_lr`` at ``lr_decay_steps``."""
    lr, min_lr = float(train["lr"]), float(train.get("min_lr", 0.0) or 0.0)
    warm = int(train.get("lr_warmup_steps", 0) or 0)
    decay = int(train.get("lr_decay_steps") or train["steps"])
    if step < warm:
        return lr * (step + 1) / warm
    frac = min(1.0, max(0.0, (step - warm) / max(1, decay - warm)))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def build_ds_config(settings: dict, hidden_size: int, world_size: int | None = None) -> dict:
    """The DeepSpeed config of one phase, every value from its settings.

    The optimizer is torch's AdamW (fused on accelerators) through DeepSpeed's
    ``torch_adam`` switch: no JIT-built DeepSpeed op. The schedule (:func:`lr_at`)
    is a client scheduler that :func:`run_phase` attaches.
    """
    tr, par = settings["train"], settings["parallel"]
    dp = world_size or (dist.get_world_size() if dist.is_initialized() else dist_info().world_size)
    precision = tr.get("precision", "bf16")
    if precision not in DTYPES:
        raise ValueError(f"train.precision {precision!r} is not one of {sorted(DTYPES)}")
    if int(par.get("tp", 1) or 1) != 1 or int(par.get("pp", 1) or 1) != 1:
        raise ValueError("parallel.tp and parallel.pp must be 1: the DeepSpeed loop is ZeRO data parallel only")
    betas = tr.get("betas") or [tr.get("adam_beta1", 0.9), tr.get("adam_beta2", 0.999)]
    zero = zero_section(par.get("zero") or {}, hidden_size)
    extra = {"zero_force_ds_cpu_optimizer": False} if "offload_optimizer" in zero else {}  # torch's AdamW on CPU
    return {
        "train_batch_size": int(tr["global_batch"]),
        "train_micro_batch_size_per_gpu": int(tr["micro_batch"]),
        "gradient_accumulation_steps": grad_accum_steps(tr, dp),
        "gradient_clipping": float(tr.get("clip_grad", 0.0) or 0.0),
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(tr["lr"]), "betas": [float(b) for b in betas], "eps": float(tr.get("adam_eps", 1e-8)),
            "weight_decay": float(tr.get("weight_decay", 0.0) or 0.0), "torch_adam": True, "fused": True}},
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
    eff.update({
        "train_batch_size": engine.train_batch_size(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "gradient_clipping": engine.gradient_clipping(),
        "bf16": {"enabled": bool(engine.bfloat16_enabled())},
        "fp16": {"enabled": bool(engine.fp16_enabled())},
        "zero_optimization": json.loads(engine._config.zero_config.model_dump_json(by_alias=True)),
        "optimizer": {"type": engine.optimizer_name(), "params": engine.optimizer_params(),
                      "class": f"{type(engine.basic_optimizer).__module__}.{type(engine.basic_optimizer).__name__}",
                      "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                       for g in engine.basic_optimizer.param_groups]},
        "scheduler": {"type": engine.scheduler_name(), "params": engine.scheduler_params(),
                      "class": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
                      "lr_now": [g["lr"] for g in engine.basic_optimizer.param_groups]},
        "zero_optimization_stage": engine.zero_optimization_stage(),
        "dp_world_size": engine.dp_world_size,
        "wrapper_optimizer": type(engine.optimizer).__name__,
    })
    eff["zero_optimization"]["stage"] = engine.zero_optimization_stage()
    return eff


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()
    dist.barrier()


def _memory(device: torch.device) -> tuple[int, int | None]:
    if device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        return int(acc.max_memory_allocated(device.index)), int(acc.total_memory(device.index))
    # CPU: the process's resident peak (since process start, not per phase)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, int(total)


def _device_name(device: torch.device) -> str:
    """The device as its driver names it (the harness checks it against the case's chip)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


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
        raise RuntimeError(f"the micro-batches ran out in step {step}: the case's iterator must yield "
                           "steps x gradient_accumulation_steps of them") from None


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


def _initialize(model: torch.nn.Module, train: dict, ds_config: dict,
                optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None) -> tuple[Any, list[dict], bool]:
    """The DeepSpeed engine; the trainable parameter counts of its groups; whether the
    client schedule (:func:`lr_at`) drives the learning rate."""
    import deepspeed

    groups = _param_groups(model)
    group_sizes = [{"weight_decay": g.get("weight_decay"), "num_params": sum(_numel(p) for p in g["params"])}
                   for g in groups]  # before DeepSpeed takes the groups over
    if ("optimizer" in ds_config) == (optimizer is not None):
        raise ValueError("give the optimizer either in ds_config or as the optimizer factory, exactly once")
    schedule = None if "scheduler" in ds_config else (
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(train, s) / float(train["lr"])))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=None if optimizer else groups,
                                           optimizer=optimizer(groups) if optimizer else None,
                                           lr_scheduler=schedule, config=ds_config)
    return engine, group_sizes, schedule is not None


def _write_effective_config(cfg: dict, phase: str, engine: Any, ds_config: dict, train: dict, recompute: str,
                            group_sizes: list[dict], client_schedule: bool) -> tuple[dict, str]:
    """The config as the engine resolved it, written (by rank 0) to ``ds_config_<phase>.json``."""
    eff = effective_ds_config(engine, ds_config) | {"activation_checkpointing": recompute}
    default_wd = (eff["optimizer"]["params"] or {}).get("weight_decay")
    eff["optimizer"]["trainable_params_per_group"] = [
        {**g, "weight_decay": default_wd if g["weight_decay"] is None else g["weight_decay"]} for g in group_sizes]
    if client_schedule:
        eff["scheduler"] |= {"type": "client: training.deepspeed_loop.lr_at (linear warmup, cosine decay)",
                             "params": {k: train.get(k) for k in ("lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                                                                 "steps")}}
    path = os.path.join(cfg["output_dir"], f"ds_config_{phase}.json")
    if dist.get_rank() == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(eff, fh, indent=2, sort_keys=True, default=str)
    return eff, path


def _run_meta(phase: str, settings: dict, eff: dict, meta: dict, path: str, model: torch.nn.Module,
              engine: Any) -> dict:
    import deepspeed

    tr = settings["train"]
    return {
        "framework": "deepspeed", "framework_version": deepspeed.__version__,
        "world_size": dist.get_world_size(), "precision": tr.get("precision", "bf16"),
        "global_batch": eff["train_batch_size"],
        **meta,
        "phase": phase, "micro_batch": eff["train_micro_batch_size_per_gpu"],
        "grad_accum": eff["gradient_accumulation_steps"], "zero_stage": eff["zero_optimization_stage"],
        "recompute": eff["activation_checkpointing"], "ds_config_path": path, "steps": int(tr["steps"]),
        "params_trainable": sum(_numel(p) for p in model.parameters() if p.requires_grad),
        "parallel": {"dp": engine.dp_world_size, "tp": 1, "pp": 1, "zero_stage": eff["zero_optimization_stage"]},
    }


def _profiler(cfg: dict, phase: str, steps: int, profile_step: int, device: torch.device) -> StepProfiler:
    if not 0 <= profile_step <= steps:
        raise ValueError(f"train.profile_step = {profile_step} is not a step of the phase's {steps} steps")
    multi = len((cfg.get("train") or {}).get("phases") or {}) > 1
    return StepProfiler(profile_step, cfg.get("output_dir"), dist.get_rank(), device.type, tag=phase if multi else "")


def _train(stepper: _Stepper, result: PhaseResult, steps: int, profile_step: int, logger: MetricLogger) -> None:
    """The step loop: each step timed by the clock, its sums over the ranks taken after it."""
    engine, phase, rank = stepper.engine, result.phase, dist.get_rank()
    ga, world = engine.gradient_accumulation_steps(), dist.get_world_size()
    engine.train()
    for step in range(1, steps + 1):
        lr = float(engine.get_lr()[0])
        total, local_tokens = stepper.run(step)
        dt = stepper.clock.step_time_s
        parts = stepper.prof.result(step, dt, reduce=rank == 0)
        if parts is not None:
            logger.emit(EV_INFO, K_STEP_BREAKDOWN, {**parts, "phase": phase, "pp_rank": 0})
        # outside the timed step: the tokens and the mean loss over all ranks, for the record
        tokens = torch.tensor([local_tokens], dtype=torch.int64, device=stepper.device)
        dist.all_reduce(tokens)
        total /= ga * world
        dist.all_reduce(total)
        result.steps, value = step, float(total)
        result.losses.append(value), result.tokens.append(int(tokens)), result.step_times.append(dt)
        if rank == 0:
            norm = engine.get_global_grad_norm()
            logger.step(step, value, int(tokens), dt, lr, phase=phase, data_s=stepper.clock.data_s,
                        grad_norm=None if norm is None else float(norm),
                        **({"profiled": True} if step == profile_step else {}))


def _end_records(logger: MetricLogger, device: torch.device, phase: str, steps: int) -> None:
    peak, total_mem = _memory(device)
    logger.emit(EV_MEMORY, K_PEAK_MEMORY, {"peak_bytes": peak, "total_bytes": total_mem,
                                          "device": _device_name(device), "phase": phase})
    if dist.get_rank() == 0:
        logger.emit(EV_END, K_RUN_END, {"status": "ok", "steps": steps, "phase": phase})


def run_phase(cfg: dict, phase: str, model: torch.nn.Module, micro_batches: Iterable[dict], *, ds_config: dict,
              logger: MetricLogger, meta: dict, trainable: Callable[[str], bool] | None = None,
              loss_fn: Callable[[Any, dict], torch.Tensor] | None = None,
              count_tokens: Callable[[dict], int] | None = None,
              optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None) -> PhaseResult:
    """Train one phase with DeepSpeed and emit its records. See the module docstring.

    ``optimizer``: a factory of a client optimizer from the parameter groups,
    for a ``ds_config`` without an ``optimizer`` section. The learning rate
    follows :func:`lr_at` of the phase's ``train`` settings unless
    ``ds_config`` has a ``scheduler`` section.
    """
    settings = phase_settings(cfg, phase)
    tr = settings["train"]
    steps, profile_step = int(tr["steps"]), int(tr.get("profile_step") or 0)
    recompute = settings["parallel"].get("recompute", "none")
    try:
        _prepare_model(model, recompute, trainable)
        engine, group_sizes, client_schedule = _initialize(model, tr, ds_config, optimizer)
        device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
        eff, path = _write_effective_config(cfg, phase, engine, ds_config, tr, recompute, group_sizes, client_schedule)
        if dist.get_rank() == 0:
            logger.meta(**_run_meta(phase, settings, eff, meta, path, model, engine))
        if device.type != "cpu":
            from deepspeed.accelerator import get_accelerator

            get_accelerator().reset_peak_memory_stats(device.index)
        result = PhaseResult(phase, 0, [], [], [], path if dist.get_rank() == 0 else None, engine)
        stepper = _Stepper(engine, iter(micro_batches), loss_fn or _default_loss, count_tokens or _count, device,
                           DTYPES[tr.get("precision", "bf16")], StepClock(lambda: _sync(device)),
                           _profiler(cfg, phase, steps, profile_step, device))
        _train(stepper, result, steps, profile_step, logger)
        _end_records(logger, device, phase, steps)
        return result
    except Exception as exc:
        logger.emit(EV_ERROR, K_RUN_ERROR, {"message": f"{phase}: {type(exc).__name__}: {exc}", "phase": phase})
        logger.emit(EV_END, K_RUN_END, {"status": "failed", "steps": 0, "phase": phase})
        raise


def release(result: PhaseResult | None) -> None:
    """Drop an engine (and the optimizer state it holds) and return its memory."""
    if result is not None and result.engine is not None:
        if hasattr(result.engine, "destroy"):
            result.engine.destroy()
        result.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
