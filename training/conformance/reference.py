"""The published math of a decoder step, in float64 numpy: the conformance check's reference.

Run as its own process, ``python -I reference.py PROBE VERDICT.json``, by
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

What the projections share is computed once: the trunk at the probe's weights keeps every
intermediate (:data:`GRAPH`), and the trunk with one tensor moved computes again only what that
tensor reaches. A tensor that enters through one affine map (a projection's weight or bias, a
norm's weight) moves that map's output by ``eps`` times what the direction alone gives there
(``h1 @ d.T``: the same trunk at ``theta +- eps d``, one product instead of two); the head's
weight, as large as the vocabulary, is widened a block of rows at a time; the work runs on
threads, the trunk's and the head's products a block at a time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
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
    return np.subtract(np.unpackbits(pos[a:b], count=n), np.unpackbits(neg[a:b], count=n), dtype=np.float64)


#: every bfloat16 bit pattern's value, in float64 (exact: a bfloat16 is the high half of a float32)
with np.errstate(invalid="ignore"):  # the NaN patterns among them
    BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def widen(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A probe array (or a block of its rows) as float64; bfloat16 travels as its uint16 bits,
    looked up in :data:`BF16`."""
    if a.dtype == np.uint16:
        return np.take(BF16, a, out=out, mode="clip")
    if out is None:
        return a.astype(np.float64)
    out[...] = a
    return out


def pmap(f: Any, items: Any, pool: ThreadPoolExecutor | None) -> list:
    """``[f(i) for i in items]``, on the pool's threads where there is one."""
    return list(pool.map(f, items)) if pool is not None else [f(i) for i in items]


def as_f64(a: np.ndarray, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """A probe array as float64 (:func:`widen`), a block of elements at a time on the pool."""
    if a.size < 1 << 22 or pool is None:
        return widen(a)
    out = np.empty(a.shape, dtype=np.float64)
    flat_in, flat_out = a.reshape(-1), out.reshape(-1)
    step = 1 << 21

    def part(i: int) -> None:
        widen(flat_in[i : i + step], flat_out[i : i + step])

    pmap(part, range(0, flat_in.size, step), pool)
    return out


def by_rows(f: Any, n: int, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """``f(rows)`` for ``rows`` = slice(0, n), a block of rows on each of the pool's threads where
    there is one (``f`` works row by row)."""
    if pool is None or n < 2048:
        return f(slice(0, n))
    step = -(-n // (2 * workers()))
    parts = pmap(lambda i: f(slice(i, min(n, i + step))), range(0, n, step), pool)
    return np.concatenate(parts)


def matmul_t(a: np.ndarray, w: np.ndarray, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """``a @ w.T``, a block of ``a``'s rows on each of the pool's threads where there is one."""
    if pool is None or a.shape[0] < 2048:
        return a @ w.T
    out = np.empty((a.shape[0], w.shape[0]))
    step = -(-a.shape[0] // (2 * workers()))

    def part(i: int) -> None:
        np.matmul(a[i : i + step], w.T, out=out[i : i + step])

    pmap(part, range(0, a.shape[0], step), pool)
    return out


# --------------------------------------------------------------------------- the math


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


#: the vision tower's and the projector's tensors (LLaVA): they reach every key and value
VISION = ("v_", "p_")


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


def normalized(x: np.ndarray, spec: dict) -> np.ndarray:
    """The norm before its weight and bias: x / rms(x) (``rms``), (x - mean) / std (``layer``)."""
    eps = float(spec["norm_eps"])
    if spec["norm"] == "rms":
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    mu = np.mean(x, axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(np.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)


def scaled(n: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """A norm's weight and bias on its normalized input."""
    y = n * w
    return y if b is None else y + b


#: the trunk's intermediates in the order they are computed, each with what it is computed from
#: (parameters and earlier intermediates); "x", "n1", "h1", "k", "v" and "k_rot" are at every
#: position up to the last sampled one, the rest at the sampled positions
GRAPH = {
    "feats": ("vision",),  # the image's features (LLaVA): every tensor of the tower and projector
    "x": ("embedding", "position_embedding", "feats"),
    "n1": ("x",),
    "h1": ("n1", "ln1", "ln1_bias"),
    "k": ("h1", "wk", "bk"),
    "v": ("h1", "wv", "bv"),
    "k_rot": ("k",),  # the keys after RoPE, [groups, head_dim, positions]
    "q": ("h1", "wq", "bq"),
    "q_rot": ("q",),  # the queries after RoPE, grouped: [groups, per group x sampled, head_dim]
    "probs": ("q_rot", "k_rot"),
    "attention": ("probs", "v"),
    "o": ("attention", "wo", "bo"),
    "r": ("x", "o"),
    "n2": ("r",),
    "h2": ("n2", "ln2", "ln2_bias"),
    "a": ("h2", "w_gate", "w_fc1", "b_fc1"),  # SwiGLU's gate, or GELU's input
    "b": ("h2", "w_up"),  # SwiGLU's up projection
    "act": ("a", "b"),
    "mlp": ("act", "w_down", "w_fc2", "b_fc2"),
    "y": ("r", "mlp"),
    "nf": ("y",),
    "final_norm": ("nf", "lnf", "lnf_bias"),
}


def trunk(
    p: dict,
    spec: dict,
    tokens: np.ndarray,
    pos: np.ndarray,
    base: dict | None = None,
    changed: str = "",
    given: dict | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> dict[str, np.ndarray]:
    """Embedding and one decoder layer; keys and values for every position up to the last
    sampled one, queries at the sampled ``pos``. Returns every intermediate (:data:`GRAPH`): the
    attention output, the layer output and the final norm's output at ``pos`` among them. With
    ``base`` (an earlier call's), only what the one tensor ``changed``, or an intermediate in
    ``given`` (one the caller moved itself), reaches is computed again; the rest is ``base``'s."""
    m = int(pos.max()) + 1
    heads, groups, d = int(spec["heads"]), int(spec["groups"]), int(spec["head_dim"])
    per = heads // groups  # query head i reads group i // per: queries grouped, no copies of K/V
    given = given or {}
    moved = set(given) | {changed, "vision" if changed.startswith(VISION) else changed}
    s: dict[str, Any] = {}

    def need(key: str) -> bool:
        """Whether ``key`` is computed here (else it is taken from ``given`` or ``base``)."""
        if key in given:
            s[key] = given[key]
            return False
        if base is None or key not in base or any(dep in moved for dep in GRAPH[key]):
            moved.add(key)
            return True
        s[key] = base[key]
        return False

    def bias(name: str) -> Any:
        return p[name] if _get(p, name) is not None else 0.0

    if spec.get("vision") and need("feats"):  # the image's features take the place of its tokens' embeddings
        s["feats"] = image_features(p, spec["vision"])
    if need("x"):
        x = p["embedding"][tokens[:m]]
        if spec.get("vision"):
            for j, q in enumerate(spec["vision"]["image_positions"]):
                if int(q) < m:
                    x[int(q)] = s["feats"][j]
        if spec["positions"] == "learned":
            x = x + p["position_embedding"][np.arange(m)]
        s["x"] = x
    if need("n1"):
        s["n1"] = by_rows(lambda r: normalized(s["x"][r], spec), m, pool)
    if need("h1"):
        s["h1"] = by_rows(lambda r: scaled(s["n1"][r], p["ln1"], _get(p, "ln1_bias")), m, pool)
    if need("k"):
        s["k"] = matmul_t(s["h1"], p["wk"], pool) + bias("bk")
    if need("v"):
        s["v"] = matmul_t(s["h1"], p["wv"], pool) + bias("bv")
    if need("k_rot"):
        k = s["k"].reshape(m, groups, d)
        if spec["positions"] == "rope":
            k = rope(k, np.arange(m), float(spec["rope_base"]))
        s["k_rot"] = np.ascontiguousarray(k.transpose(1, 2, 0))
    if need("q"):
        s["q"] = s["h1"][pos] @ p["wq"].T + bias("bq")
    if need("q_rot"):
        q = s["q"].reshape(len(pos), heads, d)
        if spec["positions"] == "rope":
            q = rope(q, pos, float(spec["rope_base"]))
        s["q_rot"] = q.reshape(len(pos), groups, per, d).transpose(1, 2, 0, 3).reshape(groups, per * len(pos), d)
    if need("probs"):
        w = np.matmul(s["q_rot"], s["k_rot"]).reshape(groups, per, len(pos), m)
        w /= math.sqrt(d)
        if spec["positions"] == "alibi":  # slope * (key position - query position), <= 0 on the causal side
            rel = np.arange(m)[None, :] - pos[:, None]
            w += alibi_slopes(heads).reshape(groups, per)[:, :, None, None] * rel[None, None]
        np.copyto(w, -np.inf, where=(np.arange(m)[None, :] > pos[:, None])[None, None])
        w -= w.max(axis=-1, keepdims=True)
        np.exp(w, out=w)
        w /= w.sum(axis=-1, keepdims=True)
        s["probs"] = w.reshape(groups, per * len(pos), m)
    if need("attention"):
        out = np.matmul(s["probs"], s["v"].reshape(m, groups, d).transpose(1, 0, 2))  # [groups, per * n, d]
        s["attention"] = out.reshape(groups, per, len(pos), d).transpose(2, 0, 1, 3).reshape(len(pos), heads * d)
    if need("o"):
        s["o"] = s["attention"] @ p["wo"].T + bias("bo")
    if need("r"):
        s["r"] = s["x"][pos] + s["o"]
    if need("n2"):
        s["n2"] = normalized(s["r"], spec)
    if need("h2"):
        s["h2"] = scaled(s["n2"], p["ln2"], _get(p, "ln2_bias"))
    swiglu = spec["mlp"] == "swiglu"
    if need("a"):
        s["a"] = s["h2"] @ p["w_gate"].T if swiglu else s["h2"] @ p["w_fc1"].T + p["b_fc1"]
    if swiglu and need("b"):
        s["b"] = s["h2"] @ p["w_up"].T
    if need("act"):
        s["act"] = silu(s["a"]) * s["b"] if swiglu else gelu_tanh(s["a"])
    if need("mlp"):
        s["mlp"] = s["act"] @ p["w_down"].T if swiglu else s["act"] @ p["w_fc2"].T + p["b_fc2"]
    if need("y"):
        s["y"] = s["r"] + s["mlp"]
    if need("nf"):
        s["nf"] = normalized(s["y"], spec)
    if need("final_norm"):
        s["final_norm"] = scaled(s["nf"], p["lnf"], _get(p, "lnf_bias"))
    s["layer"] = s["y"]
    return s


#: the tensors that enter the trunk through one affine map: a move along a direction d moves
#: that map's output by a multiple of what d alone gives there (what is moved, from what)
MATRIX_INTO = {
    "wq": ("q", "h1"),
    "wk": ("k", "h1"),
    "wv": ("v", "h1"),
    "wo": ("o", "attention"),
    "w_gate": ("a", "h2"),
    "w_fc1": ("a", "h2"),
    "w_up": ("b", "h2"),
    "w_down": ("mlp", "act"),
    "w_fc2": ("mlp", "act"),
}
BIAS_INTO = {
    "bq": "q",
    "bk": "k",
    "bv": "v",
    "bo": "o",
    "b_fc1": "a",
    "b_fc2": "mlp",
    "ln1_bias": "h1",
    "ln2_bias": "h2",
    "lnf_bias": "final_norm",
}
NORM_INTO = {"ln1": ("h1", "n1"), "ln2": ("h2", "n2"), "lnf": ("final_norm", "nf")}


def row_blocks(direction: Any, shape: tuple[int, ...]) -> Any:
    """A matrix-shaped direction a block of rows at a time: (first row, end row, the block); a
    block starts at a multiple of 8 elements (a sign direction starts at a byte)."""
    rows, cols = shape
    step = max(8, (1 << 20) // cols // 8 * 8)
    for r in range(0, rows, step):
        end = min(rows, r + step)
        yield r, end, direction(r * cols, (end - r) * cols).reshape(end - r, cols)


def along(name: str, direction: Any, p: dict, pos: np.ndarray, base: dict) -> tuple[float, dict | None, np.ndarray | None]:
    """The central differences' step ``eps`` along ``direction`` for ``p[name]`` (1e-5 of the
    tensor's size in the direction's units), and how the trunk moves per unit step: where the
    tensor enters through one affine map, the map's output moved (``h1 @ d.T`` for the key
    projection, ``n1 * d`` for the first norm's weight, and what that feeds through the key and
    value projections), else None and the direction itself (the embeddings, the vision tower:
    the trunk is evaluated with the tensor moved)."""
    theta = p[name]
    d = None
    if name in MATRIX_INTO:  # the direction a block of rows at a time: the map's output a block of columns each
        out, inp = MATRIX_INTO[name]
        x = base[inp][pos] if name == "wq" else base[inp]
        delta = np.empty((x.shape[0], theta.shape[0]))
        squares = 0.0
        for r, end, block in row_blocks(direction, theta.shape):
            delta[:, r:end] = x @ block.T
            squares += float(np.vdot(block, block))
        moves: dict | None = {out: delta}
    else:
        d = direction(0, theta.size).reshape(theta.shape)
        squares = float(np.vdot(d, d))
        moves = None
        if name in BIAS_INTO:
            moves = {BIAS_INTO[name]: d}
        elif name in NORM_INTO:
            out, inp = NORM_INTO[name]
            moves = {out: base[inp] * d}
        if name in ("ln1", "ln1_bias"):  # h1 feeds the keys and values at every position
            moves |= {"k": moves["h1"] @ p["wk"].T, "v": moves["h1"] @ p["wv"].T}
    scale = np.linalg.norm(theta) / max(math.sqrt(squares), 1e-300)
    return 1e-5 * (scale if scale > 0 else 1.0), moves, d


def moved(
    p: dict, spec: dict, tokens: np.ndarray, pos: np.ndarray, base: dict, name: str, eps: float, moves: dict | None, d: np.ndarray | None
) -> np.ndarray:
    """The final norm's output at ``pos`` with ``p[name]`` moved by ``eps`` along the direction
    (:func:`along`'s ``moves`` or ``d``): the trunk again from what the tensor reaches."""
    if moves is None:
        return trunk({**p, name: p[name] + eps * d}, spec, tokens, pos, base, name)["final_norm"]
    return trunk(p, spec, tokens, pos, base, name, {k: base[k] + eps * v for k, v in moves.items()})["final_norm"]


def central(g: dict, plus: np.ndarray, minus: np.ndarray, eps: float) -> float:
    """The central difference of the loss, chained through the final norm's outputs at +- eps."""
    return float(np.sum(g["z"] * (plus - minus)) / (2 * eps))


def head_rows(p: dict, spec: dict, a: int, b: int) -> np.ndarray:
    """Rows ``a`` .. ``b - 1`` of the head's weight as used, in float64."""
    w = widen(p["w_out"][a:b])
    if spec["head"] == "normhead":
        w = w / np.linalg.norm(w, axis=1, keepdims=True)
    return w


def head_block(p: dict) -> int:
    """Vocabulary rows of the head's weight per block: about 2 M elements."""
    return max(8, (1 << 21) // p["w_out"].shape[1] // 8 * 8)


def head(
    z: np.ndarray, p: dict, spec: dict, labels: np.ndarray, pool: ThreadPoolExecutor | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position cross-entropy at the sampled positions, and the exact gradient of their mean
    with respect to ``z`` and to the logits; a block of vocabulary rows at a time (on the pool)."""
    rows = head_block(p)
    starts = range(0, p["w_out"].shape[0], rows)
    logits = np.concatenate(pmap(lambda a: z @ head_rows(p, spec, a, a + rows).T, starts, pool), axis=1)
    mx = logits.max(axis=-1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(logits - mx).sum(axis=-1))
    loss = lse - logits[np.arange(len(labels)), labels]
    g_logits = np.exp(logits - lse[:, None])
    g_logits[np.arange(len(labels)), labels] -= 1.0
    g_logits /= len(labels)
    parts = pmap(lambda a: g_logits[:, a : a + rows] @ head_rows(p, spec, a, a + rows), starts, pool)
    return loss, np.sum(parts, axis=0), g_logits


def head_block_projection(p: dict, spec: dict, base: dict, g: dict, direction: Any, a: int) -> float:
    """<dL/dWout, d> on the head's vocabulary rows from ``a`` (a block of :func:`head_block`),
    exact (``direction(start, n)``: the direction's elements ``start`` .. ``start + n - 1``, flattened)."""
    w, z = p["w_out"], base["final_norm"]
    rows = min(head_block(p), w.shape[0] - a)
    g_l = g["logits"][:, a : a + rows]  # dL / d(these rows' logits)
    d = direction(a * w.shape[1], rows * w.shape[1]).reshape(rows, w.shape[1])
    if spec["head"] != "normhead":  # <g_l.T @ z, d> = <g_l, z @ d.T>
        return float(np.vdot(g_l, z @ d.T))
    wb = widen(w[a : a + rows])  # d(w / |w|) . d = (d - u (u . d)) / |w|
    nrm = np.linalg.norm(wb, axis=1, keepdims=True)
    u = wb / nrm
    d = (d - u * np.sum(u * d, axis=1, keepdims=True)) / nrm
    return float(np.vdot(g_l.T @ z, d))


def head_projection(p: dict, spec: dict, base: dict, g: dict, direction: Any) -> float:
    """<dL/dWout, d>, exact, a block of vocabulary rows at a time."""
    return sum(head_block_projection(p, spec, base, g, direction, a) for a in range(0, p["w_out"].shape[0], head_block(p)))


def projected_gradient(p: dict, spec: dict, tokens: np.ndarray, pos: np.ndarray, base: dict, g: dict, name: str, direction: Any) -> float:
    """<dL/d p[name], d> of the mean loss at ``pos`` (``direction(start, n)``: d's elements
    ``start`` .. ``start + n - 1``, flattened): central differences of the float64 trunk chained to
    the head's exact gradient (``g``: :func:`head`'s, at ``base``); for the head's own weight, exact."""
    if name == "w_out":
        return head_projection(p, spec, base, g, direction)
    if name == "embedding" and spec.get("tied"):
        return head_projection(p, spec, base, g, direction) + tied_lookup_projection(p, spec, tokens, pos, base, g, direction)
    eps, moves, d = along(name, direction, p, pos, base)
    plus = moved(p, spec, tokens, pos, base, name, eps, moves, d)
    minus = moved(p, spec, tokens, pos, base, name, -eps, moves, d)
    return central(g, plus, minus, eps)


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
    """Threads for the work, one a core: each calls BLAS with one thread of its own
    (training/conformance/__init__.py sets that), as OpenBLAS's own threads are one pool that
    callers on several threads would share."""
    return max(1, min(32, os.cpu_count() or 1))


def log(what: str, _t0: list = []) -> None:  # noqa: B006 - the first call's time, kept
    """Progress on stderr, with seconds since the first line."""
    _t0 = _t0 or _t0.append(time.monotonic()) or _t0
    print(f"reference: {time.monotonic() - _t0[0]:7.2f} s {what}", file=sys.stderr, flush=True)


#: the tensors whose every move reaches the keys and values at every position through a norm
#: (the embeddings, the vision tower): each side of their central difference is a task of its own
def _whole_trunk(name: str, spec: dict) -> bool:
    return name == "embedding" and not spec.get("tied") or name == "position_embedding" or name.startswith(VISION)


def _cost(name: str, spec: dict) -> int:
    """Rough order of a projection task's work, the largest first on the pool."""
    if _whole_trunk(name, spec) or name == "embedding":
        return 4
    return {"ln1": 3, "ln1_bias": 3, "wk": 2, "bk": 2, "wv": 2, "wq": 1, "bq": 1, "w_out": 1}.get(name, 0)


def check(probe: dict) -> dict:
    """Compare what the probe sent with the reference; the verdict and its figures."""
    t0 = time.monotonic()
    log("start")
    spec = json.loads(str(probe["spec"]))
    tol = spec["tolerance"]
    # numpy leaves the interpreter lock in its loops and BLAS calls: the work side by side on threads
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        # the head's weight, as large as the vocabulary, stays as it came and is widened a block at a time
        p = {k[6:]: v if k == "param:w_out" else as_f64(v, pool) for k, v in probe.items() if k.startswith("param:")}
        if spec.get("tied"):
            p["w_out"] = p["embedding"]  # one tensor: the head reads the embedding
        tokens = probe["tokens"].astype(np.int64)
        labels_all = probe["labels"].astype(np.int64)
        pos = probe["positions"].astype(np.int64)
        labels = labels_all[pos]
        seq = int(spec["seq_length"])
        log("read")
        ref = trunk(p, spec, tokens, pos, pool=pool)
        log("trunk")
        loss, g_z, g_logits = head(ref["final_norm"], p, spec, labels, pool)
        ref["loss"] = loss
        g = {"z": g_z, "logits": g_logits}
        log("head")
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

        # each job's tasks: the head's weight a block of vocabulary rows each, a tensor that reaches
        # every key and value through a norm one side of its central difference each, else one
        tasks: list[tuple[int, int, Any]] = []
        for j, (name, _kind, direction) in enumerate(jobs):
            if name == "w_out":
                for a in range(0, p["w_out"].shape[0], head_block(p)):
                    tasks.append((j, a, lambda a=a, direction=direction: head_block_projection(p, spec, ref, g, direction, a)))
            elif _whole_trunk(name, spec):
                for sign in (1, -1):

                    def side(name: str = name, direction: Any = direction, sign: int = sign) -> tuple[float, np.ndarray]:
                        eps, moves, d = along(name, direction, p, pos, ref)
                        return eps, moved(p, spec, tokens, pos, ref, name, sign * eps, moves, d)

                    tasks.append((j, sign, side))
            else:
                tasks.append(
                    (j, 0, lambda name=name, direction=direction: projected_gradient(p, spec, tokens, pos, ref, g, name, direction))
                )
        order = sorted(range(len(tasks)), key=lambda i: -_cost(jobs[tasks[i][0]][0], spec))
        futures = {pool.submit(tasks[i][2]): i for i in order}
        parts: dict[int, dict[int, Any]] = {j: {} for j in range(len(jobs))}
        wanted = {j: sum(1 for t in tasks if t[0] == j) for j in range(len(jobs))}
        true: dict[int, float] = {}
        for fut in as_completed(futures):
            j, part, _ = tasks[futures[fut]]
            parts[j][part] = fut.result()
            if len(parts[j]) < wanted[j]:
                continue
            name, kind, _ = jobs[j]
            got = parts[j]
            if name == "w_out":
                true[j] = float(sum(got[a] for a in sorted(got)))
            elif _whole_trunk(name, spec):
                (eps, plus), (_, minus) = got[1], got[-1]
                true[j] = central(g, plus, minus, eps)
            else:
                true[j] = got[0]
            log(f"gradient of {name} ({kind})")
    for j, (name, kind, _) in enumerate(jobs):
        dev = float(probe[f"grad:{name}:{kind}"])
        mag = float(probe[f"grad:{name}:{kind}_mag"])  # sum |g| |d|: the projection without cancellation
        err = abs(dev - true[j]) / mag if mag > 0 else (0.0 if true[j] == 0 else math.inf)
        rows.append({"tensor": f"gradient of {name} ({kind} direction)", "positions": None, "error": err, "tolerance": tol["gradient"]})
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


def load(src: str) -> dict[str, np.ndarray]:
    """The probe's arrays: a folder of ``.npy`` files, mapped (an ``.npz`` archive is read whole)."""
    if not os.path.isdir(src):
        with np.load(src, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    return {n[:-4]: np.load(os.path.join(src, n), mmap_mode="r", allow_pickle=False) for n in os.listdir(src) if n.endswith(".npy")}


def main(argv: list[str]) -> int:
    src, dst = argv[1], argv[2]
    verdict = check(load(src))
    with open(dst, "w", encoding="utf-8") as fh:
        json.dump(verdict, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
