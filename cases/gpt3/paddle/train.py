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
Trainer's checkpointing and logging: the shared paddle loop (training/paddle_loop.py),
to which this case gives PaddleNLP's model, its starting weights, schedule, data and
run_meta fields.  Metrics go out through ``training.metriclog.MetricLogger`` only
(docs/architecture.md).

Before the process groups, the seeds and the model, every rank times the kernel ceiling of
its micro batch on its device (``ceiling.py``, training/ceiling.py, with paddle; run_meta's
``kernel_ceiling``; the allocator's cache emptied and its peaks restarted after, and its random
inputs drawn before ``paddle.seed``, so the run's memory figures and random streams are its
own). ``--ceiling`` times it alone, on the vendor's first device, with no process group, model
or data (``start_task.py --ceiling``).
"""

from __future__ import annotations

import contextlib

from training import case

case.isolate(__file__)
from training import flops, paddle_loop  # noqa: E402


class Trainer(paddle_loop.PaddleTrainer):
    """The case's one phase: PaddleNLP's GPT, its weights and data on the shared paddle loop."""

    def read_settings(self, cfg: dict, world_size: int):
        from cases.gpt3.paddle.settings import from_config

        return from_config(cfg, world_size)

    def layout(self) -> paddle_loop.Layout:
        lay, own = self.s.layout, self.s.own
        return paddle_loop.Layout(
            tp=lay.tp,
            pp=lay.pp,
            dp_degree=lay.dp_degree,
            sharding_degree=lay.sharding_degree,
            sharding_stage=lay.sharding_stage,
            micro_batch=lay.micro_batch,
            grad_accum=lay.grad_accum,
            amp_level=own.amp_level,
            loss_scale=own.loss_scale,
        )

    def setup(self) -> None:
        from cases.gpt3.paddle import model as gpt3_model

        self.flash = self.s.layout.use_flash_attention and gpt3_model.flash_attention_available(self.s.device)

    def measure_ceiling(self):
        from cases.gpt3.paddle import ceiling as case_ceiling

        return case_ceiling.kernel_ceiling(self.s, self.place, self.cfg.get("vendor") or {}, self.flash)

    def build_model(self):
        from cases.gpt3.paddle import model as gpt3_model
        from cases.gpt3.paddle import weights as gpt3_weights

        config = gpt3_model.gpt_config(self.s, self.s.layout.tp, self.tp_rank, self.flash)
        model = gpt3_model.build_model(self.s, config)
        # the same full starting weights whatever the layout, before AMP and the parallel wrappers
        self.timed_weights(lambda: gpt3_weights.init_weights(model, self.s, self.tp_rank))
        return model

    def local_param_count(self, model) -> int:
        from cases.gpt3.paddle import model as gpt3_model

        return gpt3_model.local_param_count(model, self.tp_rank, self.stage, self.s.layout.pp)

    def expected_params(self) -> int:
        return int(flops.param_counts(self.s.shape)["total"])

    def scheduler(self):
        from paddlenlp.transformers import CosineAnnealingWithWarmupDecay

        tr = self.s.common.train
        # warm-up from lr/warmup at step 1, as FlagPerf (last_epoch=0)
        return CosineAnnealingWithWarmupDecay(
            max_lr=tr.lr, min_lr=tr.min_lr, warmup_step=tr.lr_warmup_steps, decay_step=tr.lr_decay_steps, last_epoch=0
        )

    def decays(self, name: str, parameter_name: str) -> bool:
        return not any(k in name for k in ("bias", "norm"))

    def autocast(self):
        import paddle

        if self.amp_dtype is None:
            return contextlib.nullcontext()
        level = self.s.own.amp_level
        return paddle.amp.auto_cast(
            enable=True,
            custom_white_list=["lookup_table", "lookup_table_v2"] if level == "O2" else [],
            custom_black_list=["reduce_sum", "c_softmax_with_cross_entropy"],
            level=level,
            dtype=self.amp_dtype,
        )

    def forward(self, x, y):
        loss, _ = self.model(x, labels=y)
        return loss

    def make_batches(self):
        from cases.gpt3.paddle import data as gpt3_data

        prefix, desc = gpt3_data.corpus_prefix(self.s, self.dist.local_rank, self.barrier)
        return gpt3_data.StepBatches(prefix, self.s, self.data_rank), desc

    def parallel_meta(self) -> dict:
        lay = self.s.layout
        return dict(
            dp_degree=lay.dp_degree,
            sharding_stage=lay.sharding_stage,
            sharding_degree=lay.sharding_degree,
            recompute=lay.recompute,
            flash_attention=self.flash,
            use_fused_rms_norm=lay.use_fused_rms_norm,
            fuse_attention_qkv=lay.fuse_attention_qkv,
            sequence_parallel=lay.sequence_parallel,
        )

    def meta(self) -> dict:
        from cases.gpt3.paddle import model as gpt3_model

        s = self.s
        return {
            "framework_version": gpt3_model.framework_version(),
            "amp_level": s.own.amp_level if s.common.train.precision != "fp32" else None,
            "inert_options": gpt3_model.inert_flags(s, self.flash),
        }


def ceiling_only(cfg: dict, log) -> None:
    from cases.gpt3.paddle import ceiling as case_ceiling

    case_ceiling.ceiling_only(cfg, log)


if __name__ == "__main__":
    paddle_loop.main(Trainer, ceiling_only=ceiling_only)
