"""LLaVA's JSON schema, checked: the entries of a phase's file, their images, the tokenizer's size.

Standard library only, so the host's pre-launch check (``run_benchmarks/planning/datacheck.py``) and the
ranks' reader (``training.data.llava``) apply the same rules.  An entry is::

    {"id": "...", "image": "sub/dir/file.jpg",          # absent: a text-only entry
     "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}, ...]}

with turns alternating human, gpt (as LLaVA's preprocessing asserts).
"""

from __future__ import annotations

import json
import os
from typing import Any

IMAGE_PLACEHOLDER = "<image>"


ROLES = ("human", "gpt")
MISSING_IMAGES = ("fail", "skip")


def read_records(json_path: str) -> list[Any]:
    """A phase's JSON file as a list of entries; ValueError naming the file (and line) otherwise."""
    try:
        with open(json_path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(f"{json_path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{json_path}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{json_path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(data, list):
        raise ValueError(
            f"{json_path}: a JSON {type(data).__name__}, expected a list of entries "
            "({'id', 'image', 'conversations': [{'from', 'value'}, ...]})"
        )
    return data


def entry_problem(rec: Any, template: str) -> str | None:
    """What is wrong with one entry under LLaVA's schema, or None."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    conv = rec.get("conversations")
    if not isinstance(conv, list):
        return f"no 'conversations' list (keys: {', '.join(sorted(map(str, rec))) or 'none'})"
    if len(conv) < 2:
        return f"'conversations' holds {len(conv)} turn(s); at least a human turn and a gpt turn are needed"
    for k, turn in enumerate(conv):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or turn.get("from") not in ROLES:
            return f"conversations[{k}] is not {{'from': 'human' | 'gpt', 'value': <text>}}: {json.dumps(turn)[:80]}"
        if turn["from"] != ROLES[k % 2]:
            return f"conversations[{k}] is from {turn['from']!r}; turns alternate human, gpt, human, ..."
    if "image" in rec and (not isinstance(rec["image"], str) or not rec["image"]):
        return f"'image' is {json.dumps(rec['image'])[:60]}, not a file name"
    if template == "plain" and "image" in rec and IMAGE_PLACEHOLDER not in conv[0]["value"]:
        return f"an image entry whose first turn holds no {IMAGE_PLACEHOLDER} (the plain template's caption pairs do)"
    return None


def check_records(records: list[Any], json_path: str, template: str) -> None:
    """ValueError naming the file and the first entry that does not fit the schema."""
    for i, rec in enumerate(records):
        problem = entry_problem(rec, template)
        if problem:
            rid = f" (id {rec.get('id')!r})" if isinstance(rec, dict) and "id" in rec else ""
            raise ValueError(f"{json_path}: entry {i}{rid}: {problem}")
    if not records:
        raise ValueError(f"{json_path}: no entries")


def find_missing_images(records: list[dict[str, Any]], image_folder: str) -> list[int]:
    """Indices of the entries whose image file is not there."""
    return [i for i, r in enumerate(records) if "image" in r and not os.path.isfile(os.path.join(image_folder, r["image"]))]


def check_tokenizer(size: int, vocab_size: int, image_token_id: int, token_at_image_id: str | None, where: str) -> None:
    """A tokenizer of ``size`` ids fits the model: every id below its vocabulary, and the image token's id
    not a text token (it may be the tokenizer's own ``<image>``)."""
    if size > vocab_size:
        raise ValueError(f"{where}: the tokenizer has {size} ids, more than the model's vocab_size {vocab_size}")
    if token_at_image_id is not None and token_at_image_id != IMAGE_PLACEHOLDER:
        raise ValueError(
            f"{where}: the tokenizer's id {image_token_id} is {token_at_image_id!r}, which the model "
            f"takes for its image token (model.image_token_index {image_token_id})"
        )


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, at
        shift += 7


def _sentencepiece_pieces(path: str) -> list[str]:
    """The pieces of a sentencepiece ``tokenizer.model`` (ModelProto field 1, each piece's field 1),
    read from the protobuf wire format directly."""
    with open(path, "rb") as fh:
        buf = fh.read()
    pieces, at = [], 0
    try:
        while at < len(buf):
            key, at = _varint(buf, at)
            field, wire = key >> 3, key & 7
            if wire == 0:
                _, at = _varint(buf, at)
            elif wire == 1:
                at += 8
            elif wire == 5:
                at += 4
            elif wire == 2:
                n, at = _varint(buf, at)
                body, at = buf[at : at + n], at + n
                if field == 1:
                    piece, j = "", 0
                    while j < len(body):
                        k, j = _varint(body, j)
                        if k & 7 == 2:
                            m, j = _varint(body, j)
                            if k >> 3 == 1:
                                piece = body[j : j + m].decode("utf-8", errors="replace")
                            j += m
                        elif k & 7 == 0:
                            _, j = _varint(body, j)
                        elif k & 7 == 5:
                            j += 4
                        else:
                            j += 8
                    pieces.append(piece)
            else:
                raise ValueError(f"wire type {wire}")
    except (IndexError, ValueError) as exc:
        raise ValueError(f"{path}: not a sentencepiece model ({exc})") from None
    return pieces


def tokenizer_ids(folder: str) -> dict[int, str]:
    """Every id of a Hugging Face tokenizer folder and its token, from its files alone: ``tokenizer.json``
    (vocab and added tokens), else ``tokenizer.model`` (sentencepiece) with ``added_tokens.json`` and
    ``tokenizer_config.json``'s ``added_tokens_decoder``. ValueError naming the folder when it has none."""
    ids: dict[int, str] = {}
    fast = os.path.join(folder, "tokenizer.json")
    spm = os.path.join(folder, "tokenizer.model")
    if os.path.isfile(fast):
        try:
            with open(fast, encoding="utf-8") as fh:
                data = json.load(fh)
            vocab = (data.get("model") or {}).get("vocab") or {}
            if isinstance(vocab, dict):
                ids.update({int(i): str(t) for t, i in vocab.items()})
            else:  # unigram: [[piece, score], ...]
                ids.update({i: str(v[0]) for i, v in enumerate(vocab)})
            ids.update({int(t["id"]): str(t["content"]) for t in data.get("added_tokens") or []})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{fast}: not a tokenizers file ({exc})") from None
    elif os.path.isfile(spm):
        ids.update(enumerate(_sentencepiece_pieces(spm)))
    else:
        raise ValueError(f"tokenizer {folder}: neither tokenizer.json nor tokenizer.model there")
    added = os.path.join(folder, "added_tokens.json")
    config = os.path.join(folder, "tokenizer_config.json")
    try:
        if os.path.isfile(added):
            with open(added, encoding="utf-8") as fh:
                ids.update({int(i): str(t) for t, i in json.load(fh).items()})
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as fh:
                dec = json.load(fh).get("added_tokens_decoder") or {}
            ids.update({int(i): str(t.get("content")) for i, t in dec.items()})
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"tokenizer {folder}: its added tokens cannot be read ({exc})") from None
    return ids
