"""gpt3/paddle's conformance probe: one decoder layer, the embeddings and the tied loss head of
PaddleNLP's ``GPTForCausalLM``, built as the run builds it (model.py: the config of the run's
switches, fused QKV, recompute, flash attention where the build has it; the run's precision and
AMP level), the vendor's adapter and hooks already applied, run forward and backward once on
seeded inputs; what it computed goes to the reference (training/conformance/reference.py) in
the probe file, as numpy arrays (paddle has no torch: export.ProbeFile.parameter_numpy).

One process, no fleet: tensor, pipeline and sharding layouts schedule and place the same math,
which the loss gate judges across layouts. Dropout is off (the reference has none): the check is
of the deterministic math of a step.

The output layer is the token embedding (``tied``): the whole table goes to the reference, whose
gradient is the lookup's and the head's together. The loss is PaddleNLP's own criterion with
every label but those of the sampled positions ignored (-100): the mean of the per-token loss
there.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import numpy as np

_SCHEDULE_ONLY = {"tp": 1, "pp": 1, "sharding_stage": 0, "sharding_degree": 1, "sequence_parallel": False}


def probe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's config for a probe: one layer, one process, one sequence, no dropout."""
    one = copy.deepcopy(cfg)
    one["model"]["num_layers"] = 1
    one["parallel"].update(_SCHEDULE_ONLY)
    one["train"].update(micro_batch=1, global_batch=1, gradient_accumulation_steps=None, hidden_dropout=0.0, attention_dropout=0.0)
    return one


def probe(cfg: dict[str, Any], out: Any) -> None:
    """Fill ``out`` (training.conformance.export.ProbeFile's maker: ``out(spec, precision)``)."""
    import paddle
    import paddle.nn.functional as F

    from cases.gpt3.paddle import model as gpt3_model
    from cases.gpt3.paddle.settings import from_config
    from training.conformance.export import log, sample_positions

    log("imported")
    s = from_config(probe_config(cfg), 1)
    sh, train = s.shape, s.common.train
    paddle.set_device("cpu" if s.device == "cpu" else f"{s.device}:0")
    flash = s.layout.use_flash_attention and gpt3_model.flash_attention_available(s.device)
    model = gpt3_model.build_model(s, gpt3_model.gpt_config(s, 1, 0, flash))
    params = dict(model.named_parameters())
    h = sh.hidden_size
    for name, p in params.items():  # float32 draws of order-one activations, numpy's, seeded by name
        rng = np.random.default_rng(train.seed + zlib.crc32(name.encode()))
        w = rng.standard_normal(p.shape)
        if "norm" in name and name.endswith(".weight"):
            w = 1.0 + 0.1 * w
        elif name.endswith(".bias"):
            w = 0.1 * w
        elif "embeddings" in name:  # the token table is the head too: logits of unit spread
            w = w / h**0.5
        else:  # paddle's Linear weight is [in, out]
            w = w / p.shape[0] ** 0.5
        p.set_value(w.astype(np.float32))
    amp = {"fp16": "float16", "bf16": "bfloat16"}.get(train.precision)
    if amp and s.own.amp_level == "O2":  # as train.py: the weights in the run's dtype
        model = paddle.amp.decorate(models=model, level="O2", dtype=amp)
    model.train()
    log("built")

    seq, vocab = sh.seq_length, sh.vocab_size
    rng = np.random.default_rng(train.seed + 17)
    tokens = rng.integers(0, vocab, seq)
    labels = rng.integers(0, vocab, seq)
    positions = sample_positions(seq)
    sampled = np.full(seq, -100, dtype=np.int64)
    sampled[positions] = labels[positions]
    caught: dict[str, Any] = {}

    def keep(key: str, value: Any) -> None:
        caught.setdefault(key, value.detach())  # the forward's, not a recomputation's

    layer = model.gpt.decoder.layers[0]
    layer.self_attn.out_proj.register_forward_pre_hook(lambda m, a: keep("attention", a[0]))
    layer.register_forward_post_hook(lambda m, a, o: keep("layer", o[0] if isinstance(o, (tuple, list)) else o))
    x, y = paddle.to_tensor(tokens[None]), paddle.to_tensor(sampled[None])
    if amp:  # train.py's autocast
        white = ["lookup_table", "lookup_table_v2"] if s.own.amp_level == "O2" else []
        black = ["reduce_sum", "c_softmax_with_cross_entropy"]
        with paddle.amp.auto_cast(enable=True, custom_white_list=white, custom_black_list=black, level=s.own.amp_level, dtype=amp):
            loss, logits = model(x, labels=y)
    else:
        loss, logits = model(x, labels=y)
    loss.backward()
    log("forward and backward")
    pos_t = paddle.to_tensor(positions)
    with paddle.no_grad():
        picked = paddle.index_select(logits.detach()[0].astype("float32"), pos_t)
        per_token = F.cross_entropy(picked, paddle.to_tensor(labels[positions][:, None]), reduction="none")

    heads, d = sh.num_heads, h // sh.num_heads
    f = out(
        {
            "family": "gpt3",
            "positions": "learned",
            "norm": "layer",
            "norm_eps": float(sh.norm_eps),
            "mlp": "gelu",
            "head": "plain",
            "tied": True,
            "heads": heads,
            "groups": heads,
            "head_dim": d,
            "seq_length": seq,
            "attention_kernel": "flash" if flash else "core",
        },
        train.precision,
    )
    f.inputs(tokens, labels, positions)

    def at_positions(t: Any) -> np.ndarray:
        return paddle.index_select(t[0].astype("float32"), pos_t).numpy()

    f.output("attention", at_positions(caught["attention"]))
    f.output("layer", at_positions(caught["layer"]))
    f.output("loss", per_token.numpy().reshape(-1))

    def value(p: Any) -> np.ndarray:
        return p.numpy() if p.dtype != paddle.float16 else p.astype("float32").numpy()

    def grad(p: Any) -> np.ndarray | None:
        return None if p.grad is None else p.grad.astype("float32").numpy()

    prefix = "gpt.decoder.layers.0."
    used = set()

    def take(key: str) -> tuple[np.ndarray, np.ndarray | None]:
        used.add(key)
        return value(params[key]), grad(params[key])

    f.parameter_numpy("embedding", *take("gpt.embeddings.word_embeddings.weight"), salt=1)
    table, g_table = take("gpt.embeddings.position_embeddings.weight")
    f.parameter_numpy("position_embedding", table[:seq], None if g_table is None else g_table[:seq], salt=13)

    def bias(name: str, b: np.ndarray, g: np.ndarray | None, salt: int) -> None:
        if name == "k":  # q . bk is one constant over a query's keys, which softmax drops: its gradient is
            f.add_array("param:bk", b)  # zero in exact arithmetic, rounding noise here; sent as a value only
        else:
            f.parameter_numpy(f"b{name}", b, g, salt=salt)

    if prefix + "self_attn.qkv_proj.weight" in params:  # [in, heads x (q, k, v) x head_dim]: per head, as PaddleNLP splits it
        w, g = take(prefix + "self_attn.qkv_proj.weight")
        b, gb = take(prefix + "self_attn.qkv_proj.bias")
        for i, name in enumerate(("q", "k", "v")):
            f.parameter_numpy(
                f"w{name}", w.reshape(h, heads, 3, d)[:, :, i].reshape(h, h).T, _part(g, (h, heads, 3, d), i, (h, h)), salt=2 + i
            )
            bias(name, b.reshape(heads, 3, d)[:, i].reshape(h), _part(gb, (heads, 3, d), i, (h,)), salt=14 + i)
    else:
        for i, name in enumerate(("q", "k", "v")):
            w, g = take(f"{prefix}self_attn.{name}_proj.weight")
            f.parameter_numpy(f"w{name}", w.T, None if g is None else g.T, salt=2 + i)
            bias(name, *take(f"{prefix}self_attn.{name}_proj.bias"), salt=14 + i)
    for name, key, salt in (("wo", "self_attn.out_proj", 7), ("w_fc1", "linear1", 5), ("w_fc2", "linear2", 8)):
        w, g = take(f"{prefix}{key}.weight")
        f.parameter_numpy(name, w.T, None if g is None else g.T, salt=salt)  # paddle's [in, out] as the reference's [out, in]
        f.parameter_numpy({"wo": "bo", "w_fc1": "b_fc1", "w_fc2": "b_fc2"}[name], *take(f"{prefix}{key}.bias"), salt=salt + 20)
    for name, key, salt in (("ln1", prefix + "norm1", 10), ("ln2", prefix + "norm2", 11), ("lnf", "gpt.decoder.norm", 12)):
        f.parameter_numpy(name, *take(f"{key}.weight"), salt=salt)
        f.parameter_numpy(f"{name}_bias", *take(f"{key}.bias"), salt=salt + 10)
    missing = set(params) - used
    if missing:
        raise RuntimeError(f"conformance probe: parameters the reference does not read: {', '.join(sorted(missing))}")


def _part(g: np.ndarray | None, shape: tuple[int, ...], i: int, to: tuple[int, ...]) -> np.ndarray | None:
    """Part ``i`` of (q, k, v) of a fused gradient, as the reference's tensor (weights transposed)."""
    if g is None:
        return None
    part = g.reshape(shape)[:, :, i] if len(shape) == 4 else g.reshape(shape)[:, i]
    return part.reshape(to).T if len(to) == 2 else part.reshape(to)


def before_fork(cfg: dict[str, Any]) -> None:
    """The probe's imports, made in the rank before it forks the probe (the build imports them next)."""
    from paddlenlp.transformers import GPTForCausalLM  # noqa: F401

    from cases.gpt3.paddle import model  # noqa: F401


def after_fork(cfg: dict[str, Any]) -> None:
    """Nothing: paddle's CPU kernels compute in a forked child as in a spawned one."""


def device_name(cfg: dict[str, Any]) -> str:
    """The probe's device as paddle names it (its environment has no torch): the ceiling's
    timers' name (the vendor's memory query's, else the device's own)."""
    from cases.gpt3.paddle.ceiling import PaddleTimers
    from cases.gpt3.paddle.settings import from_config

    s = from_config(probe_config(cfg), 1)
    return PaddleTimers(s.device, "cpu" if s.device == "cpu" else f"{s.device}:0", cfg.get("vendor") or {}).device_name()
