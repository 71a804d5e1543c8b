"""The kernel ceiling of gpt3/paddle (training/ceiling.py), timed with paddle.

One GPU of a ``tp``-way tensor-parallel group runs, for a micro batch of ``train.micro_batch``
sequences of ``seq_length`` tokens, what PaddleNLP 2.8.1's GPT (model.py) runs, at its shard's
shape:

- per decoder layer: the query, key and value projections, as one ``qkv_proj`` (hidden ->
  3 x hidden / tp) with ``parallel.fuse_attention_qkv``, else three of hidden -> hidden / tp
  (``q_proj``, ``k_proj``, ``v_proj``: one shape, timed once and counted three times a layer);
  ``out_proj`` (hidden / tp -> hidden, row-parallel), ``linear1`` (hidden -> ffn / tp) and
  ``linear2`` (ffn / tp -> hidden), each with its forward, data-gradient and weight-gradient
  product in the layouts paddle's ``matmul`` and its gradient run them for an ``nn.Linear``
  (the weight stored ``[in, out]``: ``x @ W``, ``dy @ W^T``, ``x^T @ dy``). Sequence
  parallelism gathers the sequence before the column-parallel layers and scatters it after the
  row-parallel ones: the products keep these shapes;
- once: the output layer tied to the token embedding (``GPTLMHead``: ``parallel_matmul`` of
  the hidden states and the embedding's ``[vocab / tp, hidden]`` shard, ``x @ E^T``, ``dy @ E``,
  ``dy^T @ x``);
- per decoder layer, the attention of ``num_heads / tp`` heads, forward and backward, with the
  function the model calls on the ``[b, s, heads, d]`` query, key and value: where the run
  has paddle's flash-attention kernel (model.py's ``flash_attention_available``),
  ``MultiHeadAttention._flash_attention`` (``paddle.nn.functional.flash_attention``, causal);
  else ``MultiHeadAttention._core_attention`` (``QK^T``, the causal mask, softmax, ``AV``): with
  the additive ``-1e4`` mask ``GPTModel`` makes from its lower-triangular buffer when pp is 1,
  without a mask in the pipeline model (which then masks inside the call: paddle's fused
  upper-triangle softmax on a CUDA build, else a ``-inf`` upper triangle made each call). Both
  with the run's ``attention_dropout``, as the model trains.

In the run's precision (fp16, bf16, else fp32); recompute, LayerNorm, GELU, dropout outside
the attention, the loss and the communication are left out, and pipeline stages split the
layers without changing the ceiling. The kernels are timed as training/ceiling.py's torch ones
(two warm-up calls, the median of three means over five calls), with paddle: its device's
timing events (``paddle.device.Event``) where the device has them, the wall clock on the CPU,
where paddle's operations return when done.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from training import ceiling

if TYPE_CHECKING:
    from cases.gpt3.paddle.settings import Settings
    from training.metriclog import MetricLogger

#: the run's precision as paddle's dtype of its products (AMP O1 and O2 both run them in it)
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

#: GEMMs whose weight is stored ``[out, in]`` (the tied embedding); an ``nn.Linear``'s is ``[in, out]``
OUT_IN_WEIGHTS = frozenset({"lm_head"})


def gemms(s: Settings) -> list[ceiling.Gemm]:
    """One micro batch's linear layers on one TP rank, by PaddleNLP's names (every product of each)."""
    sh, lay = s.shape, s.layout
    h, f, v, tp = sh.hidden_size, sh.ffn_hidden_size, sh.vocab_size, lay.tp
    tokens = lay.micro_batch * sh.seq_length
    if lay.fuse_attention_qkv:
        qkv = [ceiling.Gemm("qkv_proj", tokens, 3 * h // tp, h)]
    else:
        qkv = [ceiling.Gemm("q_proj, k_proj, v_proj", tokens, h // tp, h, count=3 * sh.num_layers)]
    return [
        *qkv,
        ceiling.Gemm("out_proj", tokens, h, h // tp),
        ceiling.Gemm("linear1", tokens, f // tp, h),
        ceiling.Gemm("linear2", tokens, h, f // tp),
        ceiling.Gemm("lm_head", tokens, v // tp, h, per_layer=False),
    ]


def attention(s: Settings, flash: bool) -> tuple[Callable[[Any, Any, Any], Any], str]:
    """The model's own attention function for this run and its name: PaddleNLP's
    ``MultiHeadAttention._flash_attention`` or ``_core_attention``, called as the layer calls it
    (its config, head size, training mode; the mask ``GPTModel`` hands it)."""
    import paddle
    from paddlenlp.transformers.gpt.modeling import MultiHeadAttention

    from cases.gpt3.paddle import model as gpt3_model

    lay, sh = s.layout, s.shape
    config = gpt3_model.gpt_config(s, lay.tp, 0, flash)
    layer = types.SimpleNamespace(config=config, head_dim=sh.hidden_size // sh.num_heads, training=True)
    dropout = f", dropout {s.own.attention_dropout:g}" if s.own.attention_dropout else ""
    if flash:
        return (lambda q, k, v: MultiHeadAttention._flash_attention(layer, q, k, v)), f"paddle flash_attention, causal{dropout}"
    if lay.pp > 1:  # the pipeline's embedding hands the layers no mask: the call masks
        mask = None
        how = "fused upper-triangle softmax" if paddle.is_compiled_with_cuda() else "-inf upper triangle made per call, softmax"
    else:  # GPTModel.forward's mask from its lower-triangular buffer
        causal = paddle.tril(paddle.ones([1, 1, sh.seq_length, sh.seq_length], dtype="int64"))
        mask = (1.0 - causal) * -1e4
        mask.stop_gradient = True
        how = "additive -1e4 causal mask, softmax"
    name = f"core attention (QK^T, {how}, AV{dropout})"
    return (lambda q, k, v: MultiHeadAttention._core_attention(layer, q, k, v, attention_mask=mask)), name


class PaddleTimers:
    """training/ceiling.py's :class:`~training.ceiling.Timers` in paddle on the current device
    (``device``: paddle's name of its type, ``cpu``, ``gpu``, ``xpu`` or a custom device's;
    ``place``: e.g. ``gpu:0``; ``vendor``: resolved.json's section, for its ``memory_query``)."""

    def __init__(self, device: str, place: str, vendor: Mapping[str, Any]):
        self.device, self.place, self.vendor = device, place, vendor

    def timers(self) -> ceiling.Timers:
        return ceiling.Timers(gemm=self.gemm, attention=self.attention, device_name=self.device_name, release=self.release)

    # -- the device's calls ------------------------------------------------
    def synchronize(self) -> None:
        import paddle

        if self.device != "cpu":  # on the CPU an operation returns when it is done
            paddle.device.synchronize()

    def _events(self) -> tuple[Any, Any] | None:
        import paddle

        if self.device == "cpu":
            return None
        try:
            return paddle.device.Event(enable_timing=True), paddle.device.Event(enable_timing=True)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):  # a stack without timing events
            return None

    def seconds_per_call(self, fn: Callable[[], Any], n: int) -> float:
        """Seconds per call over ``n`` back-to-back calls: between two timing events on the
        device's stream, else by the wall clock between two synchronizes."""
        events = self._events()
        if events is not None:
            start, end = events
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3 / n
        self.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        self.synchronize()
        return (time.perf_counter() - t) / n

    def _seconds(self, fn: Callable[[], Any], repeat: int) -> float:
        return ceiling.median_seconds(fn, self.synchronize, self.seconds_per_call, repeat=repeat)

    def _module(self) -> Any:
        from training.paddle_loop import device_module

        return device_module(self.device)

    def device_name(self, _device: Any = None) -> str:
        """The memory query's name (train.py's ``_memory``), else the device's own."""
        import importlib

        import paddle

        spec = self.vendor.get("memory_query")
        if spec:
            module, _, func = str(spec).partition(":")
            return str(getattr(importlib.import_module(module), func)(self.place)[2])
        if self.device == "cpu":
            return "cpu"
        props = getattr(self._module(), "get_device_properties", None)  # as train.py's _memory names it
        return str(props(self.place).name) if props is not None else str(paddle.device.get_device_name(self.place))

    def release(self) -> None:
        """The allocator's cached blocks back to the device."""
        empty = getattr(self._module(), "empty_cache", None)
        if self.device != "cpu" and empty is not None:
            empty()

    def reset_peak(self) -> None:
        """The allocator's peaks restarted (after the ceiling, so the run's own are reported)."""
        if self.device == "cpu":
            return
        mod = self._module()
        for call in ("reset_max_memory_allocated", "reset_max_memory_reserved"):
            if hasattr(mod, call):
                getattr(mod, call)(self.place)

    # -- the kernels ----------------------------------------------------------
    @staticmethod
    def _randn(shape: list[int], dtype: str, grad: bool = False) -> Any:
        import paddle

        t = paddle.randn(shape, dtype="float32").astype(dtype)
        t.stop_gradient = not grad
        return t

    def gemm(self, g: ceiling.Gemm, dtype: str, _device: Any, repeat: int) -> dict[str, float]:
        """Each product of ``g.products`` alone, as paddle's matmul and its gradient run it for
        the layer's weight layout (:data:`OUT_IN_WEIGHTS`)."""
        import paddle

        x = self._randn([g.m, g.k], dtype)
        dy = self._randn([g.m, g.n], dtype)
        if g.name in OUT_IN_WEIGHTS:  # y = x @ E^T, E [n, k]
            w = self._randn([g.n, g.k], dtype)
            calls = {
                "fwd": lambda: paddle.matmul(x, w, transpose_y=True),
                "dgrad": lambda: paddle.matmul(dy, w),
                "wgrad": lambda: paddle.matmul(dy, x, transpose_x=True),
            }
        else:  # y = x @ W, W [k, n]
            w = self._randn([g.k, g.n], dtype)
            calls = {
                "fwd": lambda: paddle.matmul(x, w),
                "dgrad": lambda: paddle.matmul(dy, w, transpose_y=True),
                "wgrad": lambda: paddle.matmul(x, dy, transpose_x=True),
            }
        return {f"{p}_s": self._seconds(calls[p], repeat) for p in g.products}

    def attention(self, block: ceiling.Attention, dtype: str, _device: Any, repeat: int) -> float:
        """``block.attend`` on ``[b, s, heads, d]`` query, key and value (the layout the model
        hands its attention function), and with ``block.backward`` the backward of its output
        to the three."""
        b, s, d = block.batch, block.seq, block.head_dim
        leaves = [self._randn([b, s, h, d], dtype, grad=block.backward) for h in (block.heads, block.groups, block.groups)]
        grad: list[Any] = []

        def step() -> None:
            out = block.attend(*leaves)
            if not block.backward:
                return
            if not grad:  # the upstream gradient, of the output's shape
                grad.append(self._randn(list(out.shape), dtype))
            out.backward(grad[0])
            for t in leaves:
                t.clear_gradient(False)

        return self._seconds(step, repeat)


def kernel_ceiling(s: Settings, place: str, vendor: Mapping[str, Any], flash: bool, repeat: int = 5) -> tuple[dict[str, Any], PaddleTimers]:
    """training/ceiling.py's ceiling of this run's micro batch on paddle's current device
    ``place``, and the timers (their ``reset_peak`` for the caller once the buffers are gone)."""
    sh, lay = s.shape, s.layout
    dtype = DTYPES[s.common.train.precision]
    attend, name = attention(s, flash)
    heads = sh.num_heads // lay.tp
    timers = PaddleTimers(s.device, place, vendor)
    value = ceiling.measure(
        gemms(s),
        sh.num_layers,
        attend,
        name,
        batch=lay.micro_batch,
        heads=heads,
        groups=heads,
        seq=sh.seq_length,
        head_dim=sh.hidden_size // sh.num_heads,
        tp=lay.tp,
        dtype=dtype,
        device=place,
        repeat=repeat,
        layout="bshd",
        timers=timers.timers(),
        hold_s=s.common.train.ceiling_hold_s,
    )
    return value, timers


def ceiling_only(cfg: dict, log: MetricLogger) -> None:
    """``--ceiling`` (start_task.py --ceiling): the ceiling of the configured layout on the
    vendor's first device, as one ``info`` record; no process group, model or data."""
    from cases.gpt3.paddle import model as gpt3_model
    from cases.gpt3.paddle import settings as case_settings

    vendor = cfg.get("vendor") or {}

    def first_device(_cfg: dict) -> tuple[str, None]:
        import paddle

        device = case_settings.paddle_device(str(vendor.get("device") or "cpu"))
        place = "cpu" if device == "cpu" else f"{device}:0"
        paddle.set_device(place)
        return place, None

    def measure(world: int, _phase: str | None, place: str, _acc: None) -> dict[str, Any]:
        s = case_settings.from_config(cfg, world)
        flash = s.layout.use_flash_attention and gpt3_model.flash_attention_available(s.device)
        return kernel_ceiling(s, place, vendor, flash)[0]

    ceiling.record_alone(cfg, log, measure, first_device=first_device)
