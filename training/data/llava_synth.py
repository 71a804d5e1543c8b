"""A deterministic synthetic image-text set in LLaVA's own file format.

Images are PNGs of one to three coloured shapes on a coloured background,
drawn with numpy + PIL from a seed.  Their captions (pretrain) and
conversations (finetune) come from a small template grammar that names the
shapes, colours, sizes and positions actually drawn, so a model that looks
at the image can predict its text and the loss falls.

Layout written under ``cache_dir`` (the same layout as LLaVA's real sets, so
one loader reads both)::

    llava_synth_<digest>/
        images/00000/000000000.png ...       one pool shared by both phases
        blip_laion_cc_sbu_558k.json          pretrain: caption pairs
        llava_v1_5_mix665k.json              finetune: multi-turn conversations
        DONE                                 the spec, written last

Everything is a function of ``(num_images, image_size, seed)``; a set whose
``DONE`` marker matches is reused.  Standard library + numpy; PIL is imported
where images are drawn.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import numpy as np

PRETRAIN_JSON = "blip_laion_cc_sbu_558k.json"
FINETUNE_JSON = "llava_v1_5_mix665k.json"
IMAGE_FOLDER = "images"
SPEC_VERSION = 1

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "gray": (128, 128, 128),
    "pink": (245, 150, 190),
    "brown": (120, 70, 30),
    "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = ("small", "large")
# a 3 x 3 grid, row-major
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven")

PRETRAIN_PROMPTS = (
    "Describe the image concisely.",
    "Provide a brief description of the given image.",
    "Summarize the visual content of the image.",
    "Give a short and clear explanation of the subsequent image.",
)
CAPTIONS = (
    "a {size} {color} {shape} at the {pos} on a {bg} background",
    "{bg} background with a {size} {color} {shape} at the {pos}",
    "a picture of a {size} {color} {shape} at the {pos}, {bg} background",
)
#: the words every template and filler can produce (the word tokenizer's vocabulary)
SYSTEM_PROMPT = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
QA_TEXT = (
    "What color is the {shape}? The {shape} is {color}. Where is the {color} {shape}? "
    "The {color} {shape} is at the {pos} of the image. How many shapes are in the image? "
    "There are {n} shapes in the image. There is one shape in the image. What is the background color? "
    "The background is {bg}. Describe the image. The image shows and also "
    "Is there a {color} {shape} in the image? Yes, there is a {color} {shape} at the {pos}. "
    "No, there is no {color} {shape} in the image. What number comes after {n}? The number after {n} is {n}. "
    "USER: ASSISTANT:"
)


def vocabulary_words() -> list[str]:
    """Every word the grammar can emit, sorted (fixed order: token ids depend on it)."""
    import re

    text = " ".join((SYSTEM_PROMPT, QA_TEXT, *PRETRAIN_PROMPTS, *CAPTIONS))
    words = set(re.findall(r"[A-Za-z']+", re.sub(r"\{[a-z]+\}", " ", text)))
    words.update(COLORS, SHAPES, SIZES, NUMBER_WORDS, "with a picture of".split())
    for pos in POSITIONS:
        words.update(pos.split())
    return sorted(words)


def _scene(index: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, index])
    names = sorted(COLORS)
    bg = names[rng.integers(len(names))]
    n = int(rng.integers(1, 4))
    cells = rng.permutation(len(POSITIONS))[:n]
    shapes = []
    for cell in cells:
        color = bg
        while color == bg:
            color = names[rng.integers(len(names))]
        shapes.append(
            {"shape": SHAPES[rng.integers(len(SHAPES))], "color": color, "size": SIZES[rng.integers(len(SIZES))], "cell": int(cell)}
        )
    return {"bg": bg, "shapes": shapes, "scale": float((1.0, 1.25, 1.5)[rng.integers(3)])}


def _draw(args: tuple[str, int, int, int]) -> None:
    path, index, seed, image_size = args
    from PIL import Image, ImageDraw

    sc = _scene(index, seed)
    side = int(round(image_size * sc["scale"]))
    img = Image.new("RGB", (side, side), COLORS[sc["bg"]])
    draw = ImageDraw.Draw(img)
    cell = side / 3.0
    for s in sc["shapes"]:
        row, col = divmod(s["cell"], 3)
        cx, cy = (col + 0.5) * cell, (row + 0.5) * cell
        r = cell * (0.42 if s["size"] == "large" else 0.22)
        fill = COLORS[s["color"]]
        box = (cx - r, cy - r, cx + r, cy + r)
        if s["shape"] == "circle":
            draw.ellipse(box, fill=fill)
        elif s["shape"] == "square":
            draw.rectangle(box, fill=fill)
        elif s["shape"] == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    img.save(path, format="PNG", compress_level=1)


def _image_rel(index: int) -> str:
    return f"{index // 1000:05d}/{index:09d}.png"


def _caption(sc: dict[str, Any], rng: np.random.Generator) -> str:
    first = sc["shapes"][0]
    text = CAPTIONS[rng.integers(len(CAPTIONS))].format(
        size=first["size"], color=first["color"], shape=first["shape"], pos=POSITIONS[first["cell"]], bg=sc["bg"]
    )
    for s in sc["shapes"][1:]:
        text += f" and a {s['size']} {s['color']} {s['shape']} at the {POSITIONS[s['cell']]}"
    return text


def _qa(sc: dict[str, Any], rng: np.random.Generator) -> tuple[str, str]:
    s = sc["shapes"][rng.integers(len(sc["shapes"]))]
    pos = POSITIONS[s["cell"]]
    kind = int(rng.integers(6))
    if kind == 0:
        return f"What color is the {s['shape']}?", f"The {s['shape']} is {s['color']}."
    if kind == 1:
        return f"Where is the {s['color']} {s['shape']}?", f"The {s['color']} {s['shape']} is at the {pos} of the image."
    if kind == 2:
        n = len(sc["shapes"])
        ans = "There is one shape in the image." if n == 1 else f"There are {NUMBER_WORDS[n]} shapes in the image."
        return "How many shapes are in the image?", ans
    if kind == 3:
        return "What is the background color?", f"The background is {sc['bg']}."
    if kind == 4:
        return "Describe the image.", "The image shows " + _caption(sc, rng) + "."
    color = sorted(COLORS)[rng.integers(len(COLORS))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    hit = [t for t in sc["shapes"] if t["color"] == color and t["shape"] == shape]
    if hit:
        return f"Is there a {color} {shape} in the image?", f"Yes, there is a {color} {shape} at the {POSITIONS[hit[0]['cell']]}."
    return f"Is there a {color} {shape} in the image?", f"No, there is no {color} {shape} in the image."


def pretrain_record(index: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, index, 2])
    prompt = PRETRAIN_PROMPTS[rng.integers(len(PRETRAIN_PROMPTS))]
    human = f"<image>\n{prompt}" if rng.integers(2) else f"{prompt}\n<image>"
    return {
        "id": f"{index:09d}",
        "image": _image_rel(index),
        "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": _caption(_scene(index, seed), rng)}],
    }


def finetune_record(index: int, seed: int, text_only_every: int = 10) -> dict[str, Any]:
    rng = np.random.default_rng([seed, index, 3])
    if text_only_every and index % text_only_every == text_only_every - 1:
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(len(NUMBER_WORDS) - 1))
            turns += [
                {"from": "human", "value": f"What number comes after {NUMBER_WORDS[k]}?"},
                {"from": "gpt", "value": f"The number after {NUMBER_WORDS[k]} is {NUMBER_WORDS[k + 1]}."},
            ]
        return {"id": f"t{index:09d}", "conversations": turns}
    sc = _scene(index, seed)
    turns = []
    for t in range(int(rng.integers(1, 5))):
        q, a = _qa(sc, rng)
        turns += [{"from": "human", "value": ("<image>\n" + q) if t == 0 else q}, {"from": "gpt", "value": a}]
    return {"id": f"{index:09d}", "image": _image_rel(index), "conversations": turns}


def ensure_synthetic(cache_dir: str, num_images: int, image_size: int, seed: int, workers: int | None = None) -> str:
    """Write (or reuse) the synthetic set; returns its directory.

    Call on one process per node, then synchronise the others (which find the
    finished set). The set is written into a temporary directory and renamed
    into place, so a reader never sees a partial set; nodes sharing one cache
    directory may both write it (same content, the first rename wins).
    """
    spec = {"version": SPEC_VERSION, "num_images": int(num_images), "image_size": int(image_size), "seed": int(seed)}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    root = os.path.join(cache_dir, f"llava_synth_{digest}")
    done = os.path.join(root, "DONE")
    if _complete(done, spec):
        return root
    tmp = f"{root}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for i in range(0, num_images, 1000):
        os.makedirs(os.path.join(tmp, IMAGE_FOLDER, f"{i // 1000:05d}"), exist_ok=True)
    jobs = [(os.path.join(tmp, IMAGE_FOLDER, _image_rel(i)), i, seed, image_size) for i in range(num_images)]
    workers = workers or max(1, min(8, (os.cpu_count() or 1) - 1))
    if workers > 1 and num_images >= 256:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            list(pool.map(_draw, jobs, chunksize=64))
    else:
        for job in jobs:
            _draw(job)
    for name, make in ((PRETRAIN_JSON, pretrain_record), (FINETUNE_JSON, finetune_record)):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as fh:
            json.dump([make(i, seed) for i in range(num_images)], fh)
    with open(os.path.join(tmp, "DONE"), "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    if os.path.isdir(root) and not _complete(done, spec):
        shutil.rmtree(root, ignore_errors=True)  # a partial set left by an interrupted run
    try:
        os.replace(tmp, root)
    except OSError:  # another writer (a node sharing the cache) finished first: same content
        if not _complete(done, spec):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _complete(done: str, spec: dict[str, Any]) -> bool:
    try:
        with open(done, encoding="utf-8") as fh:
            return json.load(fh) == spec
    except (OSError, ValueError):
        return False
