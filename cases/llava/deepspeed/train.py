"""LLaVA-1.5 on DeepSpeed: the pretrain and finetune phases of one round.

Run by DeepSpeed's per-node launcher on every rank (run_benchmarks/planning/launchers.py),
repository root on PYTHONPATH; by hand, the same as::

    deepspeed --num_gpus N cases/llava/deepspeed/train.py --config resolved.json

pretrain  trains the projector only (vision tower and language model frozen),
          ZeRO-2, the ``plain`` template on caption pairs;
finetune  trains projector + language model (vision tower frozen), ZeRO-3,
          the ``vicuna_v1`` template on multi-turn conversations; it starts from
          the weights the pretrain phase ended with.

The pretrain phase's model starts from ``training.deepspeed_weights`` (the same
full weights from the run's seed under ZeRO-2 or ZeRO-3 and any data-parallel
size), overwritten by checkpoints where ``data`` names them.

Each phase is a trainer on the lifecycle of training/case.py (build, step,
finish), the training itself the shared DeepSpeed loop's
(``training.deepspeed_loop.DeepSpeedPhase``).  Phase settings: each section
overlaid with its ``phases.<phase>`` entry (training/settings.py, see case.yaml).  Data: LLaVA's JSON + image folder under ``data.data_dir``
(``phases.<p>.data.json`` / ``image_folder``), else a synthetic set in the same
format written to ``data.cache_dir``.  Tokens of a step: the real (unpadded)
lengths of its samples, image tokens included, summed over all ranks.

Speed switches of the language model, per phase (``settings.py`` checks them, ``model.py``
applies them before the engine starts, ``run_meta`` reports them):
``parallel.fused_elementwise`` (none | compile | liger), ``parallel.fused_rope`` (none | compile) and
``parallel.recompute_num_layers``.

Before each phase's model is built, every rank times that phase's kernel ceiling on its
device (``ceiling.py``, training/ceiling.py; the phase's run_meta ``kernel_ceiling``; the
allocator's peak is reset after, when the engine has started). ``--ceiling`` times both
phases' alone, on the first device, with no process group, model or data
(``start_task.py --ceiling``).
"""

from __future__ import annotations

import os
import sys

from training import case, runtime

case.isolate(__file__)
from cases.llava.deepspeed.settings import PHASES  # noqa: E402
from training.metriclog import K_KERNEL_CEILING, MetricLogger  # noqa: E402


def make_tokenizer(shape: dict, data: dict):
    from training.data import llava as data_llava
    from training.data import llava_synth

    path = data.get("tokenizer_path") or data.get("model_path") or data.get("language_model_path")
    if path:
        tok = data_llava.HFTokenizer(path)
        image_id = int(shape["image_token_index"])
        size = len(tok.tok)
        data_llava.check_tokenizer(
            size,
            int(shape["vocab_size"]),
            image_id,
            tok.tok.convert_ids_to_tokens(image_id) if image_id < size else None,
            f"tokenizer {path}",
        )
        return tok, f"hf:{path}"
    if data.get("data_dir"):
        raise ValueError(
            "data.data_dir is set but no tokenizer is: set data.tokenizer_path (or data.model_path) "
            "to a folder with the Vicuna/llava-hf tokenizer files"
        )
    tok = data_llava.WordTokenizer(llava_synth.vocabulary_words(), int(shape["vocab_size"]), reserved=[int(shape["image_token_index"])])
    return tok, "word"


def dataset_paths(data: dict, phase: str, local_rank: int) -> tuple[str, str]:
    """(json, image folder) of a phase: the real set, or the synthetic one (written by each node's local rank 0)."""
    import torch.distributed as dist

    from training.data import llava_synth

    if data.get("data_dir"):
        root = data["data_dir"]
        return os.path.join(root, data["json"]), os.path.join(root, data.get("image_folder", "."))
    args = (data["cache_dir"], int(data["synthetic_images"]), int(data["synthetic_image_size"]), int(data.get("synthetic_seed", 1234)))
    if local_rank == 0:
        llava_synth.ensure_synthetic(*args)
    dist.barrier()
    root = llava_synth.ensure_synthetic(*args)  # finds the finished set
    name = llava_synth.PRETRAIN_JSON if phase == "pretrain" else llava_synth.FINETUNE_JSON
    return os.path.join(root, name), os.path.join(root, llava_synth.IMAGE_FOLDER)


def starting_weights(model, shape: dict, seed: int, data: dict, device) -> dict:
    """The first phase's model: the same full weights from ``seed`` whatever the ZeRO stage and
    data-parallel size, then the checkpoints ``data`` names, if any."""
    from cases.llava.deepspeed import model as llava_model
    from training import deepspeed_weights as dsw

    rule = llava_model.init_rule(shape)
    init = dsw.starting_weights(model, seed, rule, device)
    loaded = llava_model.load_pretrained(model, data, lambda name, p: dsw.initial_value(seed, name, dsw.full_shape(p), rule(name), device))
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


class Round:
    """What the phases of one round share: the device, the tokenizer, the pretrained model."""

    def __init__(self, cfg: dict, log: MetricLogger):
        self.cfg, self.log = cfg, log
        self.device = None
        self.previous = None  # the pretrain phase's trained module, the finetune phase's start

    def start(self) -> None:
        import torch.distributed as dist

        from cases.llava.deepspeed import model as llava_model
        from cases.llava.deepspeed import settings as llava_settings
        from training import deepspeed_loop as dsl
        from training import settings

        if self.device is not None:
            return
        self.device = dsl.init_distributed(self.cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log.rank = self.rank
        # resolved.json holds the shape flat in "model": read whole and checked (training/shapes.py)
        self.shape = llava_settings.shape(self.cfg["model"]).as_dict()
        llava_settings.check(self.cfg, self.world)  # every phase's settings, before the first one trains
        self.n_img = llava_model.num_image_tokens(self.shape)
        self.tok, self.tok_kind = make_tokenizer(self.shape, settings.phase_sections(self.cfg, "pretrain")["data"])


class PhaseTrainer:
    """One phase of the round (training/case.py's lifecycle)."""

    def __init__(self, rnd: Round, phase: str):
        self.rnd, self.phase = rnd, phase
        self.steps, self.reporting = 0, False

    def build(self) -> None:
        import torch

        from cases.llava.deepspeed import ceiling as llava_ceiling
        from cases.llava.deepspeed import model as llava_model
        from cases.llava.deepspeed import settings as llava_settings
        from training import deepspeed_loop as dsl
        from training import settings
        from training.accelerator import Accelerator
        from training.data import llava as data_llava

        rnd, phase = self.rnd, self.phase
        rnd.start()
        cfg, shape, device, rank, world = rnd.cfg, rnd.shape, rnd.device, rnd.rank, rnd.world
        c = settings.from_config(cfg, world, phase)
        switches = llava_settings.speed_switches(c, int(shape["num_layers"]))
        tr, data = c.train, c.sections["data"]
        ds_config = dsl.build_ds_config(c, int(shape["hidden_size"]))
        zero3 = ds_config["zero_optimization"]["stage"] == 3
        # this phase's kernel ceiling, on every rank's device at once, before its model exists
        kernel_ceiling = llava_ceiling.kernel_ceiling(c, shape, device, Accelerator(cfg.get("vendor") or {}))
        model = llava_model.build_model(shape, dsl.DTYPES[tr.precision], device, dsl.model_init_context(ds_config) if zero3 else None)
        llava_model.apply_speed_switches(model, **switches)
        if rnd.previous is None:
            weights = starting_weights(model, shape, tr.seed, data, device)
            if rank == 0:
                rnd.log.info("weights", weights, phase=phase)
        else:
            llava_model.copy_model(model, rnd.previous)
            rnd.previous = None
            dsl.release(None, device)  # the pretrained module's memory back to the device
        json_path, image_folder = dataset_paths(data, phase, runtime.dist_info().local_rank)
        dataset = data_llava.LlavaDataset(
            json_path,
            image_folder,
            rnd.tok,
            template=data["template"],
            image_token_id=int(shape["image_token_index"]),
            num_image_tokens=rnd.n_img,
            image_size=int(shape["image_size"]),
            max_len=int(shape["seq_length"]),
            aspect=data.get("image_aspect_ratio", "square"),
            missing_images=data.get("missing_images") or "fail",
        )
        order = list(
            data_llava.rank_batches(
                len(dataset),
                seed=tr.seed,
                dp_rank=rank,
                dp_size=world,
                micro_batch=tr.micro_batch,
                grad_accum=tr.grad_accum,
                steps=tr.steps,
            )
        )
        workers = int(data.get("num_workers", 0))
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=order,
            collate_fn=data_llava.Collator(rnd.tok.pad_id),
            num_workers=workers,
            pin_memory=Accelerator.of(device).pin_memory,  # page-locked batches for an accelerator
            persistent_workers=False,
            prefetch_factor=4 if workers else None,
        )
        self.batches = Counting(self.loader)
        meta = {
            "model": c.model_name,
            "params_exact": sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()),
            "params_nominal": c.params_nominal,
            "num_layers": int(shape["num_layers"]),
            "hidden_size": int(shape["hidden_size"]),
            "num_heads": int(shape["num_heads"]),
            "num_kv_groups": int(shape.get("num_kv_groups") or shape["num_heads"]),
            "seq_length": int(shape["seq_length"]),
            "vocab_size": int(shape["vocab_size"]),
            "vision_num_layers": int(shape["vision_num_layers"]),
            "image_size": int(shape["image_size"]),
            "image_tokens": rnd.n_img,
            "template": data["template"],
            "tokenizer": rnd.tok_kind,
            "data": "real" if c.data.data_dir else "synthetic",
            "dataset_samples": len(dataset),
            "skipped_missing_images": dataset.skipped,
            "attention": "sdpa",
            "fused_elementwise": switches["fused_elementwise"],
            "recompute_num_layers": switches["recompute_num_layers"],
            "fused_rope": switches["fused_rope"],
            "zero_stage_requested": ds_config["zero_optimization"]["stage"],
            K_KERNEL_CEILING: kernel_ceiling,
        }
        self.loop = dsl.DeepSpeedPhase(
            cfg, c, model, self.batches, ds_config=ds_config, logger=rnd.log, meta=meta, trainable=llava_model.trainable(phase)
        )
        self.loop.build()
        self.steps, self.reporting = tr.steps, rank == 0

    def step(self, step: int) -> None:
        self.loop.step(step)

    def finish(self) -> None:
        import torch
        import torch.distributed as dist

        from training import deepspeed_loop as dsl

        rnd, result, b = self.rnd, self.loop.result, self.batches
        self.loop.finish()
        counts = torch.tensor([b.samples, b.tokens, b.images], dtype=torch.float64, device=rnd.device)
        dist.all_reduce(counts)
        if rnd.rank == 0:
            rnd.log.info(
                "phase_summary",
                {
                    "samples": int(counts[0]),
                    "mean_seq_length": float(counts[1] / counts[0]),
                    "images_per_sample": float(counts[2] / counts[0]),
                    "first_loss": result.losses[0],
                    "last_loss": result.losses[-1],
                },
                phase=self.phase,
            )
        if self.phase == "pretrain":
            rnd.previous = result.engine.module
        dsl.release(result)
        del self.loop, self.loader, self.batches


def main() -> None:
    cfg = runtime.setup()  # the vendor adapter runs before deepspeed is imported
    log = MetricLogger()
    if "--ceiling" in sys.argv[1:]:
        from cases.llava.deepspeed import ceiling as llava_ceiling

        llava_ceiling.ceiling_only(cfg, log, PHASES)
        return
    rnd = Round(cfg, log)
    case.run(lambda phase: PhaseTrainer(rnd, phase), log, phases=PHASES, cfg=cfg)
    import torch.distributed as dist

    from cases.llava.deepspeed import mmmu

    mmmu.run_or_skip(cfg, log, rnd.device, rnd.rank)
    dist.barrier()
    dist.destroy_process_group()
    runtime.leave()


if __name__ == "__main__":
    main()
