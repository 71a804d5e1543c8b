"""The published math of a decoder step, in float64 numpy: the conformance check's reference.

Run as its own process, ``python -I reference.py PROBE.npz VERDICT.json``, by
training/conformance/__init__.py: isolated (``-I``: no PYTHONPATH, no user site), it imports
numpy and the standard library only, so no vendor adapter, hook or kernel of the run can
reach it, and it shares no code with the cases' models. It reads what the probe wrote (the
case's parts built as the run builds them, on the vendor's stack: their weights, seeded
inputs, sampled outputs and gradient projections), evaluates the architecture from its
declared shape, and writes the verdict.

The architecture (``spec`` in the probe file) is one decoder layer between an embedding and a
loss head, as the families publish it:

- positions: ``rope`` (rotate-half RoPE of base ``rope_base`` on query and key, Llama), ``alibi``
  (per-head linear biases with the slopes of Press et al., Baichuan2-13B), ``learned`` (a table
  added to the embedding, GPT-3);
- norm: ``rms`` (x / sqrt(mean x^2 + eps) * w) or ``layer`` (mean and variance, weight, bias);
- attention: causal softmax(q k^T / sqrt(head_dim) + bias) v, grouped-query (query head i reads
  key/value group i // (heads / groups)), optional q/k/v/o biases;
- MLP: ``swiglu`` (silu(x Wg) * (x Wu) Wd) or ``gelu`` (gelu_tanh(x W1 + b1) W2 + b2);
- head: final norm, ``plain`` (z Wout^T) or ``normhead`` (each vocabulary row of Wout divided by
  its L2 norm), cross-entropy against the labels;
- ``tied`` (GPT-3): the head's weight is the token embedding itself. The probe then sends the
  whole embedding (every row: the head reads them all), no ``w_out``, the tokens as they are,
  and the gradient of the one tensor, the lookup's and the head's together; the reference
  projects it as the sum of the two (central differences of the trunk through the rows the
  input reads, chained to the head's gradient, plus the head's exact projection, a block of rows
  at a time as for ``w_out``). No row is outside the gradient there: no ``outside`` check.

Outputs are compared at the sampled query positions (``positions``), whose keys reach back to
position 0. Gradients are compared as projections: for each parameter tensor the probe sent
<grad, d> for two directions d (the sign of its own gradient, and a counter-hash direction
both sides compute exactly), and the reference gets the same projection of the true gradient
by central differences of its float64 trunk, chained to the exact gradient of the head.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# --------------------------------------------------------------------------- directions


def hash_direction(n: int, salt: int, start: int = 0) -> np.ndarray:
    """Elements ``start`` .. ``start + n - 1`` of a direction in [-0.5, 0.5): an integer mix of the
    index and ``salt`` (32-bit steps, exact in int64), the same on every side that computes it
    (training/conformance/export.py)."""
    x = (np.arange(start, start + n, dtype=np.int64) + salt * 7919) & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return (x & 0xFFFFFF).astype(np.float64) / float(1 << 24) - 0.5


def unpack_sign(pos: np.ndarray, neg: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """Elements ``start`` .. ``start + n - 1`` of a sign direction sent as two bit fields
    (``start`` a multiple of 8)."""
    a, b = start // 8, (start + n + 7) // 8
    return np.unpackbits(pos[a:b], count=n).astype(np.float64) - np.unpackbits(neg[a:b], count=n).astype(np.float64)


def as_f64(a: np.ndarray) -> np.ndarray:
    """A probe array as float64; bfloat16 travels as its uint16 bits (the high half of a float32),
    widened a block of rows at a time on the projection threads."""
    if a.dtype != np.uint16:
        return a.astype(np.float64)
    out = np.empty(a.shape, dtype=np.float64)
    flat_in, flat_out = a.reshape(-1), out.reshape(-1)
    step = 1 << 22

    def widen(i: int) -> None:
        half = np.zeros((min(step, flat_in.size - i), 2), dtype=np.uint16)
        half[:, 1] = flat_in[i : i + step]  # little-endian float32: the bits in the high half
        flat_out[i : i + step] = half.view(np.float32)[:, 0]

    with ThreadPoolExecutor(max_workers=workers()) as pool:
        list(pool.map(widen, range(0, flat_in.size, step)))
    return out


# --------------------------------------------------------------------------- the math


def norm(x: np.ndarray, spec: dict, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    eps = float(spec["norm_eps"])
    if spec["norm"] == "rms":
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    else:
        mu = np.mean(x, axis=-1, keepdims=True)
        y = (x - mu) / np.sqrt(np.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)
    y = y * w
    return y if b is None else y + b


def rope(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """Rotate-half RoPE of ``x`` [n, heads, d] at positions ``pos`` [n]."""
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None, :]
    half = d // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def alibi_slopes(heads: int) -> np.ndarray:
    """Press et al.'s slopes: 2^(-8 i / n) for the nearest power of two n below ``heads``, the
    rest interleaved from 2n (as Baichuan2-13B and BLOOM define them)."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        return np.array(power_of_two(heads))
    closest = 2 ** math.floor(math.log2(heads))
    return np.array(power_of_two(closest) + power_of_two(2 * closest)[0::2][: heads - closest])


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _get(p: dict, name: str) -> np.ndarray | None:
    return p.get(name)


#: what each tensor of the trunk changes: the keys and values at every position (the rest is
#: computed at the sampled positions only)
CHANGES_K = ("embedding", "position_embedding", "ln1", "ln1_bias", "wk", "bk")
CHANGES_V = ("embedding", "position_embedding", "ln1", "ln1_bias", "wv", "bv")


#: the vision tower's and the projector's tensors (LLaVA): they reach every key and value
VISION = ("v_", "p_")


def reaches(changed: str, names: tuple[str, ...]) -> bool:
    return changed in names or changed.startswith(VISION)


def gelu_exact(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def quick_gelu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-1.702 * x))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = np.mean(x, axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(np.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps) * w + b


def image_features(p: dict, vision: dict) -> np.ndarray:
    """LLaVA-1.5's image features of ``p["pixels"]`` [3, H, W]: CLIP's patch embedding (a
    stride-``patch`` convolution without bias), class token and learned positions, its pre-norm,
    one encoder layer (pre-norm attention over every position with q/k/v/o biases, pre-norm
    quick-GELU MLP), whose output is the penultimate layer's of a two-layer tower
    (``vision_feature_layer: -2``), the class token left out (``default``); then the projector
    (linear, exact GELU, linear, with biases)."""
    eps, size, heads = float(vision["norm_eps"]), int(vision["patch_size"]), int(vision["heads"])
    px = p["pixels"]
    c, hgt, wid = px.shape
    patches = px.reshape(c, hgt // size, size, wid // size, size).transpose(1, 3, 0, 2, 4).reshape(-1, c * size * size)
    h = np.concatenate([p["v_cls"][None], patches @ p["v_patch"].T]) + p["v_pos"]
    h = layer_norm(h, p["v_pre_ln"], p["v_pre_ln_bias"], eps)
    a = layer_norm(h, p["v_ln1"], p["v_ln1_bias"], eps)
    n, width = a.shape
    d = width // heads
    q = (a @ p["v_wq"].T + p["v_bq"]).reshape(n, heads, d).transpose(1, 0, 2)
    k = (a @ p["v_wk"].T + p["v_bk"]).reshape(n, heads, d).transpose(1, 0, 2)
    v = (a @ p["v_wv"].T + p["v_bv"]).reshape(n, heads, d).transpose(1, 0, 2)
    sc = np.matmul(q, k.transpose(0, 2, 1)) / math.sqrt(d)
    sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
    att = np.matmul(sc / sc.sum(axis=-1, keepdims=True), v).transpose(1, 0, 2).reshape(n, width)
    h = h + att @ p["v_wo"].T + p["v_bo"]
    a = layer_norm(h, p["v_ln2"], p["v_ln2_bias"], eps)
    h = h + quick_gelu(a @ p["v_fc1"].T + p["v_bfc1"]) @ p["v_fc2"].T + p["v_bfc2"]
    return gelu_exact(h[1:] @ p["p_w1"].T + p["p_b1"]) @ p["p_w2"].T + p["p_b2"]


def trunk(p: dict, spec: dict, tokens: np.ndarray, pos: np.ndarray, base: dict | None = None, changed: str = "") -> dict[str, np.ndarray]:
    """Embedding and one decoder layer; keys and values for every position up to the last
    sampled one, queries at the sampled ``pos``. Returns the attention output, the layer output
    and the final norm's output at ``pos`` (and the keys and values, which a later call with
    ``base`` reuses where the one tensor ``changed`` does not reach them)."""
    m = int(pos.max()) + 1
    heads, groups, d = int(spec["heads"]), int(spec["groups"]), int(spec["head_dim"])
    rows = tokens[:m] if base is None or reaches(changed, CHANGES_K + CHANGES_V) else tokens[pos]
    x = p["embedding"][rows]
    feats = None
    if spec.get("vision"):  # the image's features take the place of its tokens' embeddings
        vision = spec["vision"]
        feats = base["feats"] if base is not None and not changed.startswith(VISION) else image_features(p, vision)
        where = {q: j for j, q in enumerate(vision["image_positions"])}
        at = range(m) if len(rows) == m else pos
        for i, q in enumerate(at):
            if int(q) in where:
                x[i] = feats[where[int(q)]]
    if spec["positions"] == "learned":
        x = x + p["position_embedding"][np.arange(m) if len(rows) == m else pos]
    h1 = norm(x, spec, p["ln1"], _get(p, "ln1_bias"))
    hq = h1[pos] if len(rows) == m else h1
    k = h1 @ p["wk"].T + (p["bk"] if _get(p, "bk") is not None else 0.0) if base is None or reaches(changed, CHANGES_K) else base["k"]
    v = h1 @ p["wv"].T + (p["bv"] if _get(p, "bv") is not None else 0.0) if base is None or reaches(changed, CHANGES_V) else base["v"]
    keys, values = k, v
    q = hq @ p["wq"].T
    if _get(p, "bq") is not None:
        q = q + p["bq"]
    xp = x[pos] if len(rows) == m else x
    q = q.reshape(len(pos), heads, d)
    k = k.reshape(m, groups, d)
    v = v.reshape(m, groups, d)
    if spec["positions"] == "rope":
        q = rope(q, pos, float(spec["rope_base"]))
        k = rope(k, np.arange(m), float(spec["rope_base"]))
    per = heads // groups  # query head i reads group i // per: queries grouped, no copies of K/V
    qg = q.reshape(len(pos), groups, per, d).transpose(1, 2, 0, 3).reshape(groups, per * len(pos), d)
    scores = np.matmul(qg, k.transpose(1, 2, 0)).reshape(groups, per, len(pos), m) / math.sqrt(d)
    if spec["positions"] == "alibi":  # slope * (key position - query position), <= 0 on the causal side
        rel = np.arange(m)[None, :] - pos[:, None]
        scores = scores + alibi_slopes(heads).reshape(groups, per)[:, :, None, None] * rel[None, None]
    scores = np.where(np.arange(m)[None, None, None, :] > pos[None, None, :, None], -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w = w / w.sum(axis=-1, keepdims=True)
    out = np.matmul(w.reshape(groups, per * len(pos), m), v.transpose(1, 0, 2))  # [groups, per * n, d]
    attn = out.reshape(groups, per, len(pos), d).transpose(2, 0, 1, 3).reshape(len(pos), heads * d)
    o = attn @ p["wo"].T
    if _get(p, "bo") is not None:
        o = o + p["bo"]
    r = xp + o
    h2 = norm(r, spec, p["ln2"], _get(p, "ln2_bias"))
    if spec["mlp"] == "swiglu":
        mlp = (silu(h2 @ p["w_gate"].T) * (h2 @ p["w_up"].T)) @ p["w_down"].T
    else:
        mlp = gelu_tanh(h2 @ p["w_fc1"].T + p["b_fc1"]) @ p["w_fc2"].T + p["b_fc2"]
    y = r + mlp
    z = norm(y, spec, p["lnf"], _get(p, "lnf_bias"))
    return {"attention": attn, "layer": y, "final_norm": z, "k": keys, "v": values, "feats": feats}


def head_weight(p: dict, spec: dict) -> np.ndarray:
    w = p["w_out"]
    if spec["head"] == "normhead":
        w = w / np.linalg.norm(w, axis=1, keepdims=True)
    return w


def head(z: np.ndarray, p: dict, spec: dict, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position cross-entropy at the sampled positions, and the exact gradient of their mean
    with respect to ``z`` and to the logits."""
    logits = z @ head_weight(p, spec).T
    mx = logits.max(axis=-1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(logits - mx).sum(axis=-1))
    loss = lse - logits[np.arange(len(labels)), labels]
    g_logits = np.exp(logits - lse[:, None])
    g_logits[np.arange(len(labels)), labels] -= 1.0
    g_logits /= len(labels)
    return loss, g_logits @ head_weight(p, spec), g_logits


def head_projection(p: dict, spec: dict, base: dict, g: dict, direction: Any) -> float:
    """<dL/dWout, d>, exact, a block of vocabulary rows at a time (``direction(start, rows)``: the
    direction's rows ``start`` .. ``start + rows - 1``, flattened)."""
    w, z = p["w_out"], base["final_norm"]
    total, block = 0.0, 8192
    for a in range(0, w.shape[0], block):
        wb = w[a : a + block]
        g_w = g["logits"][:, a : a + block].T @ z  # dL / d(head weight as used), these rows
        d = direction(a * w.shape[1], wb.size).reshape(wb.shape)
        if spec["head"] == "normhead":  # d(w / |w|) . d = (d - u (u . d)) / |w|
            nrm = np.linalg.norm(wb, axis=1, keepdims=True)
            u = wb / nrm
            d = (d - u * np.sum(u * d, axis=1, keepdims=True)) / nrm
        total += float(np.sum(g_w * d))
    return total


def projected_gradient(p: dict, spec: dict, tokens: np.ndarray, pos: np.ndarray, base: dict, g: dict, name: str, d: Any) -> float:
    """<dL/d p[name], d> of the mean loss at ``pos``: central differences of the float64 trunk
    chained to the head's exact gradient (``g``: :func:`head`'s, at ``base``); for the head's
    own weight, exact."""
    if name == "w_out":
        return head_projection(p, spec, base, g, d)
    if name == "embedding" and spec.get("tied"):
        return head_projection(p, spec, base, g, d) + tied_lookup_projection(p, spec, tokens, pos, base, g, d)
    theta = p[name]
    scale = np.linalg.norm(theta) / max(np.linalg.norm(d), 1e-300)
    eps = 1e-5 * (scale if scale > 0 else 1.0)
    plus = trunk({**p, name: theta + eps * d}, spec, tokens, pos, base, name)["final_norm"]
    minus = trunk({**p, name: theta - eps * d}, spec, tokens, pos, base, name)["final_norm"]
    return float(np.sum(g["z"] * (plus - minus)) / (2 * eps))


def tied_lookup_projection(p: dict, spec: dict, tokens: np.ndarray, pos: np.ndarray, base: dict, g: dict, direction: Any) -> float:
    """The lookup's part of <dL/dE, d> for a tied embedding E (``direction(start, n)`` as for
    :func:`head_projection`): central differences of the trunk on the rows the input reads, the
    head's weight held fixed (its part is :func:`head_projection`'s)."""
    m = int(pos.max()) + 1
    table = p["embedding"]
    vocab, width = table.shape
    used = np.unique(tokens[:m])
    d = np.empty((len(used), width))
    block = 8192
    for a in range(0, vocab, block):  # the direction's rows, a block at a time (a sign direction starts at a byte)
        sel = np.nonzero((used >= a) & (used < a + block))[0]
        if len(sel):
            d[sel] = direction(a * width, min(block, vocab - a) * width).reshape(-1, width)[used[sel] - a]
    theta = table[used]
    scale = np.linalg.norm(theta) / max(np.linalg.norm(d), 1e-300)
    eps = 1e-5 * (scale if scale > 0 else 1.0)
    local = np.searchsorted(used, tokens[:m])
    plus = trunk({**p, "embedding": theta + eps * d}, spec, local, pos, base, "embedding")["final_norm"]
    minus = trunk({**p, "embedding": theta - eps * d}, spec, local, pos, base, "embedding")["final_norm"]
    return float(np.sum(g["z"] * (plus - minus)) / (2 * eps))


# --------------------------------------------------------------------------- the verdict


def blocks(pos: np.ndarray, seq: int, n: int = 4) -> list[tuple[int, int, np.ndarray]]:
    """The sampled positions in ``n`` equal spans of the sequence: (first, last, indices)."""
    out = []
    for b in range(n):
        lo, hi = b * seq // n, (b + 1) * seq // n - 1
        idx = np.nonzero((pos >= lo) & (pos <= hi))[0]
        if len(idx):
            out.append((lo, hi, idx))
    return out


def relative(dev: np.ndarray, ref: np.ndarray) -> float:
    den = np.linalg.norm(ref)
    num = np.linalg.norm(dev - ref)
    return float(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


#: tensors as large as the vocabulary: their gradient is projected on its own sign alone (the
#: second direction would cost as much as the rest of the check)
LARGE = ("w_out",)


def workers() -> int:
    """Threads for the projections (training/conformance/__init__.py sets BLAS's own threads to match)."""
    return max(1, min(8, os.cpu_count() or 1))


def log(what: str, _t0: list = []) -> None:  # noqa: B006 - the first call's time, kept
    """Progress on stderr, with seconds since the first line."""
    _t0 = _t0 or _t0.append(time.monotonic()) or _t0
    print(f"reference: {time.monotonic() - _t0[0]:7.2f} s {what}", file=sys.stderr, flush=True)


def check(probe: dict) -> dict:
    """Compare what the probe sent with the reference; the verdict and its figures."""
    t0 = time.monotonic()
    log("start")
    spec = json.loads(str(probe["spec"]))
    tol = spec["tolerance"]
    p = {k[6:]: as_f64(v) for k, v in probe.items() if k.startswith("param:")}
    if spec.get("tied"):
        p["w_out"] = p["embedding"]  # one tensor: the head reads the embedding
    tokens = probe["tokens"].astype(np.int64)
    labels_all = probe["labels"].astype(np.int64)
    pos = probe["positions"].astype(np.int64)
    labels = labels_all[pos]
    seq = int(spec["seq_length"])
    log("read")
    ref = trunk(p, spec, tokens, pos)
    loss, g_z, g_logits = head(ref["final_norm"], p, spec, labels)
    ref["loss"] = loss
    g = {"z": g_z, "logits": g_logits}
    rows = []
    names = {"attention": "attention output", "layer": "decoder layer output", "loss": "per-token loss"}
    for key, what in names.items():
        dev = as_f64(probe[f"out:{key}"])
        r = ref[key]
        for lo, hi, idx in blocks(pos, seq):
            rows.append({"tensor": what, "positions": [lo, hi], "error": relative(dev[idx], r[idx]), "tolerance": tol["output"]})
    jobs = []
    for key in sorted(k for k in probe if k.startswith("grad:") and k.endswith(":sign_pos")):
        name = key[5:-9]
        salt = int(probe[f"grad:{name}:salt"])
        directions = {
            "sign": lambda a, k, name=name: unpack_sign(probe[f"grad:{name}:sign_pos"], probe[f"grad:{name}:sign_neg"], k, a),
            "hash": lambda a, k, salt=salt: hash_direction(k, salt, a),
        }
        for kind, direction in directions.items():
            if kind == "hash" and name in LARGE:
                continue
            jobs.append((name, kind, direction))

    def project(job: tuple) -> dict:
        name, kind, direction = job
        n = p[name].size
        dev = float(probe[f"grad:{name}:{kind}"])
        mag = float(probe[f"grad:{name}:{kind}_mag"])  # sum |g| |d|: the projection without cancellation
        blockwise = name == "w_out" or (name == "embedding" and spec.get("tied"))  # as large as the vocabulary
        d = direction if blockwise else direction(0, n).reshape(p[name].shape)
        true = projected_gradient(p, spec, tokens, pos, ref, g, name, d)
        err = abs(dev - true) / mag if mag > 0 else (0.0 if true == 0 else math.inf)
        log(f"gradient of {name} ({kind})")
        return {"tensor": f"gradient of {name} ({kind} direction)", "positions": None, "error": err, "tolerance": tol["gradient"]}

    # numpy leaves the interpreter lock in its loops and BLAS calls: the projections side by side
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        rows += list(pool.map(project, jobs))
    for name in sorted(k[5:-8] for k in probe if k.startswith("grad:") and k.endswith(":outside")):
        # gradient on rows no token of the input reads (only the rows read travel): must be none
        inside = float(probe[f"grad:{name}:inside"])
        outside = float(probe[f"grad:{name}:outside"])
        err = outside / inside if inside > 0 else (0.0 if outside == 0 else math.inf)
        rows.append(
            {"tensor": f"gradient of {name} on rows no input token reads", "positions": None, "error": err, "tolerance": tol["gradient"]}
        )
    failed = [r for r in rows if not r["error"] <= r["tolerance"]]
    worst = max(rows, key=lambda r: r["error"] / r["tolerance"])
    if failed:  # the first tensor in the step's order that differs, at its worst span
        worst = max((r for r in failed if r["tensor"] == failed[0]["tensor"]), key=lambda r: r["error"])
    return {
        "verdict": "failed" if failed else "passed",
        "message": message(worst, failed),
        "worst": worst,
        "failed": failed[:8],
        "rows": rows,
        "compared": len(rows),
        "positions": int(len(pos)),
        "reference_s": round(time.monotonic() - t0, 3),
    }


def _where(r: dict) -> str:
    if r["positions"] is None:
        return r["tensor"]
    lo, hi = r["positions"]
    return f"{r['tensor']} at positions {lo:,}-{hi:,}"


def message(r: dict, failed: list[dict]) -> str:
    pct = f"{100 * r['error']:.3g} %" if math.isfinite(r["error"]) else "without bound"
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return f"{_where(r)} differs {pct} from the reference (tolerance {100 * r['tolerance']:.3g} %){more}"
    return f"largest difference: {_where(r)}, {pct} (tolerance {100 * r['tolerance']:.3g} %)"


def main(argv: list[str]) -> int:
    src, dst = argv[1], argv[2]
    with np.load(src, allow_pickle=False) as f:
        probe = {k: f[k] for k in f.files}
    verdict = check(probe)
    with open(dst, "w", encoding="utf-8") as fh:
        json.dump(verdict, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
