"""MMMU (val) accuracy of a LLaVA checkpoint, or an honest "not run".

Runs only when both ``data.mmmu_dir`` (the MMMU data set in its published
layout: ``<Subject>/validation-*.parquet``, read with pyarrow) and
``data.mmmu_checkpoint`` (a LLaVA checkpoint folder with its tokenizer, see
model.load_pretrained) are given and exist; otherwise the result is the
info record ``mmmu = {"status": "not run", "reason": ...}``, never a number.

Protocol (LLaVA-1.5's MMMU prompts, first image only, greedy):
multiple-choice: ``<image>\\n{question}\\n(A) ...\\n(B) ...\\nAnswer with the
option's letter from the given choices directly.``, scored by the highest
next-token logit among the option letters; open: ``... Answer the question
using a single word or phrase.``, up to 16 greedy tokens, right when the
normalised answer (or the number) matches.
"""

from __future__ import annotations

import ast
import glob
import io
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from cases.llava.deepspeed import settings as llava_settings
from training.data import llava as data_llava
from training.metriclog import EV_INFO, MetricLogger

LETTERS = "ABCDEFGHIJ"
PROGRESS_EVERY_S = 60.0  # an mmmu_progress record at most this often while scoring


def read_mmmu(mmmu_dir: str) -> list[dict[str, Any]]:
    """Validation records of every subject: question, options, answer, type, first image bytes."""
    import pyarrow.parquet as pq

    records = []
    for f in sorted(glob.glob(os.path.join(mmmu_dir, "*", "validation-*.parquet"))):
        subject = os.path.basename(os.path.dirname(f))
        for row in pq.read_table(f).to_pylist():
            img = row.get("image_1")
            records.append(
                {
                    "id": row["id"],
                    "subject": subject,
                    "question": row["question"],
                    "options": ast.literal_eval(row["options"]) if row.get("options") else [],
                    "answer": row["answer"],
                    "type": row["question_type"],
                    "image": img.get("bytes") if isinstance(img, dict) else img,
                }
            )
    return records


def prompt(rec: dict[str, Any]) -> str:
    q = re.sub(r"<image \d+>", "", rec["question"]).strip()
    if rec["type"] == "multiple-choice":
        opts = "\n".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(rec["options"]))
        return f"{q}\n{opts}\nAnswer with the option's letter from the given choices directly."
    return f"{q}\nAnswer the question using a single word or phrase."


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9.\- ]", "", s.lower()).strip().rstrip(".")


def open_match(pred: str, answer: str) -> bool:
    p, a = _norm(pred), _norm(str(answer))
    try:
        return round(float(re.findall(r"-?\d+\.?\d*", p)[0]), 2) == round(float(a), 2)
    except (ValueError, IndexError):
        return bool(a) and (p == a or a in p.split())


def _pixels(image: Any, size: int) -> torch.Tensor | None:
    if image is None:
        return None
    return torch.from_numpy(data_llava.load_image(io.BytesIO(image), size, "pad"))


@torch.no_grad()
def evaluate(
    model: Any,
    tok: Any,
    records: list[dict[str, Any]],
    *,
    image_token_id: int,
    num_image_tokens: int,
    image_size: int,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Score the records; ``progress(done, n)`` after each."""
    model.eval()
    right, by_subject = 0, {}
    for done, rec in enumerate(records, 1):
        pixels = _pixels(rec["image"], image_size)
        text = ("<image>\n" if pixels is not None else "") + prompt(rec)
        ids = [tok.bos_id] + data_llava.encode_with_images(
            data_llava.VICUNA_SYSTEM + " USER: " + text + " ASSISTANT:", tok, image_token_id, num_image_tokens
        )
        x = torch.tensor([ids], device=device)
        pv = None if pixels is None else pixels[None].to(device, dtype)
        if rec["type"] == "multiple-choice":
            logits = model(input_ids=x, pixel_values=pv, attention_mask=torch.ones_like(x)).logits[0, -1]
            cand = [tok.encode(" " + LETTERS[i])[-1] for i in range(len(rec["options"]))]
            ok = LETTERS[int(torch.argmax(logits[cand]))] == str(rec["answer"]).strip()
        else:
            out = []
            for _ in range(16):  # greedy, no cache: a few tokens only
                logits = model(input_ids=x, pixel_values=pv, attention_mask=torch.ones_like(x)).logits[0, -1]
                nxt = int(torch.argmax(logits))
                if nxt == tok.eos_id:
                    break
                out.append(nxt)
                x = torch.cat([x, torch.tensor([[nxt]], device=device)], dim=1)
            ok = open_match(tok.decode(out), rec["answer"])
        right += ok
        s = by_subject.setdefault(rec["subject"], [0, 0])
        s[0], s[1] = s[0] + ok, s[1] + 1
        if progress is not None:
            progress(done, len(records))
    return {
        "status": "ok",
        "accuracy": right / max(1, len(records)),
        "n": len(records),
        "by_subject": {k: v[0] / v[1] for k, v in sorted(by_subject.items())},
    }


def run_or_skip(cfg: dict, logger: MetricLogger, device: torch.device, rank: int) -> dict[str, Any]:
    """Evaluate on rank 0 when both paths are given, else report "not run"."""
    from cases.llava.deepspeed import model as llava_model

    data = cfg.get("data") or {}
    mdir, ckpt = data.get("mmmu_dir"), data.get("mmmu_checkpoint")
    missing = [k for k, v in (("data.mmmu_dir", mdir), ("data.mmmu_checkpoint", ckpt)) if not v or not os.path.exists(v)]
    result: dict[str, Any]
    if missing:
        result = {"status": "not run", "reason": f"{' and '.join(missing)} not given or not found"}
    elif rank != 0:
        return {"status": "rank 0 only"}
    else:
        try:
            shape = llava_settings.shape(cfg["model"])
            dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
            model = llava_model.build_model(shape, dtype, device)
            loaded = llava_model.load_pretrained(model, {"model_path": ckpt}, _plain_update)
            tok = data_llava.HFTokenizer(data.get("mmmu_tokenizer_path") or ckpt)
            said = [time.monotonic()]

            def progress(done: int, n: int) -> None:
                # a record now and then: the harness stops a round whose ranks say nothing
                # for its stall timeout, and the evaluation runs after the last phase's end
                if time.monotonic() - said[0] >= PROGRESS_EVERY_S:
                    logger.emit(EV_INFO, "mmmu_progress", {"done": done, "n": n})
                    said[0] = time.monotonic()

            result = evaluate(
                model,
                tok,
                read_mmmu(mdir),
                image_token_id=shape.image_token_index,
                num_image_tokens=llava_model.num_image_tokens(shape),
                image_size=shape.image_size,
                device=device,
                dtype=dtype,
                progress=progress,
            )
            result.update(checkpoint=ckpt, weights_loaded=loaded["loaded"])
        except Exception as exc:  # the training result stands; the evaluation says why it has no number
            result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    if rank == 0:
        logger.emit(EV_INFO, "mmmu", result)
    return result


def _plain_update(module: torch.nn.Module, fill, names) -> int:
    wanted, n = set(names), 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in wanted:
                fill(name, p.data)
                n += 1
    return n
