"""LLaVA-1.5 on DeepSpeed: the pretrain and finetune phases of one round.

Run by the deepspeed launcher on every rank, repository root on PYTHONPATH::

    deepspeed --num_gpus N cases/llava/deepspeed/train.py --config resolved.json

pretrain  trains the projector only (vision tower and language model frozen),
          ZeRO-2, the ``plain`` template on caption pairs;
finetune  trains projector + language model (vision tower frozen), ZeRO-3,
          the ``vicuna_v1`` template on multi-turn conversations; it starts from
          the weights the pretrain phase ended with.

The pretrain phase's model starts from ``training.deepspeed_weights`` (the same
full weights from the run's seed under ZeRO-2 or ZeRO-3 and any data-parallel
size), overwritten by checkpoints where ``data`` names them.

Phase settings: ``cfg[section]`` overlaid with ``cfg["phases"][phase][section]``
(see case.yaml).  Data: LLaVA's JSON + image folder under ``data.data_dir``
(``phases.<p>.data.json`` / ``image_folder``), else a synthetic set in the same
format written to ``data.cache_dir``.  Tokens of a step: the real (unpadded)
lengths of its samples, image tokens included, summed over all ranks.
"""

from __future__ import annotations

import os
import sys

from training import runtime
from training.metriclog import EV_INFO, MetricLogger

cfg = runtime.setup()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from training import deepspeed_loop as dsl  # noqa: E402
from training import deepspeed_weights as dsw  # noqa: E402
from training.data import llava as data_llava  # noqa: E402
from training.data import llava_synth  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llava_mmmu  # noqa: E402
import llava_model  # noqa: E402

PHASES = ("pretrain", "finetune")


def make_tokenizer(shape: dict, data: dict) -> tuple[data_llava.Tokenizer, str]:
    path = data.get("tokenizer_path") or data.get("model_path") or data.get("language_model_path")
    if path:
        tok = data_llava.HFTokenizer(path)
        image_id = int(shape["image_token_index"])
        size = len(tok.tok)
        data_llava.check_tokenizer(size, int(shape["vocab_size"]), image_id,
                                   tok.tok.convert_ids_to_tokens(image_id) if image_id < size else None, f"tokenizer {path}")
        return tok, f"hf:{path}"
    if data.get("data_dir"):
        raise ValueError("data.data_dir is set but no tokenizer is: set data.tokenizer_path (or data.model_path) "
                         "to a folder with the Vicuna/llava-hf tokenizer files")
    tok = data_llava.WordTokenizer(llava_synth.vocabulary_words(), int(shape["vocab_size"]),
                                   reserved=[int(shape["image_token_index"])])
    return tok, "word"


def dataset_paths(data: dict, phase: str, local_rank: int) -> tuple[str, str]:
    """(json, image folder) of a phase: the real set, or the synthetic one (written by each node's local rank 0)."""
    if data.get("data_dir"):
        root = data["data_dir"]
        return os.path.join(root, data["json"]), os.path.join(root, data.get("image_folder", "."))
    args = (data["cache_dir"], int(data["synthetic_images"]), int(data["synthetic_image_size"]),
            int(data.get("synthetic_seed", 1234)))
    if local_rank == 0:
        llava_synth.ensure_synthetic(*args)
    dist.barrier()
    root = llava_synth.ensure_synthetic(*args)  # finds the finished set
    name = llava_synth.PRETRAIN_JSON if phase == "pretrain" else llava_synth.FINETUNE_JSON
    return os.path.join(root, name), os.path.join(root, llava_synth.IMAGE_FOLDER)


def starting_weights(model, shape: dict, seed: int, data: dict, device: torch.device) -> dict:
    """The first phase's model: the same full weights from ``seed`` whatever the ZeRO stage and
    data-parallel size, then the checkpoints ``data`` names, if any."""
    rule = llava_model.init_rule(shape)
    init = dsw.starting_weights(model, seed, rule, device)
    loaded = llava_model.load_pretrained(
        model, data, lambda name, p: dsw.initial_value(seed, name, dsw.full_shape(p), rule(name), device))
    return {"init": init, **loaded}


class Counting:
    """Passes micro-batches through, counting samples, tokens and images."""

    def __init__(self, it):
        self.it, self.samples, self.tokens, self.images = iter(it), 0, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.it)
        self.samples += int(b["input_ids"].shape[0])
        self.tokens += int(b["num_tokens"])
        self.images += int(b["num_images"])
        return b


def main() -> None:
    device = dsl.init_distributed(cfg)
    info = runtime.dist_info()
    rank, world = dist.get_rank(), dist.get_world_size()
    logger = MetricLogger(rank=rank)
    # resolved.json holds the shape flat in "model" (or under "model.shape")
    shape, model_name = cfg["model"].get("shape") or cfg["model"], cfg["case"]["model"]
    n_img = llava_model.num_image_tokens(shape)
    tok, tok_kind = make_tokenizer(shape, dsl.phase_settings(cfg, "pretrain")["data"])
    previous = None
    for phase in PHASES:
        s = dsl.phase_settings(cfg, phase)
        tr, data = s["train"], s["data"]
        ds_config = dsl.build_ds_config(s, int(shape["hidden_size"]), world)
        dtype = dsl.DTYPES[tr.get("precision", "bf16")]
        zero3 = ds_config["zero_optimization"]["stage"] == 3
        model = llava_model.build_model(shape, dtype, device, dsl.model_init_context(ds_config) if zero3 else None)
        if previous is None:
            weights = starting_weights(model, shape, int(tr.get("seed", 1234)), data, device)
            if rank == 0:
                logger.emit(EV_INFO, "weights", {"phase": phase, **weights})
        else:
            llava_model.copy_model(model, previous)
            previous = None
            dsl.release(None)
        json_path, image_folder = dataset_paths(data, phase, info.local_rank)
        dataset = data_llava.LlavaDataset(
            json_path, image_folder, tok, template=data["template"], image_token_id=int(shape["image_token_index"]),
            num_image_tokens=n_img, image_size=int(shape["image_size"]), max_len=int(shape["seq_length"]),
            aspect=data.get("image_aspect_ratio", "square"), missing_images=data.get("missing_images") or "fail")
        ga = ds_config["gradient_accumulation_steps"]
        order = list(data_llava.rank_batches(len(dataset), seed=int(tr.get("seed", 1234)), dp_rank=rank,
                                             dp_size=world, micro_batch=int(tr["micro_batch"]), grad_accum=ga,
                                             steps=int(tr["steps"])))
        workers = int(data.get("num_workers", 0))
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=order, collate_fn=data_llava.Collator(tok.pad_id), num_workers=workers,
            pin_memory=device.type == "cuda", persistent_workers=False, prefetch_factor=4 if workers else None)
        batches = Counting(loader)
        meta = {"model": model_name, "params_exact": sum(int(getattr(p, "ds_numel", p.numel()))
                                                         for p in model.parameters()),
                "params_nominal": float(cfg["model"]["params_nominal"]), "num_layers": int(shape["num_layers"]),
                "hidden_size": int(shape["hidden_size"]), "num_heads": int(shape["num_heads"]),
                "num_kv_groups": int(shape.get("num_kv_groups") or shape["num_heads"]),
                "seq_length": int(shape["seq_length"]), "vocab_size": int(shape["vocab_size"]),
                "vision_num_layers": int(shape["vision_num_layers"]), "image_size": int(shape["image_size"]),
                "image_tokens": n_img, "template": data["template"], "tokenizer": tok_kind,
                "data": "real" if data.get("data_dir") else "synthetic", "dataset_samples": len(dataset),
                "skipped_missing_images": dataset.skipped,
                "attention": "sdpa", "zero_stage_requested": ds_config["zero_optimization"]["stage"]}
        result = dsl.run_phase(cfg, phase, model, batches, ds_config=ds_config, logger=logger, meta=meta,
                               trainable=llava_model.trainable(phase))
        counts = torch.tensor([batches.samples, batches.tokens, batches.images], dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        if rank == 0:
            logger.emit(EV_INFO, "phase_summary", {
                "phase": phase, "samples": int(counts[0]), "mean_seq_length": float(counts[1] / counts[0]),
                "images_per_sample": float(counts[2] / counts[0]), "first_loss": result.losses[0],
                "last_loss": result.losses[-1]})
        if phase == "pretrain":
            previous = result.engine.module
        dsl.release(result)
        del model, loader, batches
    llava_mmmu.run_or_skip(cfg, logger, device, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
