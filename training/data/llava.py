"""LLaVA's data format: JSON conversations + an image folder, to model batches.

A record is LLaVA's::

    {"id": "...", "image": "sub/dir/file.jpg",          # absent: text-only sample
     "conversations": [{"from": "human", "value": "<image>\\nWhat is ...?"},
                       {"from": "gpt", "value": "..."}, ...]}

Two prompt templates, as LLaVA-1.5 trains them:

``plain``      (pretrain) ``<image>`` + the caption + ``\\n``; the human turn's
               text is dropped, loss on the caption only.
``vicuna_v1``  (finetune) ``SYSTEM USER: <q> ASSISTANT: <a></s>USER: ...``;
               loss on the assistant answers (and their ``</s>``) only.

``<image>`` becomes ``num_image_tokens`` copies of the model's image token id
(576 for CLIP ViT-L/14 at 336 px); those count as tokens of the sample.

Tokenizers: :class:`WordTokenizer` is the project's own deterministic
word/byte tokenizer for the synthetic set (ids: 0 unk/pad, 1 ``<s>``,
2 ``</s>``, 3..258 the bytes, then the grammar's words); :func:`load_tokenizer`
wraps a real Hugging Face tokenizer from a path instead.

Standard library + numpy + torch; PIL is imported where images are read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from training.data.llava_schema import (  # noqa: F401  (re-exported: the schema is part of the format)
    MISSING_IMAGES,
    ROLES,
    check_records,
    check_tokenizer,
    entry_problem,
    find_missing_images,
    read_records,
)

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VICUNA_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
TEMPLATES = ("plain", "vicuna_v1")


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...


class WordTokenizer:
    """Word-level over a fixed word list, UTF-8 byte fallback for anything else."""

    _PIECE = re.compile(r" ?[A-Za-z']+| ?[0-9]| ?[^\sA-Za-z0-9]|\s")
    bos_id, eos_id, pad_id = 1, 2, 0
    BYTE0 = 3

    def __init__(self, words: Sequence[str], vocab_size: int, reserved: Sequence[int] = ()):
        pieces: list[str] = []
        for w in words:
            pieces += [w, " " + w]
        self.first_word = self.BYTE0 + 256
        self.ids = {p: self.first_word + i for i, p in enumerate(pieces)}
        top = self.first_word + len(pieces)
        if top > vocab_size or any(self.first_word <= r < top for r in reserved):
            raise ValueError(
                f"word tokenizer needs ids < {top} free of {sorted(reserved)} within vocab {vocab_size}: "
                "raise vocab_size or move image_token_index above the word ids"
            )
        self.pieces = {i: p for p, i in self.ids.items()}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._PIECE.findall(text):
            tid = self.ids.get(piece)
            if tid is None:
                out += [self.BYTE0 + b for b in piece.encode("utf-8")]
            else:
                out.append(tid)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        buf = bytearray()
        for i in ids:
            if self.BYTE0 <= i < self.first_word:
                buf.append(i - self.BYTE0)
            elif i in self.pieces:
                buf += self.pieces[i].encode("utf-8")
        return buf.decode("utf-8", errors="replace")


class HFTokenizer:
    """A real tokenizer (e.g. Vicuna's sentencepiece) from a local path."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # framework import, only when a path is given

        self.tok = AutoTokenizer.from_pretrained(path)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.unk_token_id
        self.pad_id = pad if pad is not None else 0

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def encode_with_images(text: str, tok: Tokenizer, image_token_id: int, num_image_tokens: int) -> list[int]:
    out: list[int] = []
    for i, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            out += [image_token_id] * num_image_tokens
        if chunk:
            out += tok.encode(chunk)
    return out


def encode_conversation(
    conversations: list[dict[str, str]],
    tok: Tokenizer,
    template: str,
    has_image: bool,
    image_token_id: int,
    num_image_tokens: int,
    max_len: int,
) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, image_kept) of one record, truncated to ``max_len``."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; one of {TEMPLATES}")
    enc = lambda s: encode_with_images(s, tok, image_token_id, num_image_tokens)
    ids, labels = [tok.bos_id], [IGNORE_INDEX]

    def add(piece: list[int], train: bool) -> None:
        ids.extend(piece)
        labels.extend(piece if train else [IGNORE_INDEX] * len(piece))

    if template == "plain":
        add(enc(IMAGE_PLACEHOLDER) if has_image else [], False)
        add(enc(conversations[1]["value"] + "\n"), True)
    else:
        turns = [dict(t) for t in conversations]
        if has_image and IMAGE_PLACEHOLDER not in turns[0]["value"]:
            turns[0]["value"] = IMAGE_PLACEHOLDER + "\n" + turns[0]["value"]
        if not has_image:
            for t in turns:
                t["value"] = t["value"].replace(IMAGE_PLACEHOLDER, "").strip()
        add(enc(VICUNA_SYSTEM + " "), False)
        for t in turns:
            if t["from"] == "human":
                add(enc("USER: " + t["value"] + " ASSISTANT:"), False)
            else:
                add(enc(" " + t["value"]), True)
                add([tok.eos_id], True)
    ids, labels = ids[:max_len], labels[:max_len]
    n_img = sum(1 for i in ids if i == image_token_id)
    kept = has_image and n_img == num_image_tokens
    if n_img and not kept:  # truncation cut into the image: drop the image tokens
        keep = [k for k, i in enumerate(ids) if i != image_token_id]
        ids, labels = [ids[k] for k in keep], [labels[k] for k in keep]
    return ids, labels, kept


def load_image(path: Any, image_size: int, aspect: str = "square") -> np.ndarray:
    """CLIP's preprocessing: (``pad``: to a square of the mean colour,) resize the
    short side, centre crop, scale, normalise. Returns float32 [3, S, S]."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    if aspect == "pad" and img.width != img.height:
        side = max(img.size)
        bg = Image.new("RGB", (side, side), tuple(int(m * 255) for m in CLIP_MEAN))
        bg.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
        img = bg
    scale = image_size / min(img.size)
    w, h = max(image_size, round(img.width * scale)), max(image_size, round(img.height * scale))
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    left, top = (w - image_size) // 2, (h - image_size) // 2
    img = img.crop((left, top, left + image_size, top + image_size))
    arr = np.asarray(img, dtype=np.float32) / 255.0
    arr = (arr - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


class LlavaDataset(torch.utils.data.Dataset):
    """Records of one LLaVA JSON file, tokenized on access.

    The file is checked against LLaVA's schema when read (the first bad entry named);
    entries whose image file is missing stop the run (``missing_images="fail"``) or are
    left out and counted in ``skipped`` (``"skip"``).
    """

    def __init__(
        self,
        json_path: str,
        image_folder: str,
        tok: Tokenizer,
        *,
        template: str,
        image_token_id: int,
        num_image_tokens: int,
        image_size: int,
        max_len: int,
        aspect: str = "square",
        missing_images: str = "fail",
    ):
        if missing_images not in MISSING_IMAGES:
            raise ValueError(f"data.missing_images {missing_images!r}: one of {', '.join(MISSING_IMAGES)}")
        records = read_records(json_path)
        check_records(records, json_path, template)
        gone = find_missing_images(records, image_folder)
        if gone and missing_images == "fail":
            first = os.path.normpath(os.path.join(image_folder, records[gone[0]]["image"]))
            raise FileNotFoundError(
                f"{first}: image of entry {gone[0]} of {json_path} is missing ({len(gone)} of the "
                f"{sum(1 for r in records if 'image' in r)} images are; data.missing_images: skip "
                "leaves their entries out)"
            )
        dropped = set(gone)
        self.records: list[dict[str, Any]] = [r for i, r in enumerate(records) if i not in dropped]
        self.skipped = len(gone)
        self.json_path = json_path
        self.image_folder, self.tok, self.template = image_folder, tok, template
        self.image_token_id, self.num_image_tokens = image_token_id, num_image_tokens
        self.image_size, self.max_len, self.aspect = image_size, max_len, aspect

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rec = self.records[i]
        has_image = "image" in rec
        ids, labels, kept = encode_conversation(
            rec["conversations"], self.tok, self.template, has_image, self.image_token_id, self.num_image_tokens, self.max_len
        )
        pixels = None
        if kept:
            path = os.path.join(self.image_folder, rec["image"])
            try:
                pixels = torch.from_numpy(load_image(path, self.image_size, self.aspect))
            except (OSError, ValueError) as exc:  # PIL: unreadable or truncated image files
                raise ValueError(
                    f"{path}: cannot be read as an image ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                ) from None
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long), "pixel_values": pixels}


class Collator:
    """Right-pads to the longest sample of the micro-batch (as LLaVA does).

    ``num_tokens`` is the sum of the samples' real lengths (image tokens
    included, padding excluded): the tokens a step is credited with.
    """

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 8):
        self.pad_id, self.multiple = pad_id, pad_to_multiple_of

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(s["input_ids"]) for s in samples]
        width = -(-max(lengths) // self.multiple) * self.multiple
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for k, s in enumerate(samples):
            ids[k, : lengths[k]] = s["input_ids"]
            labels[k, : lengths[k]] = s["labels"]
            mask[k, : lengths[k]] = 1
        pixels = [s["pixel_values"] for s in samples if s["pixel_values"] is not None]
        return {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": mask,
            "pixel_values": torch.stack(pixels) if pixels else None,
            "num_tokens": int(sum(lengths)),
            "num_images": len(pixels),
        }


def rank_batches(
    num_samples: int, *, seed: int, dp_rank: int, dp_size: int, micro_batch: int, grad_accum: int, steps: int
) -> Iterator[list[int]]:
    """This rank's micro-batches of sample indices, ``steps * grad_accum`` of them.

    Each optimizer step consumes ``micro_batch * grad_accum * dp_size``
    consecutive entries of a seeded permutation (a new one per epoch); rank
    ``r``'s micro-batch ``m`` is the ``(m * dp_size + r)``-th slice of it.
    """
    per_step = micro_batch * grad_accum * dp_size
    order: np.ndarray = np.empty(0, dtype=np.int64)
    epoch = 0
    for _ in range(steps):
        while len(order) < per_step:
            order = np.concatenate([order, np.random.default_rng([seed, epoch]).permutation(num_samples)])
            epoch += 1
        chunk, order = order[:per_step], order[per_step:]
        for m in range(grad_accum):
            k = m * dp_size + dp_rank
            yield chunk[k * micro_batch : (k + 1) * micro_batch].tolist()
