"""The paddle training loop every paddle case shares (as training/deepspeed_loop.py is
DeepSpeed's and training/megatron_loop.py megatron-core's): one phase on training/case.py's
lifecycle under paddle's hybrid-parallel fleet, the case supplying its model, data and settings.

A case subclasses :class:`PaddleTrainer` and gives:

``read_settings(cfg, world_size)``  its settings (``.common``: training/settings.py's Common;
                                    ``.shape``, whose fields run_meta reports; ``.device``:
                                    paddle's name of the vendor's device)
``layout()``                        a :class:`Layout`: the fleet's degrees, sharding stage, micro
                                    batch and accumulation, AMP level and loss scale
``build_model()``                   the model with its starting weights (the same under every
                                    layout), before AMP and the parallel wrappers
``make_batches()``                  an object whose ``micro_batches(step)`` (0-based) gives the
                                    step's ``(inputs, labels)`` arrays per micro-batch and, for a
                                    pipeline, ``step(step)`` the step's rows; and run_meta's ``data``
``scheduler()``                     paddle's learning-rate schedule of the train settings
``decays(name, parameter_name)``    whether a parameter (its name in the model) takes weight decay
``forward(x, y)``                   a micro-batch's loss
``meta()``, ``parallel_meta()``     its own run_meta fields (over the loop's), and those of
                                    ``parallel`` beyond tp, pp, dp, micro_batch, grad_accum

and may change ``setup()`` (after the settings and the device), ``measure_ceiling()`` (training/ceiling.py's kernel ceiling and the timers whose
peak to restart, None without one), ``autocast()`` (paddle's AMP context),
``local_param_count(model)`` and ``expected_params()``.

The loop writes the rest once: the device, the fleet's hybrid topology, the seeds (a model-
parallel stream per tensor-parallel rank and stage, a data stream per data rank and stage, one
per rank), AdamW with global-norm clipping, AMP O2's decoration and the fp16 loss scale, the
wrappers of each layout (pipeline, sharding stage 2, data or tensor parallel, sharding stage
1), ``run_meta``, each step timed by training/steptimer.py (batch fetch inside, device
synchronize and barrier at both ends), the loss averaged over the data ranks, ``train_step``,
``peak_memory``, and :func:`main`, a case's entry point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from training import case, runtime
from training.metriclog import K_KERNEL_CEILING, MetricLogger

AMP_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the loop needs of a case's parallel layout and precision, in paddle's terms."""

    tp: int
    pp: int
    dp_degree: int  # plain data-parallel replicas
    sharding_degree: int  # sharded replicas (dp = dp_degree * sharding_degree)
    sharding_stage: int  # 0, 1 (optimizer states: DygraphShardingOptimizer) or 2 (and gradients)
    micro_batch: int
    grad_accum: int
    amp_level: str = "O1"  # with bf16 or fp16: O1 (autocast) or O2 (the weights in low precision)
    loss_scale: float | None = None  # fp16's initial loss scale

    @property
    def dp(self) -> int:
        return self.dp_degree * self.sharding_degree


def data_parallel(world_size: int, micro_batch: int, grad_accum: int) -> Layout:
    """The layout of a data-parallel-only case."""
    return Layout(tp=1, pp=1, dp_degree=world_size, sharding_degree=1, sharding_stage=0, micro_batch=micro_batch, grad_accum=grad_accum)


def device_module(device: str) -> Any:
    """paddle's module of a device's memory and property calls (``device``: paddle's name):
    ``paddle.device.cuda`` for gpu, else ``paddle.device``'s own, which answer for the build's
    xpu or custom device."""
    import paddle

    return paddle.device.cuda if device == "gpu" else paddle.device


class PaddleTrainer(case.LoopHooks):
    """One phase of a paddle case (the module docstring says what a case gives)."""

    def __init__(self, cfg: dict[str, Any], log: MetricLogger, phase: str | None = None):
        self.cfg, self.log, self.phase = cfg, log, phase
        self.dist = runtime.dist_info()
        self.steps = 0
        self.reporting = self.dist.rank == 0  # until the topology is known

    # -- what a case gives (beyond case.LoopHooks) ---------------------------
    def layout(self) -> Layout:
        raise NotImplementedError

    def scheduler(self) -> Any:
        raise NotImplementedError

    def decays(self, name: str, parameter_name: str) -> bool:
        raise NotImplementedError

    def forward(self, x: Any, y: Any) -> Any:
        raise NotImplementedError

    def setup(self) -> None:
        """After the settings and the device, before anything is measured or built."""

    def measure_ceiling(self) -> tuple[dict[str, Any], Any] | None:
        return None

    def local_param_count(self, model: Any) -> int:
        return sum(int(p.numel()) for p in model.parameters())

    def autocast(self) -> Any:
        import paddle

        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(enable=True, level=self.lay.amp_level, dtype=self.amp_dtype)

    # -- the loop ------------------------------------------------------------
    def build(self) -> None:
        """Settings, device, ceiling, process groups, model and optimizer, data; ``run_meta``."""
        import paddle

        from training.steptimer import StepClock

        self.s = self.read_settings(self.cfg, self.dist.world_size)
        self.lay = self.layout()
        self.place = "cpu" if self.s.device == "cpu" else f"{self.s.device}:{self.dist.local_rank}"
        paddle.set_device(self.place)
        self.setup()
        # the kernel ceiling, on every rank's device at once, before the seeds and the model
        measured = self.measure_ceiling()
        self.kernel_ceiling = None
        if measured is not None:
            self.kernel_ceiling, timers = measured
            timers.reset_peak()
        self.clock = StepClock(self.barrier)  # training/steptimer.py: the one timing rule
        self.init_distributed()
        self.amp_dtype = AMP_DTYPES.get(self.s.common.train.precision)
        model = self.build_model()
        self.params_exact = self._exact_params(model)
        self._optimizer(model)
        self.batches, self.data_desc = self.make_batches()
        self._emit_meta()
        self.steps = self.s.common.train.steps
        self.tokens_per_step = self.s.common.train.global_batch * self.s.shape.seq_length
        self.run_step = self._step_pipeline if self.lay.pp > 1 else self._step_nonpipeline

    def init_distributed(self) -> None:
        """paddle's fleet with the layout's hybrid topology, the ranks' places in it, and the
        seeds: the parameters drawn while the model is built are overwritten by its starting
        weights; dropout streams are shared inside a tensor-parallel group ("global_seed") or
        the rank's own ("local_seed")."""
        import paddle
        from paddle.distributed import fleet
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        lay, seed = self.lay, self.s.common.train.seed
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {
            "dp_degree": lay.dp_degree,
            "mp_degree": lay.tp,
            "pp_degree": lay.pp,
            "sharding_degree": lay.sharding_degree,
        }
        if lay.pp > 1:
            strategy.pipeline_configs = {"accumulate_steps": lay.grad_accum, "micro_batch_size": lay.micro_batch}
        fleet.init(is_collective=True, strategy=strategy)
        hcg = fleet.get_hybrid_communicate_group()
        self.hcg = hcg
        self.tp_rank = hcg.get_model_parallel_rank()
        self.stage = hcg.get_stage_id()
        self.dp_rank = hcg.get_data_parallel_rank()
        self.sharding_rank = hcg.get_sharding_parallel_rank()
        self.data_rank = lay.sharding_degree * self.dp_rank + self.sharding_rank
        self.is_last_stage = self.stage == lay.pp - 1
        self.reporting = self.is_last_stage and self.tp_rank == 0 and self.data_rank == 0
        paddle.seed(seed)
        tracker = get_rng_state_tracker()
        tracker.reset()
        tracker.add("model_parallel_rng", seed + 1 + self.tp_rank * lay.pp + self.stage)
        tracker.add("global_seed", seed + 100_003 + self.data_rank * lay.pp + self.stage)
        tracker.add("local_seed", seed + 200_003 + self.dist.rank)

    def sync_device(self) -> None:
        import paddle

        if self.s.device != "cpu":
            paddle.device.synchronize()

    def barrier(self) -> None:
        import paddle.distributed as dist

        self.sync_device()
        if self.dist.world_size > 1:
            dist.barrier()

    def timed_weights(self, draw: Callable[[], Any]) -> Any:
        """``draw()`` (a case's starting weights), its time on this rank sent as an
        ``init_weights`` info line (no barrier inside: ranks finish their models at different
        times); returns what it returned."""
        t0 = time.perf_counter()
        tensors = draw()
        self.sync_device()
        self.log.info("init_weights", {"seconds": round(time.perf_counter() - t0, 4), "tensors": tensors})
        return tensors

    def _exact_params(self, model: Any) -> int:
        import paddle
        import paddle.distributed as dist

        t = paddle.to_tensor([float(self.local_param_count(model))], dtype="float64")
        if self.dist.world_size > 1:
            dist.all_reduce(t)  # every data-parallel replica adds the same count
        total = int(round(float(t.numpy()[0]))) // self.lay.dp
        expected = self.expected_params()
        if total != expected:
            raise RuntimeError(
                f"the built model has {total} parameters but training.flops.param_counts gives {expected} "
                f"for {self.s.shape}: the model does not have the shape the case declares"
            )
        return total

    def _optimizer(self, model: Any) -> None:
        """AdamW (decoupled weight decay where the case says, global-norm clipping) on the
        case's schedule, AMP O2's decoration, fp16's loss scaler, and the layout's wrappers."""
        import paddle
        from paddle.distributed import fleet

        tr, lay = self.s.common.train, self.lay
        self.lr_scheduler = self.scheduler()
        decay = {p.name for n, p in model.named_parameters() if self.decays(n, p.name)}
        o2 = self.amp_dtype is not None and lay.amp_level == "O2"
        optimizer = paddle.optimizer.AdamW(
            learning_rate=self.lr_scheduler,
            beta1=tr.adam_beta1,
            beta2=tr.adam_beta2,
            epsilon=tr.adam_eps,
            parameters=model.parameters(),
            weight_decay=tr.weight_decay,
            apply_decay_param_fun=lambda name: name in decay,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(tr.clip_grad) if tr.clip_grad > 0 else None,
            multi_precision=o2,
        )
        if o2:
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=self.amp_dtype)
        self.scaler = None
        if tr.precision == "fp16":
            if lay.loss_scale is None:
                raise RuntimeError("train.precision fp16 needs the layout's loss_scale (paddle's GradScaler)")
            self.scaler = paddle.amp.GradScaler(init_loss_scaling=lay.loss_scale)
        self.no_sync = False
        if lay.pp > 1:
            model = fleet.distributed_model(model)
            optimizer = fleet.distributed_optimizer(optimizer)
            if self.scaler is not None:
                self.scaler = fleet.distributed_scaler(self.scaler)
        elif lay.sharding_stage == 2:
            from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedScaler
            from paddle.distributed.sharding import group_sharded_parallel

            if lay.tp > 1:
                model = fleet.meta_parallel.TensorParallel(model, self.hcg, strategy=None)
            model, optimizer, _ = group_sharded_parallel(
                model,
                optimizer,
                level="os_g",
                scaler=None,
                group=self.hcg.get_sharding_parallel_group(),
                dp_group=self.hcg.get_data_parallel_group() if lay.dp_degree > 1 else None,
            )
            if self.scaler is not None:
                self.scaler = GroupShardedScaler(self.scaler)
        elif self.dist.world_size > 1:
            model = fleet.distributed_model(model)  # DataParallel or TensorParallel
            optimizer = fleet.distributed_optimizer(optimizer)  # sharding stage 1 when sharding_degree > 1
            if self.scaler is not None and (lay.tp > 1 or lay.sharding_stage == 1):
                self.scaler = fleet.distributed_scaler(self.scaler)
            self.no_sync = isinstance(model, paddle.DataParallel)
        self.model, self.optimizer = model, optimizer

    def _emit_meta(self) -> None:
        import paddle

        if not self.reporting:
            return
        c, sh, lay = self.s.common, self.s.shape, self.lay
        vendor = self.cfg.get("vendor") or {}
        fields = dict(
            model=c.model_name,
            framework="paddle",
            framework_version=str(paddle.__version__),
            params_exact=self.params_exact,
            params_nominal=c.params_nominal,
            num_layers=sh.num_layers,
            hidden_size=sh.hidden_size,
            ffn_hidden_size=sh.ffn_hidden_size,
            num_heads=sh.num_heads,
            num_kv_groups=sh.num_heads,  # multi-head attention; a case with groups says so in meta()
            seq_length=sh.seq_length,
            vocab_size=sh.vocab_size,
            global_batch=c.train.global_batch,
            precision=c.train.precision,
            parallel={
                "tp": lay.tp,
                "pp": lay.pp,
                "dp": lay.dp,
                "micro_batch": lay.micro_batch,
                "grad_accum": lay.grad_accum,
                **self.parallel_meta(),
            },
            world_size=c.world_size,
            steps=c.train.steps,
            config_name=c.config_name,
            device=self.s.device,
            visible_devices=runtime.visible_devices(vendor),
            environment=runtime.recorded_env(vendor),
            data=self.data_desc,
            **({K_KERNEL_CEILING: self.kernel_ceiling} if self.kernel_ceiling is not None else {}),
        )
        self.log.meta(**{**fields, **self.meta()})

    def _step_nonpipeline(self, step: int) -> Any:
        import paddle

        micro = self.clock.fetch(lambda: [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in self.batches.micro_batches(step)])
        total = None
        for a, (x, y) in enumerate(micro):
            sync_ctx = self.model.no_sync() if self.no_sync and a < len(micro) - 1 else contextlib.nullcontext()
            with sync_ctx:
                with self.autocast():
                    loss = self.forward(x, y)
                scaled = loss / len(micro)
                if self.scaler is not None:
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.clear_grad()
        return total / len(micro)

    def _step_pipeline(self, step: int) -> Any:
        import paddle

        def fetch() -> list:
            rows = self.batches.step(step)
            return [paddle.to_tensor(rows[:, :-1]), paddle.to_tensor(rows[:, 1:])]

        data = self.clock.fetch(fetch)
        with self.autocast():
            return self.model.train_batch(data, optimizer=self.optimizer, lr_scheduler=None, scaler=self.scaler)

    def _data_mean(self, loss: Any) -> float:
        import paddle
        import paddle.distributed as dist

        lay = self.lay
        t = paddle.cast(loss.reshape([1]), "float32")
        if lay.dp_degree > 1:
            dist.all_reduce(t, group=self.hcg.get_data_parallel_group())
        if lay.sharding_degree > 1:
            dist.all_reduce(t, group=self.hcg.get_sharding_parallel_group())
        return float(t.numpy()[0]) / lay.dp

    def step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based)."""
        lr = float(self.lr_scheduler.get_lr())
        with self.clock.step():  # from the batch fetch to the end of the optimizer step
            loss = self.run_step(step - 1)
            self.lr_scheduler.step()
        mean = self._data_mean(loss)  # outside the timed window
        if self.reporting:
            extra = {}
            if self.scaler is not None:
                extra["loss_scale"] = float(self.scaler._scale.numpy().reshape(-1)[0])
            self.log.step(step, mean, self.tokens_per_step, self.clock.step_time_s, lr, data_s=self.clock.data_s, **extra)

    def finish(self) -> None:
        """``peak_memory`` of this rank (and the allocator's reserve on an accelerator)."""
        reserved = None if self.s.device == "cpu" else int(device_module(self.s.device).max_memory_reserved(self.place))
        self.log.peak_memory(*self._memory(), reserved_bytes=reserved)

    def _memory(self) -> tuple[int, int | None, str]:
        """(peak allocated bytes, the device's total or None, its name): the vendor's
        ``memory_query`` (called with paddle's place string, e.g. ``npu:0``) where it has one."""
        spec = (self.cfg.get("vendor") or {}).get("memory_query")
        if spec:
            module, _, func = str(spec).partition(":")
            peak, total, name = getattr(importlib.import_module(module), func)(self.place)
            return int(peak), None if total is None else int(total), str(name)
        if self.s.device == "cpu":  # ru_maxrss is in KiB on Linux: the process's peak resident set
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, None, "cpu"
        mod = device_module(self.s.device)
        props = mod.get_device_properties(self.place)
        return int(mod.max_memory_allocated(self.place)), int(props.total_memory), str(props.name)


def main(
    make: Callable[[dict[str, Any], MetricLogger, str | None], PaddleTrainer],
    phases: tuple[str | None, ...] = (None,),
    ceiling_only: Callable[[dict[str, Any], MetricLogger], None] | None = None,
) -> None:
    """A paddle case's entry point: the resolved config read and the vendor's adapter applied,
    ``make(cfg, log, phase)``'s trainer driven by training/case.py after the conformance check
    (its verdict "not checked" for a case with no probe), every rank leaving together; then
    the process ends without paddle's own teardown. ``--ceiling`` runs ``ceiling_only`` instead
    (start_task.py --ceiling)."""
    cfg = runtime.setup()
    log = MetricLogger(rank=runtime.dist_info().rank)
    if ceiling_only is not None and "--ceiling" in sys.argv[1:]:
        ceiling_only(cfg, log)
    else:
        case.run(lambda phase: make(cfg, log, phase), log, phases=phases, cfg=cfg)
        import paddle.distributed as pdist

        # every rank leaves together: a rank that exits while a peer still uses the process
        # group's store can make paddle abort at teardown after a run that ended ok
        if pdist.get_world_size() > 1:
            pdist.barrier()
    runtime.leave()  # paddle's own teardown at exit aborted now and then on CPU after runs that ended ok


if __name__ == "__main__":
    sys.exit("training/paddle_loop.py is a library: run a case's train.py")
