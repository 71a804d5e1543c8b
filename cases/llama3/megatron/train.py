"""llama3 on megatron-core: the case's entry point.

Run by the harness on every rank::

    python -m torch.distributed.run --nnodes N --nproc-per-node M ... \\
        cases/llama3/megatron/train.py --config <round_dir>/resolved.json

with the repository root on PYTHONPATH.  ``training.runtime.setup()`` runs
first: it applies the vendor's adapter (e.g. the CPU redirection of
``vendors/cpu/adapters/megatron.py``) before megatron is imported.

Training: megatron-core GPTModel (Llama 3 architecture: RMSNorm, SwiGLU, RoPE,
grouped-query attention, untied output layer) with tensor and pipeline
parallelism from ``parallel_state``, starting weights that are the same for
every layout (``startweights.py``), megatron's DDP with the distributed
optimizer (Adam with decoupled weight decay), a cosine learning-rate schedule
from ``OptimizerParamScheduler``, and the pipeline schedule of
``get_forward_backward_func()``, timed by ``training.steptimer.StepClock``.
Metrics go out through ``training.metriclog.MetricLogger`` (see
docs/architecture.md).
"""

from __future__ import annotations

import os
import sys

from training import case, runtime

case.isolate(__file__)
from training import flops, startup  # noqa: E402
from training.ceiling import K_KERNEL_CEILING  # noqa: E402
from training.metriclog import K_STEP_BREAKDOWN, MetricLogger  # noqa: E402
from training.profiling import StepProfiler  # noqa: E402
from training.steptimer import StepClock  # noqa: E402


def loss_func(output_tensor):
    """Mean next-token loss of one microbatch (every token counts)."""
    loss = output_tensor.float().mean()
    # a copy: the schedule divides the returned loss in place by the number of microbatches
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


class Trainer:
    """The case's one phase on training/case.py's lifecycle: build, step, finish."""

    def __init__(self, cfg: dict, log: MetricLogger, phase: str | None = None):
        import torch

        from cases.llama3.megatron.settings import from_config
        from training.accelerator import Accelerator

        self.cfg = cfg
        self.log = log
        self.phase = phase
        self.dist = runtime.dist_info()
        self.s = from_config(cfg, self.dist.world_size)
        self.acc = Accelerator(cfg.get("vendor") or {})  # training/accelerator.py: vendor.device's calls
        self.device = self.acc.device(self.dist.local_rank)
        if not self.acc.is_accelerator:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.dist.local_world_size)))
        self.steps = self.s.common.train.steps
        self.reporting = False  # known once the process groups are

    def build(self) -> None:
        """Process groups, model and optimizer, data, ``run_meta``; the step loop's tools."""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.init_distributed()
        startup.mark("process_groups")
        self.build_model()
        self.prepare_data()
        self.emit_meta()
        self.fwd_bwd = get_forward_backward_func()
        self.prof = StepProfiler(self.s.common.train.profile_step, self.s.common.output_dir, self.dist.rank, self.device.type)

        def sync() -> None:
            self.acc.synchronize(self.device)
            dist.barrier()

        self.clock = StepClock(sync)  # training/steptimer.py: batch fetch to optimizer step, synchronized

    # -- setup -------------------------------------------------------------
    def init_distributed(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        startup.mark("imports")  # megatron-core's, made here after the adapter: 9.5-10.4 s on an H200 machine
        if not dist.is_initialized():
            timeout = runtime.process_group_timeout()  # the harness's stop, and its stacks, come first
            dist.init_process_group(backend=self.s.common.dist_backend, **({"timeout": timeout} if timeout else {}))
        lay = self.s.layout
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp)
        model_parallel_cuda_manual_seed(self.s.common.train.seed)
        self.ps = parallel_state
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.reporting = self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0

    def build_model(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        from cases.llama3.megatron import kernels, modeling, startweights

        s, lay = self.s, self.s.layout
        self.ceiling = self.measure_ceiling()
        self.tconfig = modeling.transformer_config(s)
        # before the model: megatron's linear layers check for the fused path when built
        self.wgrad_accumulation = (
            kernels.install_wgrad_accumulation(self.device, modeling.DTYPES[s.common.train.precision])
            if lay.gradient_accumulation_fusion
            else "off"
        )
        model = modeling.build_model(s, self.tconfig)  # on the device (use_cpu_initialization=False)
        startup.mark("model")
        # every layout starts from the TP1/PP1 model's weights; written before Float16Module,
        # DDP and the optimizer take their copies
        init = startweights.overwrite(model, s)
        startup.mark("weights")
        if self.tp_rank == 0 and self.dp_rank == 0:  # one record per pipeline stage
            self.log.info("start_weights", {**init, "pp_rank": self.ps.get_pipeline_model_parallel_rank()})
        self.params_exact = self._exact_params(model)
        if s.common.train.precision in ("bf16", "fp16"):
            model = Float16Module(self.tconfig, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=s.common.train.precision != "fp32",
            overlap_grad_reduce=lay.overlap_grad_reduce,
            overlap_param_gather=lay.overlap_param_gather,
            use_distributed_optimizer=lay.distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        self.model = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=model)
        self.tconfig.no_sync_func = self.model.no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        if lay.overlap_grad_reduce:
            self.tconfig.grad_sync_func = self.model.start_grad_sync
        if lay.overlap_param_gather:
            self.tconfig.param_sync_func = self.model.start_param_sync
        opt_kw = dict(
            optimizer="adam",
            lr=s.common.train.lr,
            min_lr=s.common.train.min_lr,
            weight_decay=s.common.train.weight_decay,
            adam_beta1=s.common.train.adam_beta1,
            adam_beta2=s.common.train.adam_beta2,
            adam_eps=s.common.train.adam_eps,
            clip_grad=s.common.train.clip_grad,
            bf16=s.common.train.precision == "bf16",
            fp16=s.common.train.precision == "fp16",
            params_dtype=modeling.DTYPES[s.common.train.precision],
            use_distributed_optimizer=lay.distributed_optimizer,
            overlap_param_gather=lay.overlap_param_gather,
        )
        if lay.optimizer_cpu_offload:
            opt_kw.update(
                optimizer_cpu_offload=True,
                optimizer_offload_fraction=lay.optimizer_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=lay.overlap_cpu_optimizer_d2h_h2d,
            )
        self.offload_copy = kernels.install_offload_copy(lay.offload_pinned_copy) if lay.optimizer_cpu_offload else None
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**opt_kw), [self.model])
        startup.mark("optimizer")
        self.adam_kernel = kernels.fuse_adam(self.optimizer, lay.fused_adam)  # torch's foreach AdamW, or fused
        self.grad_clip_kernel = kernels.install_grad_clip(lay.fused_grad_clip)  # megatron's norm and clip scaling
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=s.common.train.lr,
            min_lr=s.common.train.min_lr,
            lr_warmup_steps=s.common.train.lr_warmup_steps,
            lr_decay_steps=s.common.train.lr_decay_steps,
            lr_decay_style="cosine",
            start_wd=s.common.train.weight_decay,
            end_wd=s.common.train.weight_decay,
            wd_incr_steps=s.common.train.steps,
            wd_incr_style="constant",
        )

    def measure_ceiling(self) -> dict:
        """training/ceiling.py's kernel ceiling of this layout, timed on every rank's device at
        once before the model exists; the allocator's peak is reset after it."""
        from cases.llama3.megatron import modeling

        value = modeling.kernel_ceiling(self.s, self.device, self.acc)
        self.acc.reset_peak(self.device)
        return value

    def _exact_params(self, model) -> int:
        import torch
        import torch.distributed as dist

        from cases.llama3.megatron import modeling

        local = torch.tensor([modeling.local_param_count(model)], dtype=torch.float64, device=self.device)
        dist.all_reduce(local)  # every data-parallel replica adds the same count
        total = int(round(local.item())) // self.s.layout.dp
        sh = self.s.shape
        shape = flops.DecoderShape(
            num_layers=sh.num_layers,
            hidden_size=sh.hidden_size,
            num_heads=sh.num_heads,
            seq_length=sh.seq_length,
            vocab_size=sh.vocab_size,
            ffn_hidden_size=sh.ffn_hidden_size,
            num_kv_groups=sh.num_kv_groups,
        )
        expected = flops.param_counts(shape)["total"]
        if total != expected:
            raise RuntimeError(
                f"the built model has {total} parameters but training.flops.param_counts gives {expected} "
                f"for {sh}: the model does not have the shape the case declares"
            )
        return total

    def prepare_data(self) -> None:
        from cases.llama3.megatron import batches

        prefix, self.data_desc = batches.corpus_prefix(self.s, self.dist.local_rank)
        self.batches = batches.StepBatches(prefix, self.s, self.dp_rank, self.device, pin_memory=self.acc.pin_memory)

    def emit_meta(self) -> None:
        import torch

        from cases.llama3.megatron import mcore_patches, modeling, tp_gemm_comm

        s, lay, sh = self.s, self.s.layout, self.s.shape
        if not self.reporting:
            return
        self.log.meta(
            model=s.common.model_name,
            framework="megatron",
            framework_version=modeling.framework_version(),
            params_exact=self.params_exact,
            params_nominal=s.common.params_nominal,
            num_layers=sh.num_layers,
            hidden_size=sh.hidden_size,
            ffn_hidden_size=sh.ffn_hidden_size,
            num_heads=sh.num_heads,
            num_kv_groups=sh.num_kv_groups,
            seq_length=sh.seq_length,
            vocab_size=sh.vocab_size,
            global_batch=s.common.train.global_batch,
            precision=s.common.train.precision,
            parallel=dict(
                tp=lay.tp,
                pp=lay.pp,
                dp=lay.dp,
                micro_batch=lay.micro_batch,
                grad_accum=lay.grad_accum,
                recompute=lay.recompute,
                sequence_parallel=lay.sequence_parallel,
                distributed_optimizer=lay.distributed_optimizer,
                overlap_grad_reduce=lay.overlap_grad_reduce,
                overlap_param_gather=lay.overlap_param_gather,
                attention=lay.attention,
                attention_kernel=modeling.attention_kernel(s),
                fused_elementwise=modeling.fused_elementwise_in_use(s),
                fused_rope=lay.fused_rope,
                fused_linear_loss=lay.fused_linear_loss,
                cross_entropy=lay.cross_entropy,
                fused_add_norm=modeling.fused_add_norm_in_use(s),
                fused_adam=lay.fused_adam,
                adam_kernel=self.adam_kernel,
                fused_grad_clip=lay.fused_grad_clip,
                grad_clip_kernel=self.grad_clip_kernel,
                wgrad_accumulation=self.wgrad_accumulation,
                tp_comm_overlap=lay.tp_comm_overlap,
                tp_comm_path=tp_gemm_comm.path(s.common.device) if lay.tp_comm_overlap == "symm_mem" else None,
                transformer_engine=modeling.use_transformer_engine(s),
                optimizer_cpu_offload=lay.optimizer_cpu_offload,
                offload_copy=self.offload_copy,
            ),
            world_size=s.common.world_size,
            steps=s.common.train.steps,
            config_name=s.common.config_name,
            device=s.common.device,
            visible_devices=runtime.visible_devices(self.cfg.get("vendor") or {}),
            allocator=runtime.allocator_options(self.cfg.get("vendor") or {}),
            environment=runtime.recorded_env(self.cfg.get("vendor") or {}),
            torch_version=torch.__version__,
            megatron_patches=mcore_patches.applied(),
            data=self.data_desc,
            **{K_KERNEL_CEILING: self.ceiling},
        )

    # -- training ----------------------------------------------------------
    def step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based): the pipeline schedule over its micro-batches."""
        import torch
        import torch.distributed as dist

        s, lay, clock, prof = self.s, self.s.layout, self.clock, self.prof
        lr = float(self.optimizer.param_groups[0]["lr"])
        with clock.step(), prof.step(step):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            losses = self.fwd_bwd(
                forward_step_func=forward_step,
                data_iterator=clock.timed(self.batches.microbatches(step - 1)),
                model=[self.model],
                num_microbatches=lay.grad_accum,
                seq_length=s.shape.seq_length,
                micro_batch_size=lay.micro_batch,
                decoder_seq_length=s.shape.seq_length,
                forward_only=False,
            )
            with prof.optimizer():
                ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.acc.synchronize(self.device)  # the profiled step's kernels end inside its trace
        step_time = clock.step_time_s
        parts = prof.result(step, step_time, reduce=self.tp_rank == 0 and self.dp_rank == 0)  # one per stage
        if parts is not None:
            self.log.info(K_STEP_BREAKDOWN, {**parts, "pp_rank": self.ps.get_pipeline_model_parallel_rank()})
        if self.is_last_stage:
            local = torch.stack([x["lm loss"] for x in losses]).float().mean().reshape(1)
            dist.all_reduce(local, group=self.ps.get_data_parallel_group())
            loss = local.item() / lay.dp
            if self.reporting:
                self.log.step(
                    step,
                    loss,
                    s.common.train.global_batch * s.shape.seq_length,
                    step_time,
                    lr,
                    data_s=clock.data_s,
                    grad_norm=None if grad_norm is None else float(grad_norm),
                    skipped=not ok,
                    **({"profiled": True} if step == s.common.train.profile_step else {}),
                )

    def finish(self) -> None:
        """This rank's ``peak_memory`` (and the allocator's reserve on an accelerator)."""
        self.emit_memory()

    def emit_memory(self) -> None:
        peak, total, name = self.acc.memory(self.device)
        if not self.acc.is_accelerator and self.acc.query is None:
            total = None  # the CPU: the process's resident peak, which no card's total bounds
        self.log.peak_memory(
            peak, total, name, reserved_bytes=self.acc.max_reserved(self.device), alloc_retries=self.acc.alloc_retries(self.device)
        )


def ceiling_only(cfg: dict, log: MetricLogger) -> None:
    """``--ceiling`` (start_task.py --ceiling): the kernel ceiling of the configured layout on this
    process's first device, as one ``info`` record; no process group, model or data."""
    from cases.llama3.megatron import modeling
    from cases.llama3.megatron.settings import from_config
    from training import ceiling

    ceiling.record_alone(cfg, log, lambda world, _, device, acc: modeling.kernel_ceiling(from_config(cfg, world), device, acc))


def main() -> int:
    cfg = runtime.setup()
    log = MetricLogger()
    if "--ceiling" in sys.argv[1:]:
        ceiling_only(cfg, log)
        return 0
    case.run(lambda phase: Trainer(cfg, log, phase), log, cfg=cfg)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
