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

The check also gives each phase's data an identity: format, files, sizes, digests of the
decoded content training reads (training/data/content.py), what the phase starts from (the
phase before it, checkpoints loaded by path), and a ``fingerprint`` over them. results.json keeps
it (``data``), a reference curve records the data it was made on, and a phase whose reference
was made on other data is not judged: "no reference for this data".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from run_benchmarks.errors import InputError

SYNTHETIC = "synthetic"  # the fingerprint of the harness's own synthetic data (every committed curve's)
#: the content scheme and hash of a fingerprint (training/data/content.py): part of what is hashed, so
#: fingerprints of other schemes never match. SHA-256 of the standard library, so that the node side
#: (a cluster's hosts, with the node environment's Python) takes the same fingerprint as this machine
SCHEME, HASH = "content-v1", "sha256"
#: data.fingerprint: how a corpus's tokens enter its fingerprint
FINGERPRINT_MODES = ("full", "sampled")


def new_hash() -> Any:
    """A hash object of the fingerprints' hash: hashlib's SHA-256, here and on the hosts alike
    (1.57 GB/s on one core of this project's host; docs/datasets.md, "Fingerprints")."""
    return hashlib.sha256()


def _sha(path: str) -> str:
    """The hash of a file's bytes (the identity's record of an index file, not part of the fingerprint)."""
    h = new_hash()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def stat_key(*paths: str) -> str:
    """What a cached verdict on files is kept under: each one's size, mtime, ctime and inode.
    A rewrite changes the ctime even when size and mtime are put back (``touch -r``)."""
    parts = []
    for path in paths:
        st = os.stat(path)
        parts.append(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}")
    return f"{SCHEME}:{HASH}|" + "|".join(parts)


def cache_dir() -> Path:
    return Path(os.environ.get("FLAGBENCH_CACHE_DIR") or Path.home() / ".cache" / "flagbench")


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written costs only time


def token_cache_path() -> Path:
    """Where the digests of token corpora are kept between checks (by the files' stat keys)."""
    return cache_dir() / "token-digests.json"


#: what the fingerprint is taken of, per record: display fields (names, folders, dtypes, layouts) left out
_CORPUS_CONTENT = ("weight", "tokens", "documents", "content")


def fingerprint(identity: dict[str, Any]) -> str:
    """The hash of a phase's data content: the canonical content digests and the settings that
    decide what training reads (blend weights, max_tokens, template, skipped entries), never a
    file name, folder, dtype or container layout (docs/datasets.md)."""
    body: dict[str, Any] = {"scheme": SCHEME, "hash": HASH, "sampled": bool(identity.get("sampled"))}
    if "corpora" in identity:
        body["tokens"] = [{k: c.get(k) for k in _CORPUS_CONTENT} for c in identity["corpora"]]
        body["max_tokens"] = identity.get("max_tokens")
    else:
        body.update({k: identity.get(k) for k in ("entries", "entries_content", "images", "images_content", "template")})
        body["tokenizer"] = (identity.get("tokenizer") or {}).get("content")
    if identity.get("starts_from"):
        body["starts_from"] = identity["starts_from"]
    h = new_hash()
    h.update(json.dumps(body, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def phase_data(data: dict[str, Any], phase: str) -> dict[str, Any]:
    """A phase's data settings: the common ones overlaid with ``data.phases.<phase>``."""
    return {**{k: v for k, v in data.items() if k != "phases"}, **(((data.get("phases") or {}).get(phase)) or {})}


def _token_content(ids: Any, starts: Any, files: list[str], vocab: int, model: str, sampled: bool) -> str:
    """The digest of a corpus's canonical content (training/data/content.py), after checking every id
    against the vocabulary, in one pass over the tokens; kept in the cache by the files' stat keys, so a
    second check of unchanged files reads none of their tokens. ``files``: the token file first."""
    from training.data import content

    path = files[0]
    if int(ids.shape[0]) == 0:
        raise InputError(f"{path}: holds no tokens")
    key = f"{stat_key(*files)}|{int(ids.shape[0])}|{'sampled' if sampled else 'full'}"
    cache_file = token_cache_path()
    cache = _load_cache(cache_file)
    seen = cache.get(os.path.abspath(path))
    if isinstance(seen, dict) and seen.get("key") == key and 0 <= seen["min"] and seen["max"] < vocab:
        return str(seen["digest"])
    scan = content.tokens(ids, starts, vocab, new_hash, sampled)
    if scan["first_bad"] is not None:
        pos, value = scan["first_bad"]
        raise InputError(
            f"{path}: token id {value} at position {pos:,} is outside the model's vocabulary "
            f"[0, {vocab}) (model.vocab_size of {model}; largest id in the file {scan['max']})"
        )
    cache[os.path.abspath(path)] = {"key": key, "digest": scan["digest"], "min": scan["min"], "max": scan["max"]}
    _save_cache(cache_file, cache)
    return str(scan["digest"])


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


def fingerprint_mode(data: dict[str, Any]) -> bool:
    """Whether ``data.fingerprint`` asks for the sampled fingerprint (``full``, the default, or ``sampled``)."""
    mode = data.get("fingerprint") or "full"
    if mode not in FINGERPRINT_MODES:
        raise InputError(f"data.fingerprint {mode!r}: one of {', '.join(FINGERPRINT_MODES)}")
    return mode == "sampled"


def check_megatron(data: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """Megatron indexed data: one corpus or a blend (``data.prefix``)."""
    from training.data import content, corpus

    try:
        blend = corpus.megatron_prefixes(str(data["data_dir"]), data.get("prefix"))
    except (OSError, ValueError) as exc:
        raise InputError(str(exc)) from None
    sampled = fingerprint_mode(data)
    vocab, seq = int(shape["vocab_size"]), int(shape["seq_length"])
    head = int(float(data["max_tokens"])) if data.get("max_tokens") else None
    files = []
    total = sum(w for w, _ in blend)
    for weight, prefix in blend:
        reader = _indexed(prefix)
        tokens = reader.tokens if head is None else reader.tokens[:head]
        n = int(tokens.shape[0])
        starts = content.document_starts(reader.sequence_lengths, reader.document_indices, n if head is not None else None)
        digest = _token_content(tokens, starts, [prefix + ".bin", prefix + ".idx"], vocab, model, sampled)
        _enough(n, seq, prefix + ".bin")
        files.append(
            {
                "prefix": os.path.basename(prefix),
                "path": prefix,
                "weight": round(weight / total, 12),  # normalized: '0.3 a 0.7 b' and '3 a 7 b' are one blend
                "dtype": str(reader.dtype),
                "tokens": n,
                "documents": int(len(starts) - 1),
                "content": digest,
            }
        )
    return {
        "kind": "real",
        "format": "megatron",
        "dir": str(data["data_dir"]),
        "corpora": files,
        **({"max_tokens": head} if head else {}),
        **({"sampled": True} if sampled else {}),
    }


def check_paddle_gpt(data: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """PaddleNLP's GPT corpus: the _ids.npy/_idx.npz pair or the mmap .bin/.idx."""
    from training.data import content, corpus, paddle_gpt

    data_dir = str(data["data_dir"])
    try:
        if corpus.parse_blend(data.get("prefix")) is not None:
            raise ValueError(
                f"data.prefix {' '.join(map(str, data['prefix'])) if isinstance(data['prefix'], list) else data['prefix']!r}: "
                "a blend of corpora; the paddle_gpt reader of this case reads one corpus (name one prefix)"
            )
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
        if layout == "mmap":
            reader = paddle_gpt.IndexedReader(prefix)
            tokens, lens, docs = reader.tokens, reader.sequence_lengths, reader.document_indices
        else:
            pair = paddle_gpt.read_corpus(prefix)
            tokens, lens, docs = pair.ids, pair.lens, pair.docs
    except (OSError, ValueError) as exc:
        raise InputError(str(exc)) from None
    token_file, index_file = (
        (prefix + paddle_gpt.IDS_SUFFIX, prefix + paddle_gpt.IDX_SUFFIX) if layout == "npy" else (prefix + ".bin", prefix + ".idx")
    )
    sampled = fingerprint_mode(data)
    vocab, seq = int(shape["vocab_size"]), int(shape["seq_length"])
    starts = content.document_starts(lens, docs)
    digest = _token_content(tokens, starts, [token_file, index_file], vocab, model, sampled)
    _enough(int(tokens.shape[0]), seq, token_file)
    one = {
        "prefix": os.path.basename(prefix),
        "path": prefix,
        "weight": 1.0,
        "dtype": str(tokens.dtype),
        "tokens": int(tokens.shape[0]),
        "documents": int(len(starts) - 1),
        "content": digest,
    }
    return {
        "kind": "real",
        "format": f"paddle_gpt:{layout}",
        "dir": data_dir,
        "prefix": os.path.basename(prefix),
        "dtype": str(tokens.dtype),
        "tokens": int(tokens.shape[0]),
        "corpora": [one],
        **({"sampled": True} if sampled else {}),
    }


def _entry_name(records: list[Any], i: int, json_path: str, phase: str) -> str:
    rid = f" (id {records[i]['id']!r})" if isinstance(records[i], dict) and "id" in records[i] else ""
    return f"entry {i}{rid} of {json_path} (phase {phase})"


def max_image_pixels(data: dict[str, Any]) -> int:
    """``data.max_image_pixels``: the largest image (width x height) a phase may hold."""
    from training.data import llava_images

    value = data.get("max_image_pixels")
    if value is None:
        return llava_images.MAX_IMAGE_PIXELS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise InputError(f"data.max_image_pixels {value!r}: a whole number of pixels, 1 or more")
    return int(value)


def check_llava(data: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """LLaVA JSON + image folder of one phase, and the tokenizer."""
    from training.data import content, llava_images
    from training.data import llava_schema as ls

    root = str(data["data_dir"])
    if not data.get("json"):
        raise InputError(f"data.phases.{phase}.json: not set (the phase's LLaVA JSON file under data.data_dir)")
    json_path = os.path.join(root, str(data["json"]))
    folder = os.path.normpath(os.path.join(root, str(data.get("image_folder") or ".")))
    policy = data.get("missing_images") or "fail"
    if policy not in ls.MISSING_IMAGES:
        raise InputError(f"data.missing_images {policy!r}: one of {', '.join(ls.MISSING_IMAGES)}")
    limit = max_image_pixels(data)
    try:
        records = ls.read_records(json_path)
        ls.check_records(records, json_path, str(data.get("template") or ""))
    except (OSError, ValueError) as exc:
        raise InputError(f"phase {phase}: {exc}") from None
    for i, r in enumerate(records):  # the path as written, before anything is looked up
        why = llava_images.outside(str(r["image"])) if "image" in r else None
        if why:
            raise InputError(
                f"{r['image']}: {why}, outside the image folder {folder} (data.phases.{phase}.image_folder): "
                f"image of {_entry_name(records, i, json_path, phase)}"
            )
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
    kept = [r for i, r in enumerate(records) if i not in skipped]
    present = sorted({str(r["image"]) for r in kept if "image" in r})
    manifest, links = verify_images(folder, present, records, json_path, phase, limit)
    return {
        "kind": "real",
        "format": "llava",
        "dir": root,
        "json": str(data["json"]),
        "entries": len(records),
        "entries_content": content.entries(kept, new_hash),  # the entries training reads (skipped ones left out)
        "images": sum(1 for r in records if "image" in r),
        "images_content": manifest,
        "template": data.get("template"),
        "tokenizer": tokenizer,
        "skipped_missing_images": len(gone),
        **({"symlinks": links} if links else {}),
    }


def _tokenizer(folder: str, shape: dict[str, Any]) -> dict[str, Any]:
    from training.data import content
    from training.data import llava_schema as ls

    if not os.path.isdir(folder):
        raise InputError(f"data.tokenizer_path {folder}: no such directory")
    try:
        ids = ls.tokenizer_ids(folder)
        size = max(ids) + 1 if ids else 0
        image_id = int(shape["image_token_index"])
        ls.check_tokenizer(size, int(shape["vocab_size"]), image_id, ids.get(image_id), f"tokenizer {folder}")
        digest = content.tokenizer(folder, ids, new_hash)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return {"size": size, "content": digest}


def image_cache_path() -> Path:
    """Where the verdicts on images are kept between checks (by path and stat key)."""
    return cache_dir() / "image-checks.json"


#: image sets at least this large show a progress bar while they are read
PROGRESS_FROM = 200


def verify_images(
    folder: str, names: list[str], records: list[Any], json_path: str, phase: str, max_pixels: int | None = None
) -> tuple[str, dict[str, str]]:
    """Every image of ``names`` (under ``folder``) decoded whole by Pillow, its size checked against
    ``max_pixels``; the digest of the manifest (each name, and the digest of its size and decoded
    pixels) and the symlinks among them (name -> where it leads). Images already seen under the same
    stat key (size, mtime, ctime, inode) are taken from the cache. InputError naming the first bad
    image and its JSON entry."""
    from training.data import llava_images

    limit = llava_images.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    cache_file = image_cache_path()
    cache = _load_cache(cache_file)
    manifest = new_hash()
    bad: list[tuple[str, str]] = []
    links: dict[str, str] = {}
    changed = False
    with _progress(f"checking the {phase} images", len(names)) as advance:
        for name in names:
            path = os.path.abspath(os.path.join(folder, name))
            real = os.path.realpath(path)
            if real != path:
                links[name] = real
            key = stat_key(path)
            seen = cache.get(path)
            if isinstance(seen, list) and len(seen) == 4 and seen[0] == key:
                digest, size = seen[1], tuple(seen[2:])
                problem = f"{size[0]:,} x {size[1]:,} pixels, above data.max_image_pixels {limit:,}" if size[0] * size[1] > limit else None
            else:
                problem, digest, size = llava_images.inspect(path, new_hash, limit)
                if not problem:
                    cache[path], changed = [key, digest, *size], True
            if problem:
                bad.append((name, problem))
            else:
                manifest.update(f"{name}\0{digest}\0".encode())
            advance()
    if changed:
        _save_cache(cache_file, cache)
    if bad:
        name, problem = bad[0]
        i = next(i for i, r in enumerate(records) if isinstance(r, dict) and r.get("image") == name)
        more = f"; {len(bad)} of the {len(names)} images are bad" if len(bad) > 1 else ""
        raise InputError(f"{os.path.join(folder, name)}: {problem}: image of {_entry_name(records, i, json_path, phase)}{more}")
    return manifest.hexdigest()[:16], links


@contextlib.contextmanager
def _progress(what: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr (stdout: --json) for ``total`` items from PROGRESS_FROM on (rich
    draws it on a terminal only); none on a cluster's host whose environment has no rich."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        total = 0
    if total < PROGRESS_FROM:
        yield lambda: None
        return
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


CHECKS: dict[str, Callable[[dict[str, Any], dict[str, Any], str, str], dict[str, Any]]] = {
    "megatron": check_megatron,
    "paddle_gpt": check_paddle_gpt,
    "llava": check_llava,
}


#: why a phase's data has no fingerprint before launch: it is on the cluster's hosts only
ON_HOSTS = "data_dir is not on this machine: fingerprinted on the hosts before training"


def check(plan: Any) -> dict[str, dict[str, Any]]:
    """Every phase's data identity (``fingerprint`` included), after checking the data whole.

    Synthetic data (``data.data_dir`` null) is the harness's own: nothing to check. Data on
    a cluster's hosts that this machine cannot see is marked ``on_hosts``: the runtime has it
    checked and fingerprinted there before training (planning/hostdata.py).
    InputError naming the file and the problem otherwise."""
    data = plan.settings["data"]
    out: dict[str, dict[str, Any]] = {}
    for phase in plan.phases:
        d = phase_data(data, phase)
        if not d.get("data_dir"):
            out[phase] = synthetic_identity(d)
            continue
        if Path(str(d["data_dir"])).is_file():
            raise InputError(f"data.data_dir {d['data_dir']}: a file, not a folder (the folder that holds the data)")
        fmt = d.get("format")
        if fmt not in CHECKS:
            raise InputError(f"{plan.case_dir / 'case.yaml'}: data.format {fmt!r}: one of {', '.join(CHECKS)}")
        if not Path(str(d["data_dir"])).is_dir():  # on the hosts only (backend local already refused this)
            out[phase] = {
                "kind": "real",
                "checked": False,
                "on_hosts": True,
                "dir": str(d["data_dir"]),
                "fingerprint": None,
                "reason": ON_HOSTS,
            }
            continue
        out[phase] = check_phase(d, plan.model["shape"], plan.case.model, phase)
    return chain(plan, out)


def synthetic_identity(data: dict[str, Any]) -> dict[str, Any]:
    """The harness's synthetic corpus: version 1 (the Markov chain) is ``synthetic``, the name every
    curve made on it carries; a later version's parameters are in its fingerprint and so in the
    names of the references made on it (training/data/corpus_spec.py)."""
    from training.data import corpus_spec

    try:
        spec = corpus_spec.read_spec(data.get("synthetic"))
    except ValueError as e:
        raise InputError(f"the resolved settings: {e}") from None
    if spec.version == corpus_spec.CORPUS_VERSION:
        return {"kind": SYNTHETIC, "fingerprint": SYNTHETIC}
    return {"kind": SYNTHETIC, "corpus": spec.identity(), "fingerprint": corpus_spec.fingerprint(spec)}


def check_phase(d: dict[str, Any], shape: dict[str, Any], model: str, phase: str) -> dict[str, Any]:
    """One phase's data checked whole by its reader (``d``: the phase's settings, ``data.format``
    a known reader), with its fingerprint: the same here and on a cluster's hosts."""
    ident = CHECKS[str(d["format"])](d, shape, model, phase)
    ident["checked"] = True
    ident["fingerprint"] = fingerprint(ident)
    return ident


def unchain(ident: dict[str, Any]) -> dict[str, Any]:
    """A phase's identity as :func:`check` found it, before :func:`chain` added what it starts from."""
    out = {k: v for k, v in ident.items() if k not in ("starts_from", "own_fingerprint")}
    if "own_fingerprint" in ident:
        out["fingerprint"] = ident["own_fingerprint"]
    if out.get("kind") == SYNTHETIC or out.get("checked"):
        out.pop("reason", None)  # the chain's (a phase before it not checked)
    return out


#: checkpoints a case's first phase loads by path (data keys); their content enters the identities
CHECKPOINT_KEYS = ("model_path", "vision_tower_path", "language_model_path")


def checkpoint_content(path: str) -> str:
    """The digest of a checkpoint loaded by path: every file under it (relative name and bytes), or
    the file's bytes; kept in the cache by each file's stat key."""
    root = os.path.expanduser(path)
    files = [root] if os.path.isfile(root) else sorted(str(p) for p in Path(root).rglob("*") if p.is_file())
    cache_file = cache_dir() / "checkpoint-digests.json"
    cache = _load_cache(cache_file)
    h = new_hash()
    changed = False
    for f in files:
        key = stat_key(f)
        seen = cache.get(f)
        if not (isinstance(seen, list) and seen[0] == key):
            seen, changed = [key, _sha(f)], True
            cache[f] = seen
        h.update(f"{os.path.relpath(f, root) if f != root else ''}\0{seen[1]}\0".encode())
    if changed:
        _save_cache(cache_file, cache)
    return h.hexdigest()[:16]


#: train values that leave a curve as it is: the measurement's warm-up, the micro batch (the same
#: sums), the profiled step and the ceiling's hold (references.recipe_sets; ``steps`` there too where
#: the decay horizon is pinned, but never in a chain: more steps of a phase start the next elsewhere)
CURVE_NEUTRAL = frozenset({"steps", "warmup_steps", "micro_batch", "profile_step", "ceiling_hold_s"})


def _recipe(plan: Any, phase: str) -> str:
    """A phase's recipe in a few characters: the recipe's name, with the --set values that change
    its training (``train.*`` of that phase, other than CURVE_NEUTRAL's but steps) after it."""
    sets = sorted(
        f"{o['param']}={o['value']}"
        for o in getattr(plan, "user_overrides", None) or []
        if str(o["param"]).startswith("train.")
        and (".phases." not in o["param"] or f".phases.{phase}." in o["param"])
        and (str(o["param"]).rsplit(".", 1)[-1] not in CURVE_NEUTRAL - {"steps"})
        and not ("standard" in o and o.get("value") == o.get("standard"))
    )
    return str(getattr(plan, "recipe", "standard")) + (f" with {', '.join(sets)}" if sets else "")


def chain(plan: Any, identities: dict[str, dict[str, Any]], hosted: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each phase's identity with what it starts from: the checkpoints the first phase loads by
    path, and for every later phase the phase before it (its fingerprint, chained itself, and its
    recipe). A phase whose chain is all the synthetic corpus under the plain recipe keeps the
    synthetic identity (the committed references'); otherwise its fingerprint covers the chain
    (``own_fingerprint`` keeps its own data's). ``hosted``: the content of checkpoints that are
    on the cluster's hosts only, by path, as the hosts took it (planning/hostdata.py)."""
    phases = list(identities)
    data = plan.settings["data"]
    prev = None
    for k, phase in enumerate(phases):
        ident = identities[phase]
        starts: list[dict[str, Any]] = []
        if k == 0:
            d = phase_data(data, phase)
            for key in CHECKPOINT_KEYS:
                path = str(d.get(key) or "")
                if path and path in (hosted or {}):
                    starts.append({"setting": f"data.{key}", "path": path, "content": (hosted or {})[path]})
                elif path and os.path.exists(os.path.expanduser(path)):
                    starts.append({"setting": f"data.{key}", "path": path, "content": checkpoint_content(path)})
                elif path:  # on the cluster's hosts only, its content not taken there: no fingerprint
                    starts.append({"setting": f"data.{key}", "path": path, "content": None})
        else:
            before = identities[prev]
            starts.append({"phase": prev, "fingerprint": before.get("fingerprint"), "recipe": _recipe(plan, prev)})
        before_name, prev = prev, phase
        plain = all(
            s.get("phase") and s["fingerprint"] == SYNTHETIC and s["recipe"] == str(getattr(plan, "recipe", "standard")) for s in starts
        )
        if not starts or (plain and ident.get("fingerprint") == SYNTHETIC):
            continue
        if any(s.get("phase") and s["fingerprint"] is None for s in starts):  # a phase before it not checked here
            ident.update(starts_from=starts, own_fingerprint=ident.get("fingerprint"), fingerprint=None)
            pending = identities[str(before_name)].get("on_hosts")
            ident.setdefault(
                "reason", f"phase {before_name} before it " + ("is fingerprinted on the hosts" if pending else "was not checked here")
            )
            continue
        unread = next((s for s in starts if s.get("setting") and s["content"] is None), None)
        if unread is not None:
            ident.update(starts_from=starts, own_fingerprint=ident.get("fingerprint"), fingerprint=None)
            ident["reason"] = (
                f"{unread['setting']} {unread['path']} is not on this machine: the starting checkpoint's content is not fingerprinted"
            )
            continue
        own = ident.get("fingerprint")
        ident.update(starts_from=starts, own_fingerprint=own)
        if own is not None:
            h = new_hash()
            links = [{k: v for k, v in s.items() if k != "path"} for s in starts]  # where a checkpoint lies is not what it is
            h.update(json.dumps({"own": own, "starts_from": links}, sort_keys=True).encode())
            ident["fingerprint"] = h.hexdigest()[:16]
    return identities


def describe(identities: dict[str, dict[str, Any]]) -> list[str]:
    """One line per phase for the terminal: which data it reads (synthetic, or its files and fingerprint)."""
    lines = []
    for phase, ident in identities.items():
        tag = "" if phase == "train" else f"{phase}: "
        chain = f" ({chain_text(ident)})" if ident.get("starts_from") else ""
        if ident.get("kind") == SYNTHETIC:
            fp = ident.get("fingerprint")
            lines.append(f"data {tag}synthetic (the harness's own corpus){'' if fp == SYNTHETIC else f'; fingerprint {fp}'}{chain}")
            continue
        if not ident.get("checked"):
            lines.append(f"data {tag}{ident['dir']}: {ident['reason']}")
            continue
        if "corpora" in ident:
            blend = len(ident["corpora"]) > 1
            body = ", ".join(
                f"{c.get('path') or c['prefix']} ({c['tokens']:,} tokens, {c['dtype']}" + (f", weight {c['weight']:g})" if blend else ")")
                for c in ident["corpora"]
            )
        else:
            body = f"{os.path.join(ident['dir'], ident['json'])} ({ident['entries']:,} entries, {ident['images']:,} images" + (
                f", {ident['skipped_missing_images']:,} missing: skipped)" if ident["skipped_missing_images"] else ")"
            )
        sampled = " (sampled: data.fingerprint=sampled)" if ident.get("sampled") else ""
        where = f"checked on {', '.join(ident['checked_on'])}" if ident.get("checked_on") else "checked"
        lines.append(f"data {tag}{ident['format']} {body}, {where}; fingerprint {ident['fingerprint']}{sampled}{chain}")
        links = ident.get("symlinks") or {}
        if links:
            shown = "; ".join(f"{k} -> {v}" for k, v in list(links.items())[:3])
            lines.append(f"data {tag}{len(links):,} image(s) are symlinks, followed: {shown}{'; ...' if len(links) > 3 else ''}")
    return lines


def chain_text(ident: dict[str, Any]) -> str:
    """What a phase starts from, in a few words (its ``starts_from`` record)."""
    parts = []
    for s in ident.get("starts_from") or []:
        if s.get("phase"):
            parts.append(f"starts from phase {s['phase']}'s weights: its data {s['fingerprint']}, recipe {s['recipe']}")
        else:
            parts.append(f"starts from {s['setting']} {s['path']} (content {s['content']})")
    return "; ".join(parts)


#: data keys each reader reads only from real data, and the synthetic corpus's own keys
REAL_ONLY = {
    "megatron": ("max_tokens", "fingerprint"),
    "paddle_gpt": ("fingerprint",),
    "llava": ("missing_images", "tokenizer_path", "max_image_pixels", "fingerprint", "json", "image_folder"),
}
SYNTHETIC_ONLY = ("synthetic", "synthetic_tokens", "synthetic_seed", "synthetic_images", "synthetic_image_size")
#: data keys that name a file or folder the ranks open: one that is not there is refused here
PATH_KEYS = ("data_dir", "tokenizer_path", "model_path", "vision_tower_path", "language_model_path", "mmmu_dir", "mmmu_checkpoint")


def _blend_text(items: list[tuple[float, str]], weighted: bool) -> str:
    return " ".join(f"{w:g} {p}" if weighted else p for w, p in items)


def settle(settings: dict[str, Any], standard: dict[str, Any], given: list[str], cwd: str, local: bool, container: bool) -> None:
    """Every data setting used as given or refused, before anything runs (InputError naming the key).

    ``given``: the keys set on the command line (``--set``, ``--data-dir``). A Megatron-style
    ``data.prefix`` (one corpus or a blend, absolute or relative prefixes) without a data_dir is
    read where it points: relative prefixes from ``cwd`` (where start_task.py runs), and the data_dir
    becomes the folder that holds them all; with a data_dir, relative prefixes are inside it and,
    in a container, an absolute one outside it is refused. The case's reader (``data.format``) and
    the harness's ``cache_dir`` are not settings; a synthetic-corpus key on real data, a real-data
    key on the synthetic corpus, and a path that is not there are refused."""
    from training.data import corpus

    data = settings["data"]
    fmt = str(standard.get("data", {}).get("format") or data.get("format"))
    for key in given:
        parts = key.split(".")
        if parts[0] != "data":
            continue
        leaf = parts[-1]
        if leaf == "format" and data.get("format") != fmt:
            raise InputError(
                f"--set {key}={data.get('format')}: the case reads its data as {fmt} (case.yaml standard.data.format); "
                "the reader is the case's, not a setting"
            )
        if leaf == "cache_dir":
            raise InputError(f"--set {key}: set by the harness (where the synthetic corpus is written), not a setting")
    prefix = data.get("prefix")
    if fmt in ("megatron", "paddle_gpt") and prefix not in (None, ""):
        try:
            blend = corpus.parse_blend(prefix)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if blend is not None and fmt == "paddle_gpt":
            raise InputError(
                f"data.prefix {prefix!r}: a blend of corpora; the paddle_gpt reader of this case reads one corpus "
                "(name one prefix: <prefix>_ids.npy + _idx.npz or <prefix>.bin + .idx)"
            )
        items = blend or [(1.0, str(prefix[0] if isinstance(prefix, (list, tuple)) else prefix))]
        weighted = blend is not None and any(
            not _is_word(x) for x in (prefix if isinstance(prefix, (list, tuple)) else str(prefix).split())[0::2]
        )
        if not data.get("data_dir"):
            given_items = items
            items = [(w, os.path.normpath(p if os.path.isabs(p) else os.path.join(cwd, p))) for w, p in items]
            for (_, full), (_, p) in zip(items, given_items):
                pair = [" + ".join(files) for files in _pair_files(full, fmt)]
                if local and not any(all(os.path.isfile(f) for f in files) for files in _pair_files(full, fmt)):
                    what = f"{pair[0]} do not exist" if len(pair) == 1 else f"neither {pair[0]} nor {pair[1]} exist"
                    raise InputError(
                        f"data.prefix {p!r}: {what} (no data_dir: a relative prefix is taken from {cwd}, where start_task.py runs)"
                    )
            data["data_dir"] = os.path.commonpath([os.path.dirname(p) for _, p in items])
            if container and data["data_dir"] == os.sep:
                raise InputError(
                    f"data.prefix {prefix!r}: its corpora share no folder but /, which a container does not mount; "
                    "give data_dir (a cluster's data_dir or --data-dir) and prefixes under it"
                )
            data["prefix"] = _blend_text(items, weighted) if blend is not None else items[0][1]
        elif container:
            root = os.path.normpath(str(data["data_dir"]))
            for _, p in items:
                full = os.path.normpath(p if os.path.isabs(p) else os.path.join(root, p))
                if os.path.commonpath([root, full]) != root:
                    raise InputError(
                        f"data.prefix {p!r}: outside data_dir {root}, which is all a container mounts; "
                        "put the corpus under data_dir or give no data_dir (the prefixes' folder is mounted then)"
                    )
    phases = list(data.get("phases") or {})
    for key in given:
        parts = key.split(".")
        if parts[0] != "data":
            continue
        leaf = parts[-1]
        on = [parts[2]] if len(parts) > 3 and parts[1] == "phases" else phases or [None]  # the phases the key applies to
        dirs = [phase_data(data, ph).get("data_dir") if ph else data.get("data_dir") for ph in on]
        real = any(dirs)
        if all(dirs) and leaf in SYNTHETIC_ONLY:
            raise InputError(f"--set {key}: a setting of the synthetic corpus, and this run reads real data (data.data_dir {dirs[0]})")
        if not real and leaf in REAL_ONLY.get(fmt, ()):
            raise InputError(
                f"--set {key}: read from real data only, and this run trains on the synthetic corpus "
                "(no data.data_dir, --data-dir or cluster data_dir)"
            )
    if local:
        for phase_key, value in _path_values(data):
            if value and not os.path.exists(os.path.expanduser(str(value))):
                raise InputError(f"data.{phase_key} {value}: no such file or directory on this host")


def _pair_files(prefix: str, fmt: str) -> list[list[str]]:
    """The file pairs a corpus prefix may name in a format (either pair will do)."""
    from training.data import paddle_gpt

    for ext in (".bin", ".idx", paddle_gpt.IDS_SUFFIX, paddle_gpt.IDX_SUFFIX):
        prefix = prefix[: -len(ext)] if prefix.endswith(ext) else prefix
    mmap = [prefix + ".bin", prefix + ".idx"]
    return [[prefix + paddle_gpt.IDS_SUFFIX, prefix + paddle_gpt.IDX_SUFFIX], mmap] if fmt == "paddle_gpt" else [mmap]


def _is_word(x: Any) -> bool:
    try:
        float(x)
        return False
    except (TypeError, ValueError):
        return True


def _path_values(data: dict[str, Any]) -> list[tuple[str, Any]]:
    out = [(k, data.get(k)) for k in PATH_KEYS if k in data]
    for phase, over in (data.get("phases") or {}).items():
        out += [(f"phases.{phase}.{k}", (over or {}).get(k)) for k in PATH_KEYS if k in (over or {})]
    return out


#: settings that say where data is, not how to train: set by --set, they are no user override
DATA_LOCATIONS = ("data_dir", "tokenizer_path")
#: settings of the check before launch, not of training: no user override either
CHECK_ONLY = ("fingerprint", "max_image_pixels")


def is_data_location(key: str) -> bool:
    """Whether a setting (``data.tokenizer_path``, ``data.phases.finetune.data_dir``) names where data is."""
    parts = key.split(".")
    return parts[0] == "data" and parts[-1] in (*DATA_LOCATIONS, *CHECK_ONLY)


def identity_text(ident: dict[str, Any] | None) -> str:
    """A phase's data in a few words, with its fingerprint (results.json's ``data`` record; None:
    the synthetic set, as a run made before data had identities)."""
    if ident is None or ident.get("kind") == SYNTHETIC:
        fp = None if ident is None else ident.get("fingerprint")
        return "synthetic (the harness's own corpus)" + ("" if fp in (None, SYNTHETIC) else f", fingerprint {fp}")
    if not ident.get("checked"):
        return f"not checked here ({ident.get('reason', 'no fingerprint')})"
    fmt = str(ident.get("format"))
    if ident.get("corpora"):
        cs = ident["corpora"]
        what = " + ".join(
            f"{c['weight']:g} {c.get('path') or c['prefix']}" if len(cs) > 1 else str(c.get("path") or c["prefix"]) for c in cs
        )
    elif fmt == "llava":
        what = f"{ident['json']}, {ident['images']:,} images, tokenizer of {ident['tokenizer']['size']} ids"
    else:
        what = str(ident.get("prefix"))
    hosts = f" (taken on {', '.join(ident['checked_on'])})" if ident.get("checked_on") else ""
    return f"{fmt} {what}, fingerprint {ident.get('fingerprint')}" + (" (sampled)" if ident.get("sampled") else "") + hosts
