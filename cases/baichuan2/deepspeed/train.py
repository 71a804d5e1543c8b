"""Baichuan2 on DeepSpeed ZeRO stage 3: the case's entry point.

Run by the deepspeed launcher on every rank, repository root on PYTHONPATH::

    python -m deepspeed.launcher.runner --num_gpus N cases/baichuan2/deepspeed/train.py --config resolved.json

What it does: reads and checks the resolved config (``settings.py``: every key
it reads is listed there), joins the process group, builds the DeepSpeed
config from the resolved values (``training.deepspeed_loop.build_ds_config``,
its ZeRO section from ``parallel.zero``), builds
the model inside ``deepspeed.zero.Init`` when the stage is 3 (the 13B model
never exists whole on one device), overwrites its weights with the
layout-free starting weights (``training.deepspeed_weights``), and trains
with the shared DeepSpeed loop (``training.deepspeed_loop.run_phase``),
which writes ``run_meta``,
``train_step``, ``peak_memory`` and ``run_end``.  Afterwards rank 0 copies the
effective DeepSpeed config (read back from the engine) to
``<output_dir>/ds_config.json`` and reports it in an ``info`` record
``ds_config``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from training import runtime
from training.metriclog import EV_INFO, MetricLogger

cfg = runtime.setup()  # the vendor adapter runs before deepspeed is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from training import deepspeed_loop as dsl  # noqa: E402
from training import deepspeed_weights as dsw  # noqa: E402
from training.flops import decoder_flops  # noqa: E402



def _case_module(name: str):
    """A module of this folder, under a name that cannot shadow another package."""
    import importlib.util

    full = f"baichuan2_case_{name}"
    spec = importlib.util.spec_from_file_location(full, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    return mod


case_settings = _case_module("settings")
case_data = _case_module("data")
case_model = _case_module("model")

PHASE = "train"


def micro_batches(data: case_data.CaseData, steps: int, grad_accum: int):
    """Micro-batches in the loop's order: ``grad_accum`` per optimizer step."""
    tokens = data.micro_batch * data.seq_length
    for step in range(steps):
        for micro in range(grad_accum):
            input_ids, labels = data.micro_batch_tensors(step, micro)
            yield {"input_ids": input_ids, "labels": labels, "num_tokens": tokens}


def loss_fn(engine, inputs: dict) -> torch.Tensor:
    return engine(inputs["input_ids"], inputs["labels"])


def main() -> None:
    info = runtime.dist_info()
    shape = case_settings.shape(cfg)
    s = dsl.phase_settings(cfg, PHASE)
    tr = s["train"]
    # the DeepSpeed config: every value from the resolved settings (checked there)
    ds_config = dsl.build_ds_config(s, shape["hidden_size"], info.world_size)
    zero = ds_config["zero_optimization"]
    grad_accum = ds_config["gradient_accumulation_steps"]
    steps, seed = int(tr["steps"]), int(tr.get("seed", 1234))

    device = dsl.init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    logger = MetricLogger(rank=rank)
    data = case_data.CaseData(
        s["data"], seq_length=shape["seq_length"], vocab_size=shape["vocab_size"],
        global_batch=int(tr["global_batch"]), micro_batch=int(tr["micro_batch"]), seed=seed,
        dp_rank=rank, dp_size=world, local_rank=info.local_rank,
    )
    dist.barrier()

    mcfg = case_model.Baichuan2Config.from_shape(shape, init_std=float(tr.get("init_std", 0.02)),
                                                 **case_model.speed_switches(s["parallel"], shape["num_layers"]))
    with dsl.model_init_context(ds_config):  # deepspeed.zero.Init under ZeRO-3
        model = case_model.Baichuan2ForCausalLM(mcfg)
    # the same full weights whatever the ZeRO stage and data-parallel size
    weights = dsw.starting_weights(model, seed, case_model.init_rule(model), device)

    name = case_settings.model_name(cfg)
    counts = decoder_flops({"shape": shape, "params_nominal": cfg["model"]["params_nominal"]})
    params_exact = case_model.count_parameters(model)
    meta = {
        "model": name,
        "config_name": cfg.get("config_name"),
        "params_exact": params_exact,
        "params_nominal": float(cfg["model"]["params_nominal"]),
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
        "attention": {"sdpa": "sdpa, ALiBi + causal additive mask", "flex": "flex, ALiBi score_mod + causal block mask"}[mcfg.attention],
        "fused_elementwise": mcfg.fused_elementwise, "recompute_num_layers": mcfg.recompute_num_layers,
        "zero_stage_requested": zero["stage"],
        "data": data.describe(),
        "init": "normal(0, init_std) per (seed, parameter name), norms ones (training.deepspeed_weights)",
        "init_weights": weights,
        "device": str(device),
    }
    result = None
    try:
        result = dsl.run_phase(
            cfg, PHASE, model, micro_batches(data, steps, grad_accum), ds_config=ds_config,
            logger=logger, meta=meta, loss_fn=loss_fn,
        )
    finally:
        if rank == 0:
            src = os.path.join(cfg["output_dir"], f"ds_config_{PHASE}.json")
            if os.path.exists(src):
                dst = os.path.join(cfg["output_dir"], "ds_config.json")
                shutil.copyfile(src, dst)
                with open(dst, encoding="utf-8") as fh:
                    effective = json.load(fh)
                logger.emit(EV_INFO, "ds_config", {"phase": PHASE, "path": dst, "config": effective})
    dsl.release(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
