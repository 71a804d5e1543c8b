"""The host time of DeepSpeed ZeRO-3 around llava's finetune step, with llava1.5_7b's number of
modules and parameter tensors (32 decoder layers, 24 vision encoder layers, 686 tensors) at
llava_tiny's widths, so the arithmetic is small and what is timed is mostly the framework's own
work on the host: one process, the CPU, the finetune phase's ZeRO-3 settings of config_H200x1x2
(parameters under 1e8 elements kept whole), micro batch 2 of 64 tokens:

    PYTHONPATH=$PWD python examples/zero3_host_time.py [leaf]

``leaf`` hooks each decoder and vision encoder layer as one unit (``zero.leaf_modules``).
Prints the seconds of forward plus backward and of ``engine.step()`` for five steps after three
warm-up steps, then the 25 functions of ``engine.step()`` with the most cumulative time
(cProfile). Needs the deepspeed environment's Python (torch, deepspeed, transformers).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch
    import yaml
    from transformers import LlavaForConditionalGeneration

    from cases.llava.deepspeed import model as llava_model

    case = yaml.safe_load((ROOT / "cases" / "llava" / "deepspeed" / "case.yaml").read_text())
    shape = dict(case["models"]["llava_tiny"]["shape"], num_layers=32, vision_num_layers=24)
    leaf = sys.argv[1:] == ["leaf"]
    deepspeed.init_distributed(dist_backend="gloo")
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 2e8,
        "stage3_param_persistence_threshold": 1e8,
    }
    if leaf:
        zero["leaf_module"] = {"classes": ["LlamaDecoderLayer", "CLIPEncoderLayer"]}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_force_ds_cpu_optimizer": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlavaForConditionalGeneration(llava_model.llava_config(shape)).to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad = not name.startswith("model.vision_tower")  # the finetune phase: the tower frozen
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"parameter tensors {sum(1 for _ in model.parameters())}, trainable {len(trainable)}, leaf modules: {leaf}")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=cfg)
    ids = torch.randint(0, 900, (2, 64))
    ids[:, 1:17] = shape["image_token_index"]  # 16 image tokens a sample, as llava_tiny's images give
    pixels = torch.randn(2, 3, shape["image_size"], shape["image_size"], dtype=torch.bfloat16)

    def step(profile: cProfile.Profile | None = None) -> tuple[float, float]:
        t0 = time.perf_counter()
        engine.backward(engine(input_ids=ids, pixel_values=pixels, labels=ids).loss)
        t1 = time.perf_counter()
        if profile:
            profile.enable()
        engine.step()
        if profile:
            profile.disable()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(3):
        step()
    times = [step() for _ in range(5)]
    print("forward+backward s:", [round(f, 4) for f, _ in times])
    print("engine.step s:     ", [round(s, 4) for _, s in times])
    profile = cProfile.Profile()
    step(profile)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()
