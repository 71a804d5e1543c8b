"""The megatron-core training loop every megatron case shares (as training/deepspeed_loop.py is
DeepSpeed's): one phase on training/case.py's lifecycle, the case supplying its model, data and
settings.

A case subclasses :class:`MegatronTrainer` and gives:

``read_settings(cfg, world_size)``  its settings (``.common``: training/settings.py's Common;
                                    ``.shape``: the model's shape, whose fields run_meta reports)
``build_model()``                   the model on the device, before Float16Module and DDP (its
                                    layer spec, kernels, starting weights; the startup marks of its
                                    own parts), with ``self.tconfig`` set to its TransformerConfig
``make_batches()``                  an object whose ``microbatches(step)`` (0-based) gives the
                                    step's micro-batches (dicts of ``tokens``, ``labels``,
                                    ``position_ids`` on the device), and run_meta's ``data``
``meta()``, ``parallel_meta()``     its own run_meta fields, and those of ``parallel`` beyond tp,
                                    pp, dp, micro_batch, grad_accum

and may change ``layout_options()`` (distributed optimizer, overlapped gradient reduce and
parameter gather; default: the distributed optimizer alone), ``optimizer_options()`` (more of
megatron's ``OptimizerConfig``), ``after_optimizer()`` (kernels put into the built optimizer),
``measure_ceiling()`` (training/ceiling.py's kernel ceiling, None without one) and
``expected_params()`` (the count the built model must have: training/flops.py's of case.yaml's
shape).

The loop writes the rest once: the process groups (their timeout the harness's,
training/runtime.py), megatron's model-parallel state and seeds, the parameter check, DDP, the
Adam optimizer with megatron's cosine schedule, ``run_meta``, each step through
``get_forward_backward_func()`` timed by training/steptimer.py (batch fetch inside, device
synchronize and barrier at both ends) and profiled where ``train.profile_step`` asks
(training/profiling.py), the loss averaged over data-parallel ranks, ``train_step``, and
``peak_memory``. :func:`main` is a case's entry point.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from training import case, runtime, startup
from training.ceiling import K_KERNEL_CEILING
from training.metriclog import K_STEP_BREAKDOWN, MetricLogger

DTYPES = ("fp32", "bf16", "fp16")


def loss_func(output_tensor: Any) -> tuple[Any, dict[str, Any]]:
    """Mean next-token loss of one micro-batch (every token counts)."""
    loss = output_tensor.float().mean()
    # a copy: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Callable[..., Any]]:
    """A GPT model's forward on the next micro-batch, and :func:`loss_func`."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


def torch_dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class MegatronTrainer(case.LoopHooks):
    """One phase of a megatron case (the module docstring says what a case gives)."""

    #: the function each micro-batch's forward runs (:func:`forward_step`)
    forward_step = staticmethod(forward_step)

    def __init__(self, cfg: dict[str, Any], log: MetricLogger, phase: str | None = None):
        import torch

        from training.accelerator import Accelerator

        self.cfg, self.log, self.phase = cfg, log, phase
        self.dist = runtime.dist_info()
        self.s = self.read_settings(cfg, self.dist.world_size)
        self.acc = Accelerator(cfg.get("vendor") or {})  # training/accelerator.py: vendor.device's calls
        self.device = self.acc.device(self.dist.local_rank)
        if not self.acc.is_accelerator and not os.environ.get("OMP_NUM_THREADS"):
            # torch takes OMP_NUM_THREADS (a vendor's env, recorded with the run) by itself
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.dist.local_world_size)))
        self.steps = self.s.common.train.steps
        self.reporting = False  # known once the process groups are

    # -- what a case gives (beyond case.LoopHooks) ---------------------------
    def layout_options(self) -> dict[str, bool]:
        return {"distributed_optimizer": True, "overlap_grad_reduce": False, "overlap_param_gather": False}

    def optimizer_options(self) -> dict[str, Any]:
        return {}

    def after_optimizer(self) -> None:
        pass

    def measure_ceiling(self) -> dict[str, Any] | None:
        return None

    def local_param_count(self, model: Any) -> int:
        """This rank's parameters of one data-parallel replica: a tensor-parallel shard counts
        on every tensor-parallel rank, a replicated parameter on the first only."""
        return sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0)

    # -- the loop ------------------------------------------------------------
    def build(self) -> None:
        """Process groups, model, optimizer and schedule, data, ``run_meta``; the step's tools."""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from training.profiling import StepProfiler
        from training.steptimer import StepClock

        tr = self.s.common.train
        self.init_distributed()
        startup.mark("process_groups")
        self.build_trained_model()
        self.batches, self.data_desc = self.make_batches()
        self._emit_meta()
        self.fwd_bwd = get_forward_backward_func()
        self.prof = StepProfiler(tr.profile_step, self.s.common.output_dir, self.dist.rank, self.device.type)

        def sync() -> None:
            self.acc.synchronize(self.device)
            dist.barrier()

        self.clock = StepClock(sync)  # training/steptimer.py: batch fetch to optimizer step, synchronized

    def init_distributed(self) -> None:
        """The process group (the vendor's backend; the harness's timeout), megatron's
        tensor- and pipeline-parallel groups and its seeds; which rank reports."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        startup.mark("imports")  # megatron-core's, made here after the adapter
        c = self.s.common
        if not dist.is_initialized():
            timeout = runtime.process_group_timeout()  # the harness's stop, and its stacks, come first
            dist.init_process_group(backend=c.dist_backend, **({"timeout": timeout} if timeout else {}))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=c.parallel.tp, pipeline_model_parallel_size=c.parallel.pp)
        model_parallel_cuda_manual_seed(c.train.seed)
        self.ps = parallel_state
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.reporting = self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0

    def build_trained_model(self) -> None:
        """The kernel ceiling, then the case's model, its parameters checked, wrapped for
        training (``self.model``) with its optimizer and schedule."""
        self.ceiling = self.measure_ceiling()
        model = self.build_model()
        self.params_exact = self._exact_params(model)
        self._wrap(model)

    def _exact_params(self, model: Any) -> int:
        import torch
        import torch.distributed as dist

        local = torch.tensor([float(self.local_param_count(model))], dtype=torch.float64, device=self.device)
        dist.all_reduce(local)  # every data-parallel replica adds the same count
        total = int(round(local.item())) // self.s.common.parallel.dp
        expected = self.expected_params()
        if total != expected:
            raise RuntimeError(
                f"the built model has {total} parameters but training.flops.param_counts gives {expected} "
                f"for {self.s.shape}: the model does not have the shape the case declares"
            )
        return total

    def _wrap(self, model: Any) -> None:
        """Float16Module, megatron's DDP, the Adam optimizer (its ``OptimizerConfig`` from the
        train settings and the case's options) and the cosine schedule."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        tr, lay = self.s.common.train, self.layout_options()
        if tr.precision in ("bf16", "fp16"):
            model = Float16Module(self.tconfig, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=tr.precision != "fp32",
            overlap_grad_reduce=lay["overlap_grad_reduce"],
            overlap_param_gather=lay["overlap_param_gather"],
            use_distributed_optimizer=lay["distributed_optimizer"],
            check_for_nan_in_grad=False,
        )
        self.model = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=model)
        self.tconfig.no_sync_func = self.model.no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        if lay["overlap_grad_reduce"]:
            self.tconfig.grad_sync_func = self.model.start_grad_sync
        if lay["overlap_param_gather"]:
            self.tconfig.param_sync_func = self.model.start_param_sync
        opt = OptimizerConfig(
            optimizer="adam",
            lr=tr.lr,
            min_lr=tr.min_lr,
            weight_decay=tr.weight_decay,
            adam_beta1=tr.adam_beta1,
            adam_beta2=tr.adam_beta2,
            adam_eps=tr.adam_eps,
            clip_grad=tr.clip_grad,
            bf16=tr.precision == "bf16",
            fp16=tr.precision == "fp16",
            params_dtype=torch_dtype(tr.precision),
            use_distributed_optimizer=lay["distributed_optimizer"],
            overlap_param_gather=lay["overlap_param_gather"],
            **self.optimizer_options(),
        )
        self.optimizer = get_megatron_optimizer(opt, [self.model])
        startup.mark("optimizer")
        self.after_optimizer()
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=tr.lr,
            min_lr=tr.min_lr,
            lr_warmup_steps=tr.lr_warmup_steps,
            lr_decay_steps=tr.lr_decay_steps,
            lr_decay_style="cosine",
            start_wd=tr.weight_decay,
            end_wd=tr.weight_decay,
            wd_incr_steps=tr.steps,
            wd_incr_style="constant",
        )

    def _emit_meta(self) -> None:
        import torch

        if not self.reporting:
            return
        c, sh = self.s.common, self.s.shape
        vendor = self.cfg.get("vendor") or {}
        self.log.meta(
            model=c.model_name,
            framework="megatron",
            framework_version=framework_version(),
            params_exact=self.params_exact,
            params_nominal=c.params_nominal,
            num_layers=sh.num_layers,
            hidden_size=sh.hidden_size,
            ffn_hidden_size=sh.ffn_hidden_size,
            num_heads=sh.num_heads,
            num_kv_groups=sh.num_kv_groups,
            seq_length=sh.seq_length,
            vocab_size=sh.vocab_size,
            global_batch=c.train.global_batch,
            precision=c.train.precision,
            parallel={
                "tp": c.parallel.tp,
                "pp": c.parallel.pp,
                "dp": c.parallel.dp,
                "micro_batch": c.train.micro_batch,
                "grad_accum": c.train.grad_accum,
                **self.parallel_meta(),
            },
            world_size=c.world_size,
            steps=c.train.steps,
            config_name=c.config_name,
            device=c.device,
            visible_devices=runtime.visible_devices(vendor),
            allocator=runtime.allocator_options(vendor),
            environment=runtime.recorded_env(vendor),
            torch_version=torch.__version__,
            cpu_threads=torch.get_num_threads(),  # torch's intra-op threads in this rank
            data=self.data_desc,
            **({K_KERNEL_CEILING: self.ceiling} if self.ceiling is not None else {}),
            **self.meta(),
        )

    def step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based): the pipeline schedule over its micro-batches."""
        import torch
        import torch.distributed as dist

        c, clock, prof = self.s.common, self.clock, self.prof
        seq = self.s.shape.seq_length
        lr = float(self.optimizer.param_groups[0]["lr"])
        with clock.step(), prof.step(step):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            losses = self.fwd_bwd(
                forward_step_func=self.forward_step,
                data_iterator=clock.timed(self.batches.microbatches(step - 1)),
                model=[self.model],
                num_microbatches=c.train.grad_accum,
                seq_length=seq,
                micro_batch_size=c.train.micro_batch,
                decoder_seq_length=seq,
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
        if not self.is_last_stage:
            return
        local = torch.stack([x["lm loss"] for x in losses]).float().mean().reshape(1)
        dist.all_reduce(local, group=self.ps.get_data_parallel_group())
        if self.reporting:
            self.log.step(
                step,
                local.item() / c.parallel.dp,
                c.train.global_batch * seq,
                step_time,
                lr,
                data_s=clock.data_s,
                grad_norm=None if grad_norm is None else float(grad_norm),
                skipped=not ok,
                **({"profiled": True} if step == c.train.profile_step else {}),
            )

    def finish(self) -> None:
        """This rank's ``peak_memory`` (and the allocator's reserve on an accelerator)."""
        peak, total, name = self.acc.memory(self.device)
        if not self.acc.is_accelerator and self.acc.query is None:
            total = None  # the CPU: the process's resident peak, which no card's total bounds
        self.log.peak_memory(
            peak, total, name, reserved_bytes=self.acc.max_reserved(self.device), alloc_retries=self.acc.alloc_retries(self.device)
        )


def framework_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def main(
    make: Callable[[dict[str, Any], MetricLogger, str | None], MegatronTrainer],
    phases: tuple[str | None, ...] = (None,),
    ceiling_only: Callable[[dict[str, Any], MetricLogger], None] | None = None,
) -> int:
    """A megatron case's entry point: the resolved config read and the vendor's adapter applied
    (before megatron is imported), then ``make(cfg, log, phase)``'s trainer driven by
    training/case.py after the conformance check (its verdict "not checked" for a case with no
    probe), and the process group left together (:func:`training.runtime.leave`). ``--ceiling`` runs ``ceiling_only`` instead (start_task.py --ceiling)."""
    cfg = runtime.setup()
    log = MetricLogger()
    if ceiling_only is not None and "--ceiling" in sys.argv[1:]:
        ceiling_only(cfg, log)
        return 0
    case.run(lambda phase: make(cfg, log, phase), log, phases=phases, cfg=cfg)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    runtime.leave()


if __name__ == "__main__":
    sys.exit("training/megatron_loop.py is a library: run a case's train.py")
