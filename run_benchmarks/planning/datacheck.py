"""Pre-launch data checks, and the identity of the data a run trains on (docs/datasets.md).

Before any process starts, every phase's data is read as the case will read it and checked
whole: the files are there and complete (the ``.bin`` as long as its index says, the npy/npz
pair consistent), token ids are integers inside the model's vocabulary over the whole corpus
(a vectorized scan of the memory map), LLaVA's JSON fits the schema (the first bad entry
named), its images are there (``data.missing_images``: ``fail``, or ``skip`` and count), the
tokenizer fits the vocabulary. A problem is an :class:`InputError` naming the file: exit 2.

The case says how its data is read in ``standard.data.format`` (case.yaml): ``megatron``
(Megatron's indexed dataset, one corpus or a blend), ``paddle_gpt`` (PaddleNLP's npy/npz
pair or its mmap .bin/.idx) or ``llava`` (LLaVA JSON + image folder per phase).

The check also gives each phase's data an identity: format, files, sizes, a content hash
of the index and a sample of the tokens, and a ``fingerprint`` over them. results.json keeps
it (``data``), a reference curve records the data it was made on, and a phase whose reference
was made on other data is not judged: "no reference for this data".
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError

SYNTHETIC = "synthetic"  # the fingerprint of the harness's own synthetic data (every committed curve's)
HASH_BLOCKS, HASH_BLOCK = 64, 1 << 16  # the token sample hashed: 64 blocks of 64 KiB spread over the file


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _sample_sha(path: str) -> str:
    """A hash of the file's size and of blocks spread evenly over it (a token file may be hundreds of GiB)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        if size <= HASH_BLOCKS * HASH_BLOCK:
            h.update(fh.read())
        else:
            for k in range(HASH_BLOCKS):
                fh.seek((size - HASH_BLOCK) * k // (HASH_BLOCKS - 1))
                h.update(fh.read(HASH_BLOCK))
    return h.hexdigest()[:16]


def fingerprint(identity: dict[str, Any]) -> str:
    body = {k: v for k, v in identity.items() if k not in ("fingerprint", "dir", "skipped_missing_images", "checked")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def phase_data(data: dict[str, Any], phase: str) -> dict[str, Any]:
    """A phase's data settings: the common ones overlaid with ``data.phases.<phase>``."""
    return {**{k: v for k, v in data.items() if k != "phases"}, **(((data.get("phases") or {}).get(phase)) or {})}


def _tokens_checked(tokens: Any, path: str, vocab: int, model: str) -> dict[str, Any]:
    from training.data import corpus

    if int(tokens.shape[0]) == 0:
        raise InputError(f"{path}: holds no tokens")
    scan = corpus.scan_tokens(tokens, vocab)
    if scan["first_bad"] is not None:
        pos, value = scan["first_bad"]
        raise InputError(
            f"{path}: token id {value} at position {pos:,} is outside the model's vocabulary "
            f"[0, {vocab}) (model.vocab_size of {model}; largest id in the file {scan['max']})"
        )
    return scan


def _enough(n_tokens: int, seq: int, what: str) -> None:
    """At least one window of seq_length + 1 tokens (training.data.indexed.TokenWindows)."""
    if n_tokens < seq + 1:
        raise InputError(f"{what}: {n_tokens} tokens, fewer than the {seq + 1} of one sample (seq_length {seq} + 1)")


def _indexed(prefix: str) -> Any:
    from training.data.indexed import IndexedReader

    try:
        return IndexedReader(prefix)
    except (OSError, ValueError) as exc:
        raise InputError(str(exc)) from None


def check_megatron(data: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """Megatron indexed data: one corpus or a blend (``data.prefix``)."""
    from training.data import corpus

    try:
        blend = corpus.megatron_prefixes(str(data["data_dir"]), data.get("prefix"))
    except (OSError, ValueError) as exc:
        raise InputError(str(exc)) from None
    vocab, seq = int(shape["vocab_size"]), int(shape["seq_length"])
    head = int(float(data["max_tokens"])) if data.get("max_tokens") else None
    files = []
    total = sum(w for w, _ in blend)
    for weight, prefix in blend:
        reader = _indexed(prefix)
        tokens = reader.tokens if head is None else reader.tokens[:head]
        _tokens_checked(tokens, prefix + ".bin", vocab, model)
        _enough(int(tokens.shape[0]), seq, prefix + ".bin")
        files.append(
            {
                "prefix": os.path.basename(prefix),
                "weight": round(weight / total, 12),  # normalized: '0.3 a 0.7 b' and '3 a 7 b' are one blend
                "dtype": str(reader.dtype),
                "tokens": int(tokens.shape[0]),
                "documents": max(int(reader.document_count) - 1, 0),
                "index_sha256": _sha(prefix + ".idx"),
                "tokens_sample_sha256": _sample_sha(prefix + ".bin"),
            }
        )
    return {"kind": "real", "format": "megatron", "dir": str(data["data_dir"]), "corpora": files, **({"max_tokens": head} if head else {})}


def check_paddle_gpt(data: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """PaddleNLP's GPT corpus: the _ids.npy/_idx.npz pair or the mmap .bin/.idx."""
    from training.data import paddle_gpt

    data_dir = str(data["data_dir"])
    try:
        if data.get("prefix"):
            prefix = str(data["prefix"]) if os.path.isabs(str(data["prefix"])) else os.path.join(data_dir, str(data["prefix"]))
            for ext in (".bin", ".idx", paddle_gpt.IDS_SUFFIX, paddle_gpt.IDX_SUFFIX):
                prefix = prefix[: -len(ext)] if prefix.endswith(ext) else prefix
            if paddle_gpt.layout(prefix) is None:
                raise FileNotFoundError(
                    f"data.prefix {data['prefix']!r}: neither {prefix}{paddle_gpt.IDS_SUFFIX} + "
                    f"{prefix}{paddle_gpt.IDX_SUFFIX} nor {prefix}.bin + {prefix}.idx exist (data.data_dir {data_dir})"
                )
        else:
            prefix = paddle_gpt.find_prefix(data_dir)
        layout = paddle_gpt.layout(prefix)
        tokens = paddle_gpt.read_tokens(prefix)
    except (OSError, ValueError) as exc:
        raise InputError(str(exc)) from None
    token_file, index_file = (
        (prefix + paddle_gpt.IDS_SUFFIX, prefix + paddle_gpt.IDX_SUFFIX) if layout == "npy" else (prefix + ".bin", prefix + ".idx")
    )
    vocab, seq = int(shape["vocab_size"]), int(shape["seq_length"])
    _tokens_checked(tokens, token_file, vocab, model)
    _enough(int(tokens.shape[0]), seq, token_file)
    return {
        "kind": "real",
        "format": f"paddle_gpt:{layout}",
        "dir": data_dir,
        "prefix": os.path.basename(prefix),
        "dtype": str(tokens.dtype),
        "tokens": int(tokens.shape[0]),
        "index_sha256": _sha(index_file),
        "tokens_sample_sha256": _sample_sha(token_file),
    }


def check_llava(data: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """LLaVA JSON + image folder of one phase, and the tokenizer."""
    from training.data import llava_schema as ls

    root = str(data["data_dir"])
    if not data.get("json"):
        raise InputError(f"data.phases.{phase}.json: not set (the phase's LLaVA JSON file under data.data_dir)")
    json_path = os.path.join(root, str(data["json"]))
    folder = os.path.normpath(os.path.join(root, str(data.get("image_folder") or ".")))
    policy = data.get("missing_images") or "fail"
    if policy not in ls.MISSING_IMAGES:
        raise InputError(f"data.missing_images {policy!r}: one of {', '.join(ls.MISSING_IMAGES)}")
    try:
        records = ls.read_records(json_path)
        ls.check_records(records, json_path, str(data.get("template") or ""))
    except (OSError, ValueError) as exc:
        raise InputError(f"phase {phase}: {exc}") from None
    if any("image" in r for r in records) and not os.path.isdir(folder):
        raise InputError(f"phase {phase}: image folder {folder} does not exist (data.phases.{phase}.image_folder)")
    gone = ls.find_missing_images(records, folder)
    if gone and policy == "fail":
        first = os.path.join(folder, records[gone[0]]["image"])
        raise InputError(
            f"{first}: image of entry {gone[0]} of {json_path} (phase {phase}) is missing; {len(gone)} of the "
            f"{sum(1 for r in records if 'image' in r)} images are (set data.missing_images=skip to leave their "
            "entries out and count them)"
        )
    tok = data.get("tokenizer_path") or data.get("model_path") or data.get("language_model_path")
    if not tok:
        raise InputError(
            "data.data_dir is set but no tokenizer is: set data.tokenizer_path (or data.model_path) "
            "to a folder with the Vicuna/llava-hf tokenizer files"
        )
    tokenizer = _tokenizer(str(tok), shape)
    skipped = set(gone)
    present = sorted({str(r["image"]) for i, r in enumerate(records) if "image" in r and i not in skipped})
    manifest = verify_images(folder, present, records, json_path, phase)
    return {
        "kind": "real",
        "format": "llava",
        "dir": root,
        "json": str(data["json"]),
        "entries": len(records),
        "json_sha256": _sha(json_path),
        "images": sum(1 for r in records if "image" in r),
        "images_sha256": manifest,
        "template": data.get("template"),
        "tokenizer": tokenizer,
        "skipped_missing_images": len(gone),
    }


def _tokenizer(folder: str, shape: dict[str, Any]) -> dict[str, Any]:
    from training.data import llava_schema as ls

    if not os.path.isdir(folder):
        raise InputError(f"data.tokenizer_path {folder}: no such directory")
    try:
        ids = ls.tokenizer_ids(folder)
        size = max(ids) + 1 if ids else 0
        image_id = int(shape["image_token_index"])
        ls.check_tokenizer(size, int(shape["vocab_size"]), image_id, ids.get(image_id), f"tokenizer {folder}")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return {"size": size, "sha256": _tokenizer_sha(folder)}


#: the files of a Hugging Face tokenizer folder that decide its ids (a model folder's weights are not hashed)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def _tokenizer_sha(folder: str) -> str:
    """A hash of the tokenizer's content: each of its files present, by name and bytes."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            h.update(f"{name}\0{_sha(path)}\0".encode())
    return h.hexdigest()[:16]


def image_cache_path() -> Path:
    """Where the verdicts on images are kept between checks (by path, size and mtime)."""
    return Path(os.environ.get("FLAGBENCH_CACHE_DIR") or Path.home() / ".cache" / "flagbench") / "image-checks.json"


#: image sets at least this large show a progress bar while they are read
PROGRESS_FROM = 200


def verify_images(folder: str, names: list[str], records: list[Any], json_path: str, phase: str) -> str:
    """Every image of ``names`` (under ``folder``) decoded by Pillow (header and structure); the
    hash of the manifest (each name and the sha256 of its bytes). Images already seen at the same
    size and mtime are taken from the cache. InputError naming the first corrupt image and its
    JSON entry."""
    from rich.console import Console
    from rich.progress import Progress

    from training.data import llava_images

    cache_file = image_cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    manifest = hashlib.sha256()
    bad: list[tuple[str, str]] = []
    changed = False
    with Progress(console=Console(stderr=True), transient=True, disable=len(names) < PROGRESS_FROM) as bar:  # stdout: --json
        task = bar.add_task(f"checking the {phase} images", total=len(names))
        for name in names:
            path = os.path.abspath(os.path.join(folder, name))
            st = os.stat(path)
            key = f"{st.st_size}:{st.st_mtime_ns}"
            seen = cache.get(path)
            if seen and seen[0] == key:
                digest = seen[1]
            else:
                problem, digest = llava_images.inspect(path)
                if problem:
                    bad.append((name, problem))
                    bar.advance(task)
                    continue
                cache[path], changed = [key, digest], True
            manifest.update(f"{name}\0{digest}\0".encode())
            bar.advance(task)
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_file)
        except OSError:
            pass  # a cache that cannot be written costs only time
    if bad:
        name, problem = bad[0]
        i = next(i for i, r in enumerate(records) if isinstance(r, dict) and r.get("image") == name)
        rid = f" (id {records[i]['id']!r})" if "id" in records[i] else ""
        more = f"; {len(bad)} of the {len(names)} images are bad" if len(bad) > 1 else ""
        raise InputError(f"{os.path.join(folder, name)}: {problem}: image of entry {i}{rid} of {json_path} (phase {phase}){more}")
    return manifest.hexdigest()[:16]


CHECKS: dict[str, Callable[[dict[str, Any], dict[str, Any], str, str], dict[str, Any]]] = {
    "megatron": check_megatron,
    "paddle_gpt": check_paddle_gpt,
    "llava": check_llava,
}


def check(plan: Any) -> dict[str, dict[str, Any]]:
    """Every phase's data identity (``fingerprint`` included), after checking the data whole.

    Synthetic data (``data.data_dir`` null) is the harness's own: nothing to check. Data on
    a cluster's hosts that this machine cannot see is recorded as not checked here.
    InputError naming the file and the problem otherwise."""
    data = plan.settings["data"]
    out: dict[str, dict[str, Any]] = {}
    for phase in plan.phases:
        d = phase_data(data, phase)
        if not d.get("data_dir"):
            out[phase] = {"kind": SYNTHETIC, "fingerprint": SYNTHETIC}
            continue
        if Path(str(d["data_dir"])).is_file():
            raise InputError(f"data.data_dir {d['data_dir']}: a file, not a folder (the folder that holds the data)")
        if not Path(str(d["data_dir"])).is_dir():  # on the hosts only (backend local already refused this)
            out[phase] = {
                "kind": "real",
                "checked": False,
                "dir": str(d["data_dir"]),
                "fingerprint": None,
                "reason": "data_dir is not on this machine: checked by the ranks only",
            }
            continue
        fmt = d.get("format")
        if fmt not in CHECKS:
            raise InputError(f"{plan.case_dir / 'case.yaml'}: data.format {fmt!r}: one of {', '.join(CHECKS)}")
        ident = CHECKS[fmt](d, plan.model["shape"], plan.case.model, phase)
        ident["checked"] = True
        ident["fingerprint"] = fingerprint(ident)
        out[phase] = ident
    return out


def describe(identities: dict[str, dict[str, Any]]) -> list[str]:
    """One line per phase for the terminal."""
    lines = []
    for phase, ident in identities.items():
        tag = "" if phase == "train" else f"{phase}: "
        if ident.get("kind") == SYNTHETIC:
            continue
        if not ident.get("checked"):
            lines.append(f"data {tag}{ident['dir']}: {ident['reason']}")
            continue
        what = {
            "megatron": lambda i: ", ".join(
                f"{c['prefix']} ({c['tokens']:,} tokens, {c['dtype']}" + (f", weight {c['weight']:g})" if len(i["corpora"]) > 1 else ")")
                for c in i["corpora"]
            ),
            "llava": lambda i: (
                f"{i['json']} ({i['entries']:,} entries, {i['images']:,} images"
                + (f", {i['skipped_missing_images']:,} missing: skipped)" if i["skipped_missing_images"] else ")")
            ),
        }
        fmt = ident["format"].split(":")[0]
        body = what[fmt](ident) if fmt in what else f"{ident['prefix']} ({ident['tokens']:,} tokens, {ident['dtype']})"
        lines.append(f"data {tag}{ident['format']} {body}, checked; fingerprint {ident['fingerprint']}")
    return lines


#: settings that say where data is, not how to train: set by --set, they are no user override
DATA_LOCATIONS = ("data_dir", "tokenizer_path")


def is_data_location(key: str) -> bool:
    """Whether a setting (``data.tokenizer_path``, ``data.phases.finetune.data_dir``) names where data is."""
    parts = key.split(".")
    return parts[0] == "data" and parts[-1] in DATA_LOCATIONS


def identity_text(ident: dict[str, Any] | None) -> str:
    """A phase's data in a few words, with its fingerprint (results.json's ``data`` record; None:
    the synthetic set, as a run made before data had identities)."""
    if ident is None or ident.get("kind") == SYNTHETIC:
        return "synthetic (the harness's own corpus)"
    if not ident.get("checked"):
        return f"not checked here ({ident.get('reason', 'no fingerprint')})"
    fmt = str(ident.get("format"))
    if fmt == "megatron":
        what = " + ".join(f"{c['weight']:g} {c['prefix']}" if len(ident["corpora"]) > 1 else c["prefix"] for c in ident["corpora"])
    elif fmt == "llava":
        what = f"{ident['json']}, {ident['images']:,} images, tokenizer of {ident['tokenizer']['size']} ids"
    else:
        what = str(ident.get("prefix"))
    return f"{fmt} {what}, fingerprint {ident.get('fingerprint')}"
