"""Baichuan2 on DeepSpeed ZeRO stage 3: the case's entry point.

Run by DeepSpeed's per-node launcher on every rank (run_benchmarks/planning/launchers.py),
repository root on PYTHONPATH; by hand, the same as::

    deepspeed --num_gpus N cases/baichuan2/deepspeed/train.py --config resolved.json

One phase, ``train``, on the lifecycle of training/case.py.  ``build``: reads and
checks the resolved config (``settings.py`` on top of training/settings.py), joins
the process group, builds the DeepSpeed config from the resolved values
(``training.deepspeed_loop.build_ds_config``, its ZeRO section from
``parallel.zero``), builds the model inside ``deepspeed.zero.Init`` when the stage
is 3 (the 13B model never exists whole on one device), overwrites its weights
with the layout-free starting weights (``training.deepspeed_weights``) and starts
the shared DeepSpeed loop (``training.deepspeed_loop.DeepSpeedPhase``), which
writes ``run_meta``; rank 0 then copies the effective DeepSpeed config (read back
from the engine) to ``<output_dir>/ds_config.json`` and reports it in an ``info``
record ``ds_config``.  ``step``: one optimizer step of the loop (``train_step``).
``finish``: ``peak_memory``; the engine released.

Before the model is built, every rank times the kernel ceiling of its micro batch on its
device (``ceiling.py``, training/ceiling.py; run_meta's ``kernel_ceiling``; the allocator's
peak is reset after, when the engine has started). ``--ceiling`` times it alone, on the first
device, with no process group, model or data (``start_task.py --ceiling``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from training import case, runtime

case.isolate(__file__)
from training.metriclog import K_KERNEL_CEILING, MetricLogger  # noqa: E402

PHASE = "train"


def micro_batches(data, steps: int, grad_accum: int):
    """Micro-batches in the loop's order: ``grad_accum`` per optimizer step."""
    tokens = data.micro_batch * data.seq_length
    for step in range(steps):
        for micro in range(grad_accum):
            input_ids, labels = data.micro_batch_tensors(step, micro)
            yield {"input_ids": input_ids, "labels": labels, "num_tokens": tokens}


def loss_fn(engine, inputs: dict):
    return engine(inputs["input_ids"], inputs["labels"])


class Trainer:
    """The case's one phase (training/case.py's lifecycle)."""

    def __init__(self, cfg: dict, log: MetricLogger, phase: str | None):
        self.cfg, self.log, self.phase = cfg, log, phase
        self.steps, self.reporting = 0, False

    def build(self) -> None:
        import torch.distributed as dist

        from cases.baichuan2.deepspeed import ceiling as case_ceiling
        from cases.baichuan2.deepspeed import data as case_data
        from cases.baichuan2.deepspeed import model as case_model
        from cases.baichuan2.deepspeed import settings as case_settings
        from training import deepspeed_loop as dsl
        from training import deepspeed_weights as dsw
        from training.accelerator import Accelerator
        from training.flops import decoder_flops

        cfg, info = self.cfg, runtime.dist_info()
        s = case_settings.from_config(cfg, info.world_size, PHASE)
        c, shape, tr = s.common, s.shape, s.common.train
        # the DeepSpeed config: every value from the resolved settings (checked there)
        ds_config = dsl.build_ds_config(c, shape["hidden_size"])
        device = dsl.init_distributed(cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.log.rank = rank
        # the kernel ceiling, on every rank's device at once, before the model exists
        kernel_ceiling = case_ceiling.kernel_ceiling(s, device, Accelerator(cfg.get("vendor") or {}))
        data = case_data.CaseData(
            c.sections["data"],
            seq_length=shape["seq_length"],
            vocab_size=shape["vocab_size"],
            global_batch=tr.global_batch,
            micro_batch=tr.micro_batch,
            seed=tr.seed,
            dp_rank=rank,
            dp_size=world,
            local_rank=info.local_rank,
        )
        dist.barrier()

        # the model's speed switches (parallel.attention, fused_elementwise, recompute_num_layers, fused_linear_loss)
        switches = case_model.speed_switches(c.sections["parallel"], shape["num_layers"])
        mcfg = case_model.Baichuan2Config.from_shape(shape, init_std=tr.init_std, **switches)
        with dsl.model_init_context(ds_config):  # deepspeed.zero.Init under ZeRO-3
            model = case_model.Baichuan2ForCausalLM(mcfg)
        # the same full weights whatever the ZeRO stage and data-parallel size
        weights = dsw.starting_weights(model, tr.seed, case_model.init_rule(model), device)
        counts = decoder_flops({"shape": shape, "params_nominal": c.params_nominal})
        meta = {
            "model": c.model_name,
            "config_name": cfg.get("config_name"),
            "params_exact": case_model.count_parameters(model),
            "params_nominal": c.params_nominal,
            "params_counter": counts["params_exact"],
            "flops_per_token_6n": counts["flops_per_token_6n"],
            "flops_per_token_palm": counts["flops_per_token_palm"],
            "num_layers": shape["num_layers"],
            "hidden_size": shape["hidden_size"],
            "ffn_hidden_size": shape["ffn_hidden_size"],
            "num_heads": shape["num_heads"],
            "num_kv_groups": shape["num_heads"],  # multi-head attention
            "seq_length": shape["seq_length"],
            "vocab_size": shape["vocab_size"],
            "max_position_embeddings": shape["max_position_embeddings"],
            "position_embedding": "alibi",
            "output_layer": "normhead",
            "attention": (
                "sdpa, ALiBi + causal additive mask" if switches["attention"] == "sdpa" else "flex, ALiBi score_mod + causal block mask"
            ),
            "fused_elementwise": switches["fused_elementwise"],
            "recompute_num_layers": switches["recompute_num_layers"],
            "fused_linear_loss": switches["fused_linear_loss"],
            "zero_stage_requested": ds_config["zero_optimization"]["stage"],
            "data": data.describe(),
            "init": "normal(0, init_std) per (seed, parameter name), norms ones (training.deepspeed_weights)",
            "init_weights": weights,
            "device": str(device),
            K_KERNEL_CEILING: kernel_ceiling,
        }
        self.loop = dsl.DeepSpeedPhase(
            cfg,
            c,
            model,
            micro_batches(data, tr.steps, tr.grad_accum),
            ds_config=ds_config,
            logger=self.log,
            meta=meta,
            loss_fn=loss_fn,
        )
        self.loop.build()
        self.steps, self.reporting = tr.steps, rank == 0
        if rank == 0:
            self._report_ds_config(c.output_dir)

    def _report_ds_config(self, output_dir: str) -> None:
        """The effective DeepSpeed config, copied to ``ds_config.json`` and sent as ``info``."""
        src = os.path.join(output_dir, f"ds_config_{PHASE}.json")
        dst = os.path.join(output_dir, "ds_config.json")
        shutil.copyfile(src, dst)
        with open(dst, encoding="utf-8") as fh:
            effective = json.load(fh)
        self.log.info("ds_config", {"path": dst, "config": effective}, phase=PHASE)

    def step(self, step: int) -> None:
        self.loop.step(step)

    def finish(self) -> None:
        from training import deepspeed_loop as dsl

        self.loop.finish()
        dsl.release(self.loop.result)


def main() -> None:
    cfg = runtime.setup()  # the vendor adapter runs before deepspeed is imported
    log = MetricLogger()
    if "--ceiling" in sys.argv[1:]:
        from cases.baichuan2.deepspeed import ceiling as case_ceiling

        case_ceiling.ceiling_only(cfg, log)
        return
    case.run(lambda phase: Trainer(cfg, log, phase), log, phases=(PHASE,), cfg=cfg)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    runtime.leave()


if __name__ == "__main__":
    main()
