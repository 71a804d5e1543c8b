"""GPT-3 on paddle (PaddleNLP's GPT): the case's entry point.

Run by the harness on every rank::

    python -m paddle.distributed.launch --log_dir <node>/ranks \\
        [--devices 0,1,...  |  --nproc_per_node N] \\
        cases/gpt3/paddle/train.py --config <round_dir>/resolved.json

with the repository root on PYTHONPATH. The device is the vendor's (``vendor.device`` in
paddle's name: settings.paddle_device); paddle's launcher picks the collectives for it
(gloo on the CPU, nccl on gpu, xccl on a custom device).

Training: PaddleNLP's ``GPTForCausalLM`` (``GPTForCausalLMPipe`` for pp > 1)
under paddle's hybrid-parallel fleet: tensor parallelism (``mp_degree``),
pipeline parallelism (1F1B, ``train_batch``), and the data-parallel width
split into sharding (stage 1: ``DygraphShardingOptimizer``; stage 2:
``group_sharded_parallel(level="os_g")``) and plain replicas; AdamW with
decoupled weight decay (not on biases and norms), global-norm clipping,
PaddleNLP's cosine schedule with linear warm-up; fp16 AMP O2 with a dynamic
loss scale as in FlagPerf's paddle configs, bf16 O2, or fp32.  This mirrors
how PaddleNLP's Trainer wraps the model for these layouts, without the
Trainer's checkpointing and logging.  Metrics go out through
``training.metriclog.MetricLogger`` only (docs/architecture.md).

Before the process groups, the seeds and the model, every rank times the kernel ceiling of
its micro batch on its device (``ceiling.py``, training/ceiling.py, with paddle; run_meta's
``kernel_ceiling``; the allocator's cache emptied and its peaks restarted after, and its random
inputs drawn before ``paddle.seed``, so the run's memory figures and random streams are its
own). ``--ceiling`` times it alone, on the vendor's first device, with no process group, model
or data (``start_task.py --ceiling``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import resource
import sys
import time

from training import case, runtime

case.isolate(__file__)
from training import flops  # noqa: E402
from training.metriclog import K_KERNEL_CEILING, MetricLogger  # noqa: E402
from training.steptimer import StepClock  # noqa: E402


class Trainer:
    """The case's one phase on training/case.py's lifecycle: build, step, finish."""

    def __init__(self, cfg: dict, log: MetricLogger, phase: str | None = None):
        self.cfg = cfg
        self.log = log
        self.phase = phase
        self.dist = runtime.dist_info()
        self.steps = 0
        self.reporting = self.dist.rank == 0  # until the topology is known

    def build(self) -> None:
        """Settings, process groups, model and optimizer, data; ``run_meta``."""
        import paddle

        from cases.gpt3.paddle import ceiling as case_ceiling
        from cases.gpt3.paddle import model as gpt3_model
        from cases.gpt3.paddle.settings import from_config

        self.s = from_config(self.cfg, self.dist.world_size)
        self.place = "cpu" if self.s.device == "cpu" else f"{self.s.device}:{self.dist.local_rank}"
        paddle.set_device(self.place)
        self.flash = self.s.layout.use_flash_attention and gpt3_model.flash_attention_available(self.s.device)
        # the kernel ceiling, on every rank's device at once, before the seeds and the model
        self.kernel_ceiling, timers = case_ceiling.kernel_ceiling(self.s, self.place, self.cfg.get("vendor") or {}, self.flash)
        timers.reset_peak()
        self.clock = StepClock(self._barrier)  # training/steptimer.py: the one timing rule
        self._init_distributed()
        self._build_model()
        self._prepare_data()
        self._emit_meta()
        self.steps = self.s.common.train.steps
        self.tokens_per_step = self.s.common.train.global_batch * self.s.shape.seq_length
        self.run_step = self._step_pipeline if self.s.layout.pp > 1 else self._step_nonpipeline

    # -- setup -------------------------------------------------------------
    def _init_distributed(self) -> None:
        import paddle
        from paddle.distributed import fleet
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        s, lay = self.s, self.s.layout
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

        # dropout: shared inside a TP group ("global_seed"), per rank ("local_seed"); the
        # parameters drawn while the model is built are overwritten by weights.py in _build_model()
        paddle.seed(s.common.train.seed)
        tracker = get_rng_state_tracker()
        tracker.reset()
        tracker.add("model_parallel_rng", s.common.train.seed + 1 + self.tp_rank * lay.pp + self.stage)
        tracker.add("global_seed", s.common.train.seed + 100_003 + self.data_rank * lay.pp + self.stage)
        tracker.add("local_seed", s.common.train.seed + 200_003 + self.dist.rank)

    def _sync_device(self) -> None:
        import paddle

        if self.s.device != "cpu":
            paddle.device.synchronize()

    def _barrier(self) -> None:
        import paddle.distributed as dist

        self._sync_device()
        if self.dist.world_size > 1:
            dist.barrier()

    def _build_model(self) -> None:
        import paddle
        from paddle.distributed import fleet
        from paddlenlp.transformers import CosineAnnealingWithWarmupDecay

        from cases.gpt3.paddle import model as gpt3_model

        s, lay = self.s, self.s.layout
        config = gpt3_model.gpt_config(s, lay.tp, self.tp_rank, self.flash)
        model = gpt3_model.build_model(s, config)
        self._init_weights(model)
        self.params_exact = self._exact_params(model)

        # warm-up from lr/warmup at step 1, as FlagPerf (last_epoch=0)
        self.scheduler = CosineAnnealingWithWarmupDecay(
            max_lr=s.common.train.lr,
            min_lr=s.common.train.min_lr,
            warmup_step=s.common.train.lr_warmup_steps,
            decay_step=s.common.train.lr_decay_steps,
            last_epoch=0,
        )
        decay = {p.name for n, p in model.named_parameters() if not any(k in n for k in ("bias", "norm"))}
        self.amp_dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(s.common.train.precision)
        optimizer = paddle.optimizer.AdamW(
            learning_rate=self.scheduler,
            beta1=s.common.train.adam_beta1,
            beta2=s.common.train.adam_beta2,
            epsilon=s.common.train.adam_eps,
            parameters=model.parameters(),
            weight_decay=s.common.train.weight_decay,
            apply_decay_param_fun=lambda name: name in decay,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(s.common.train.clip_grad) if s.common.train.clip_grad > 0 else None,
            multi_precision=self.amp_dtype is not None and s.own.amp_level == "O2",
        )
        if self.amp_dtype and s.own.amp_level == "O2":
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=self.amp_dtype)

        self.scaler = None
        if s.common.train.precision == "fp16":
            self.scaler = paddle.amp.GradScaler(init_loss_scaling=s.own.loss_scale)

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

    def _init_weights(self, model) -> None:
        """The same full starting weights whatever the layout (weights.py), before AMP
        decoration and the parallel wrappers; this rank's time for it goes out as an info line
        (no barrier inside: ranks finish building their models at different times)."""
        from cases.gpt3.paddle import weights as gpt3_weights

        t0 = time.perf_counter()
        tensors = gpt3_weights.init_weights(model, self.s, self.tp_rank)
        self._sync_device()
        self.log.info("init_weights", {"seconds": round(time.perf_counter() - t0, 4), "tensors": tensors})

    def _exact_params(self, model) -> int:
        import paddle
        import paddle.distributed as dist

        from cases.gpt3.paddle import model as gpt3_model

        lay = self.s.layout
        local = gpt3_model.local_param_count(model, self.tp_rank, self.stage, lay.pp)
        t = paddle.to_tensor([float(local)], dtype="float64")
        if self.dist.world_size > 1:
            dist.all_reduce(t)  # every data-parallel replica adds the same count
        total = int(round(float(t.numpy()[0]))) // lay.dp
        expected = flops.param_counts(flops.decoder_shape(self.s.shape.decoder_shape()))["total"]
        if total != expected:
            raise RuntimeError(
                f"the built model has {total} parameters but training.flops.param_counts gives {expected} "
                f"for {self.s.shape}: the model does not have the shape the case declares"
            )
        return total

    def _prepare_data(self) -> None:
        from cases.gpt3.paddle import data as gpt3_data

        prefix, self.data_desc = gpt3_data.corpus_prefix(self.s, self.dist.local_rank, self._barrier)
        self.batches = gpt3_data.StepBatches(prefix, self.s, self.data_rank)

    def _emit_meta(self) -> None:
        from cases.gpt3.paddle import model as gpt3_model

        if not self.reporting:
            return
        s, lay, sh = self.s, self.s.layout, self.s.shape
        self.log.meta(
            model=s.common.model_name,
            framework="paddle",
            framework_version=gpt3_model.framework_version(),
            params_exact=self.params_exact,
            params_nominal=s.common.params_nominal,
            num_layers=sh.num_layers,
            hidden_size=sh.hidden_size,
            ffn_hidden_size=sh.ffn_hidden_size,
            num_heads=sh.num_heads,
            num_kv_groups=sh.num_heads,
            seq_length=sh.seq_length,
            vocab_size=sh.vocab_size,
            global_batch=s.common.train.global_batch,
            precision=s.common.train.precision,
            amp_level=s.own.amp_level if s.common.train.precision != "fp32" else None,
            parallel=dict(
                tp=lay.tp,
                pp=lay.pp,
                dp=lay.dp,
                dp_degree=lay.dp_degree,
                sharding_stage=lay.sharding_stage,
                sharding_degree=lay.sharding_degree,
                micro_batch=lay.micro_batch,
                grad_accum=lay.grad_accum,
                recompute=lay.recompute,
                flash_attention=self.flash,
                use_fused_rms_norm=lay.use_fused_rms_norm,
                fuse_attention_qkv=lay.fuse_attention_qkv,
                sequence_parallel=lay.sequence_parallel,
            ),
            inert_options=gpt3_model.inert_flags(s, self.flash),
            world_size=s.common.world_size,
            steps=s.common.train.steps,
            config_name=s.common.config_name,
            device=s.device,
            visible_devices=runtime.visible_devices(self.cfg.get("vendor") or {}),
            environment=runtime.recorded_env(self.cfg.get("vendor") or {}),
            data=self.data_desc,
            **{K_KERNEL_CEILING: self.kernel_ceiling},
        )

    # -- training ----------------------------------------------------------
    def _autocast(self):
        import paddle

        if self.amp_dtype is None:
            return contextlib.nullcontext()
        white = ["lookup_table", "lookup_table_v2"] if self.s.own.amp_level == "O2" else []
        return paddle.amp.auto_cast(
            enable=True,
            custom_white_list=white,
            custom_black_list=["reduce_sum", "c_softmax_with_cross_entropy"],
            level=self.s.own.amp_level,
            dtype=self.amp_dtype,
        )

    def _device_micro_batches(self, step: int) -> list:
        import paddle

        return [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in self.batches.micro_batches(step)]

    def _step_nonpipeline(self, step: int):
        micro = self.clock.fetch(lambda: self._device_micro_batches(step))
        total = None
        for a, (x, y) in enumerate(micro):
            sync_ctx = self.model.no_sync() if self.no_sync and a < len(micro) - 1 else contextlib.nullcontext()
            with sync_ctx:
                with self._autocast():
                    loss, _ = self.model(x, labels=y)
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

    def _step_pipeline(self, step: int):
        import paddle

        def fetch() -> list:
            rows = self.batches.step(step)
            return [paddle.to_tensor(rows[:, :-1]), paddle.to_tensor(rows[:, 1:])]

        data = self.clock.fetch(fetch)
        with self._autocast():
            return self.model.train_batch(data, optimizer=self.optimizer, lr_scheduler=None, scaler=self.scaler)

    def _data_mean(self, loss) -> float:
        import paddle
        import paddle.distributed as dist

        lay = self.s.layout
        t = paddle.cast(loss.reshape([1]), "float32")
        if lay.dp_degree > 1:
            dist.all_reduce(t, group=self.hcg.get_data_parallel_group())
        if lay.sharding_degree > 1:
            dist.all_reduce(t, group=self.hcg.get_sharding_parallel_group())
        return float(t.numpy()[0]) / lay.dp

    def step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based)."""
        lr = float(self.scheduler.get_lr())
        with self.clock.step():  # from the batch fetch to the end of the optimizer step
            loss = self.run_step(step - 1)
            self.scheduler.step()
        mean = self._data_mean(loss)  # outside the timed window
        if self.reporting:
            extra = {}
            if self.scaler is not None:
                extra["loss_scale"] = float(self.scaler._scale.numpy().reshape(-1)[0])
            self.log.step(step, mean, self.tokens_per_step, self.clock.step_time_s, lr, data_s=self.clock.data_s, **extra)

    def finish(self) -> None:
        """``peak_memory`` of this rank (and the allocator's reserve on an accelerator)."""
        reserved = None if self.s.device == "cpu" else int(self._device_module().max_memory_reserved(self.place))
        self.log.peak_memory(*self._memory(), reserved_bytes=reserved)

    def _device_module(self):
        """paddle's module of the device's memory calls (settings.device_module)."""
        from cases.gpt3.paddle.settings import device_module

        return device_module(self.s.device)

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
        mod = self._device_module()
        props = mod.get_device_properties(self.place)
        return int(mod.max_memory_allocated(self.place)), int(props.total_memory), str(props.name)


def main() -> int:
    cfg = runtime.setup()
    log = MetricLogger(rank=runtime.dist_info().rank)
    if "--ceiling" in sys.argv[1:]:
        from cases.gpt3.paddle import ceiling as case_ceiling

        case_ceiling.ceiling_only(cfg, log)
        return 0
    case.run(lambda phase: Trainer(cfg, log, phase), log, cfg=cfg)
    import paddle.distributed as pdist

    # every rank leaves together: a rank that exits while a peer still uses the process
    # group's store can make paddle abort at teardown after a run that ended ok
    if pdist.get_world_size() > 1:
        pdist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    # paddle's own teardown at interpreter exit (its TCP store and gloo contexts) aborted now
    # and then on CPU after runs that had ended ok and passed the final barrier (SIGABRT, the
    # launcher's exit status 250; seen twice in CI on 2026-11-26): once every metric line is
    # out, leave without it. A failed run raises out of main() and exits the usual way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
