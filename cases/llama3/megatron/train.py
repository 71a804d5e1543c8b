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
``get_forward_backward_func()``, timed by ``training.steptimer.StepClock``: the shared
megatron loop (training/megatron_loop.py), to which this case gives its model (modeling.py,
its kernels and patches), starting weights, data and run_meta fields. Metrics go out through
``training.metriclog.MetricLogger`` (see docs/architecture.md).
"""

from __future__ import annotations

import sys

from training import case

case.isolate(__file__)
from training import megatron_loop, startup  # noqa: E402
from training.metriclog import MetricLogger  # noqa: E402


class Trainer(megatron_loop.MegatronTrainer):
    """The case's one phase: llama3's model, weights and data on the shared megatron loop."""

    def read_settings(self, cfg: dict, world_size: int):
        from cases.llama3.megatron.settings import from_config

        return from_config(cfg, world_size)

    def layout_options(self) -> dict[str, bool]:
        lay = self.s.layout
        return {
            "distributed_optimizer": lay.distributed_optimizer,
            "overlap_grad_reduce": lay.overlap_grad_reduce,
            "overlap_param_gather": lay.overlap_param_gather,
        }

    def measure_ceiling(self) -> dict:
        """training/ceiling.py's kernel ceiling of this layout, timed on every rank's device at
        once before the model exists; the allocator's peak is reset after it."""
        from cases.llama3.megatron import modeling

        value = modeling.kernel_ceiling(self.s, self.device, self.acc)
        self.acc.reset_peak(self.device)
        return value

    def build_model(self):
        from cases.llama3.megatron import kernels, modeling, startweights

        s, lay = self.s, self.s.layout
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
        self.offload_copy = kernels.install_offload_copy(lay.offload_pinned_copy) if lay.optimizer_cpu_offload else None
        return model

    def local_param_count(self, model) -> int:
        from cases.llama3.megatron import modeling

        return modeling.local_param_count(model)

    def optimizer_options(self) -> dict:
        lay = self.s.layout
        if not lay.optimizer_cpu_offload:
            return {}
        return {
            "optimizer_cpu_offload": True,
            "optimizer_offload_fraction": lay.optimizer_offload_fraction,
            "overlap_cpu_optimizer_d2h_h2d": lay.overlap_cpu_optimizer_d2h_h2d,
        }

    def after_optimizer(self) -> None:
        from cases.llama3.megatron import kernels

        lay = self.s.layout
        self.adam_kernel = kernels.fuse_adam(self.optimizer, lay.fused_adam)  # torch's foreach AdamW, or fused
        self.grad_clip_kernel = kernels.install_grad_clip(lay.fused_grad_clip)  # megatron's norm and clip scaling

    def make_batches(self):
        from cases.llama3.megatron import batches

        prefix, data_desc = batches.corpus_prefix(self.s, self.dist.local_rank)
        return batches.StepBatches(prefix, self.s, self.dp_rank, self.device, pin_memory=self.acc.pin_memory), data_desc

    def parallel_meta(self) -> dict:
        from cases.llama3.megatron import modeling, tp_gemm_comm

        s, lay = self.s, self.s.layout
        return dict(
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
        )

    def meta(self) -> dict:
        from cases.llama3.megatron import mcore_patches

        return {"megatron_patches": mcore_patches.applied()}


def ceiling_only(cfg: dict, log: MetricLogger) -> None:
    """``--ceiling`` (start_task.py --ceiling): the kernel ceiling of the configured layout on this
    process's first device, as one ``info`` record; no process group, model or data."""
    from cases.llama3.megatron import modeling
    from cases.llama3.megatron.settings import from_config
    from training import ceiling

    ceiling.record_alone(cfg, log, lambda world, _, device, acc: modeling.kernel_ceiling(from_config(cfg, world), device, acc))


if __name__ == "__main__":
    sys.exit(megatron_loop.main(Trainer, ceiling_only=ceiling_only))
