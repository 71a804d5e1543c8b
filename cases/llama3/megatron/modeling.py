"""Llama 3 on megatron-core: transformer config, layer spec, core attention, model.

Imported after ``training.runtime.setup()`` (the vendor adapter must run
before megatron is imported).  Works with megatron-core 0.16 and 0.19.

Switches (settings.py): ``parallel.attention`` picks the core attention (``sdpa``: torch
SDPA, torch picks the kernel; ``cudnn``: torch SDPA on its cuDNN backend; ``local``:
megatron's; ``te``), ``parallel.fused_elementwise`` the RMSNorm and SwiGLU modules
(kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from cases.llama3.megatron import kernels, tp_gemm_comm
from cases.llama3.megatron.settings import Settings
from training.accelerator import Accelerator

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails on import
        return False
    return True


class SDPACoreAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    A drop-in for megatron's ``DotProductAttention`` (same constructor and
    forward arguments): causal, grouped-query attention without materialising
    the score matrix and without repeating K/V across the heads of a group
    (``enable_gqa``), so torch picks its flash / memory-efficient kernel.
    Takes ``[s, b, heads, head_dim]`` query and ``[s, b, groups, head_dim]``
    key/value, returns ``[s, b, heads * head_dim]``, for this rank's share of
    the heads under tensor parallelism.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        tp = (
            pg_collection.tp.size()
            if pg_collection is not None and hasattr(pg_collection, "tp")
            else (parallel_state.get_tensor_model_parallel_world_size())
        )
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.head_dim = head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(f"{type(self).__name__} supports neither packed sequences nor an attention bias")
        # megatron hands [s, b, heads, d]; the kernels take [b, heads, s, d]
        out = self.attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
        return kernels.sbhd_hand_on(out)  # [s, b, heads * d]: the attention checks hand it on the same way

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``[b, heads, s, d]`` inputs (K/V with their own, fewer heads); the
        kernel torch picks is checked at the layer's shape before its first use
        (``kernels.checked_attention``) unless attention dropout makes it random."""
        if self.training and self.dropout:
            return sdpa_attention(q, k, v, self.scale, self.dropout)
        return kernels.checked_attention(
            "sdpa",
            lambda a, b, c: sdpa_attention(a, b, c, self.scale),
            q,
            k,
            v,
            self.scale,
            "torch picked this kernel itself: hold it to another with parallel.attention (cudnn, local)",
        )


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal grouped-query attention through torch SDPA, torch picking the kernel."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class CuDNNCoreAttention(SDPACoreAttention):
    """``SDPACoreAttention`` on torch's cuDNN SDPA backend alone (``parallel.attention: cudnn``).

    Query, key and value go to the kernel as contiguous ``[b, heads, s, d]`` tensors; K/V keep
    their own heads (GQA through ``enable_gqa``, no copies) where this torch's cuDNN backend
    runs that, else each K/V head is repeated over its group (``kernels.cudnn_attention_mode``
    decides once per process, when the first layer is built, and raises where the backend
    does not run at all); the first call at each shape checks the kernel there
    (``kernels.cudnn_attention``: causal, and agreeing with flash attention), since a kernel that
    passes on a short problem can fail at the case's sequence length.
    """

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        # cuDNN is CUDA's alone: settings.check_device refuses the switch on any other vendor.device
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.gqa = kernels.cudnn_attention_mode(self.heads, self.groups, self.head_dim, config.params_dtype, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout:
            raise ValueError("CuDNNCoreAttention runs without attention dropout")
        return kernels.cudnn_attention(q, k, v, self.scale, self.gqa)


CORE_ATTENTION = {"sdpa": SDPACoreAttention, "cudnn": CuDNNCoreAttention}


def kernel_ceiling(s: Settings, device: torch.device, accelerator: Accelerator | None = None, repeat: int = 5) -> dict[str, Any]:
    """training/ceiling.py's kernel ceiling of this layout on ``device``: one tensor-parallel
    rank's GEMMs of a micro batch and its core attention, with the kernel ``parallel.attention``
    picks (``sdpa`` or ``cudnn``; megatron's ``local`` and TE's are timed as SDPA, named so),
    timed and named by ``accelerator`` (the vendor's; default: the device type's calls)."""
    from training import ceiling

    sh, lay = s.shape, s.layout
    d = sh.hidden_size // sh.num_heads
    heads, groups = sh.num_heads // lay.tp, sh.num_kv_groups // lay.tp
    scale = 1.0 / math.sqrt(d)
    dtype = DTYPES[s.common.train.precision]
    if lay.attention == "cudnn":
        gqa = kernels.cudnn_attention_mode(heads, groups, d, dtype, device)
        attend, name = (lambda q, k, v: kernels.cudnn_attention(q, k, v, scale, gqa)), f"cudnn, GQA {gqa}"
    else:
        attend = lambda q, k, v: sdpa_attention(q, k, v, scale)
        name = "sdpa" if lay.attention == "sdpa" else f"sdpa (standing in for {lay.attention})"
    tokens = lay.micro_batch * sh.seq_length
    gemms = ceiling.decoder_gemms(sh.hidden_size, sh.ffn_hidden_size, sh.num_heads, sh.num_kv_groups, d, sh.vocab_size, lay.tp, tokens)
    return ceiling.measure(
        gemms,
        sh.num_layers,
        attend,
        name,
        batch=lay.micro_batch,
        heads=heads,
        groups=groups,
        seq=sh.seq_length,
        head_dim=d,
        tp=lay.tp,
        dtype=dtype,
        device=device,
        repeat=repeat,
        accelerator=accelerator,
        hold_s=s.common.train.ceiling_hold_s,
    )


def use_transformer_engine(s: Settings) -> bool:
    impl = s.layout.transformer_impl
    if impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError("parallel.transformer_impl: transformer_engine, but transformer_engine does not import")
        return True
    return impl == "auto" and s.common.device == "cuda" and transformer_engine_available()  # TransformerEngine: NVIDIA's, CUDA only


def layer_spec(s: Settings) -> ModuleSpec:
    """Megatron's local layer spec (TransformerEngine's where it is used), core attention per
    ``parallel.attention``, norms and MLP activation per ``parallel.fused_elementwise``."""
    fused = fused_elementwise_in_use(s)
    if use_transformer_engine(s):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        if s.layout.attention == "te":
            raise RuntimeError("parallel.attention: te needs TransformerEngine, which is not in use")
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if s.layout.attention in CORE_ATTENTION:
        spec.submodules.self_attention.submodules.core_attention = CORE_ATTENTION[s.layout.attention]
    if s.layout.tp_comm_overlap == "halves":
        if use_transformer_engine(s):
            raise RuntimeError(
                "parallel.tp_comm_overlap: halves runs megatron's local layers, not TransformerEngine's (set transformer_impl: local)"
            )
        spec.module = HalvesOverlapLayer
    if s.layout.tp_comm_overlap == "symm_mem":
        if use_transformer_engine(s):
            raise RuntimeError(
                "parallel.tp_comm_overlap: symm_mem replaces megatron's local linear layers, not TransformerEngine's "
                "(set transformer_impl: local)"
            )
        attention = spec.submodules.self_attention.submodules
        attention.linear_qkv, attention.linear_proj = tp_gemm_comm.GatherColumnParallelLinear, tp_gemm_comm.ReduceScatterRowParallelLinear
        _set_mlp_submodules(
            spec, linear_fc1=tp_gemm_comm.GatherColumnParallelLinear, linear_fc2=tp_gemm_comm.ReduceScatterRowParallelLinear
        )
    if fused_add_norm_in_use(s):
        spec.module = AddNormLayer
    if fused != "none":
        spec.submodules.input_layernorm = kernels.NORMS[fused]
        spec.submodules.pre_mlp_layernorm = kernels.NORMS[fused]
        _set_mlp_submodules(spec, activation_func=kernels.ACTIVATIONS[fused])
    return spec


class _StartAllReduce(torch.autograd.Function):
    """Sum ``x`` over the tensor-parallel group in place, asynchronously: the work handle goes to
    ``pending``, whoever uses ``x`` waits on it first. The gradient passes unchanged, as it does
    through megatron's own all-reduce after a row-parallel linear layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, pending: list) -> torch.Tensor:
        ctx.mark_dirty(x)
        pending.append(torch.distributed.all_reduce(x, group=group, async_op=True))
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


class HalvesOverlapLayer(TransformerLayer):
    """megatron's transformer layer run as two halves A and B of its micro batch
    (``parallel.tp_comm_overlap: halves``), so that the tensor-parallel all-reduces after the
    attention's and the MLP's row-parallel layers run while the other half computes:

        attention(A), its all-reduce starts; [B's MLP sum of the layer before arrives];
        attention(B), its all-reduce starts (A's runs meanwhile);
        A: residual, MLP, all-reduce starts (B's attention sum runs meanwhile);
        B: residual, MLP, all-reduce starts (A's MLP sum runs meanwhile); A's residual.

    B's MLP sum is handed to the next layer, which needs it only after its attention(A): every
    all-reduce has the other half's work queued behind it except the last layer's last. The
    row-parallel layers hand on their partial sums (megatron's ``explicit_expert_comm``) and this
    layer reduces them. Every half is computed as the whole batch would be, sample by sample.

    Between two linked layers (:func:`link_layers`, in :func:`build_model`) the hidden states
    hold B without its last MLP sum, which the next layer adds: only the stage's last layer hands
    on finished hidden states. The halves leave a layer stacked so that the next takes each as it
    is, without a copy (one copy at the stage's first layer); the stage's last layer hands on a
    contiguous tensor (to the final norm, or sent to the next stage whole). A layer not linked
    finishes both halves itself."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = self.config
        if cfg.hidden_dropout or cfg.add_bias_linear or cfg.sequence_parallel:
            raise RuntimeError("parallel.tp_comm_overlap: halves needs no hidden dropout, no linear biases and no sequence parallelism")
        for lin in (self.self_attention.linear_proj, self.mlp.linear_fc2):
            if not hasattr(lin, "explicit_expert_comm") or not getattr(lin, "skip_bias_add", False):
                raise RuntimeError(
                    f"parallel.tp_comm_overlap: halves: this megatron-core's {type(lin).__name__} cannot hand on its partial sums"
                )
            lin.explicit_expert_comm = True  # no all-reduce of its own: this layer's
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.handoff: list = []  # B's MLP sum on its way, from the layer before to this one
        self.takes_over = self.hands_on = False

    def _reduce(self, output: tuple) -> tuple[torch.Tensor, list]:
        pending: list = []
        return _StartAllReduce.apply(output[0], self.tp_group, pending), pending

    @staticmethod
    def _done(started: tuple[torch.Tensor, list]) -> torch.Tensor:
        x, pending = started
        pending.pop().wait()
        return x

    def _attention(self, x: torch.Tensor, attention_mask: Any, rotary_pos_emb: Any) -> tuple[torch.Tensor, list]:
        return self._reduce(self.self_attention(self.input_layernorm(x), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, rotary_pos_emb: Any = None, **kwargs: Any) -> tuple:
        given = sorted(k for k, v in kwargs.items() if v is not None)
        if given:
            raise RuntimeError(
                f"parallel.tp_comm_overlap: halves: the layer was given {', '.join(given)}, which its schedule does not handle"
            )
        if self.takes_over and len(self.handoff) != 1:
            raise RuntimeError(f"parallel.tp_comm_overlap: halves: layer {self.layer_number} has no sum handed on from the layer before")
        behind = self.handoff.pop() if self.takes_over else None
        self.handoff.clear()
        s, b, h = hidden_states.shape
        x_a, x_b = (x.contiguous() for x in hidden_states.unflatten(1, (2, b // 2)).unbind(1))
        att_a = self._attention(x_a, attention_mask, rotary_pos_emb)
        if behind is not None:
            x_b = x_b + self._done(behind)
        att_b = self._attention(x_b, attention_mask, rotary_pos_emb)
        mid_a = x_a + self._done(att_a)
        mlp_a = self._reduce(self.mlp(self.pre_mlp_layernorm(mid_a)))
        mid_b = x_b + self._done(att_b)
        mlp_b = self._reduce(self.mlp(self.pre_mlp_layernorm(mid_b)))
        out_a = mid_a + self._done(mlp_a)
        if self.hands_on:
            self.handoff.append(mlp_b)
            out_b = mid_b
        else:
            out_b = mid_b + self._done(mlp_b)
        out = torch.stack([out_a, out_b]).transpose(0, 1).reshape(s, b, h)  # [2, s, b/2, h] seen as [s, b, h]: a view when b is 2
        if not self.hands_on:  # the final norm or the next stage takes it contiguous, as from megatron's own layer
            out = out.contiguous()
        return out, None


class AddNormLayer(TransformerLayer):
    """megatron's transformer layer with each residual sum and the RMSNorm after it as one kernel
    (``parallel.fused_add_norm``; the norms' ``add_forward``, kernels.py):

        norm(x) -> attention -> (norm(x + a), x + a) -> MLP -> hand m on

    The sum after the MLP is left to the next layer of the stage, whose input norm adds it
    (``(norm(h + m), h + m)``): between two linked layers (:func:`link_layers`) the hidden
    states are the sum before the MLP, and only the stage's last layer hands on finished hidden
    states. The arithmetic is megatron's (residual + output, then the norm of that sum); where
    megatron adds and normalizes in two kernels each way, this runs one."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = self.config
        if cfg.hidden_dropout or cfg.add_bias_linear:
            raise RuntimeError("parallel.fused_add_norm needs no hidden dropout and no linear biases")
        for norm in (self.input_layernorm, self.pre_mlp_layernorm):
            if not hasattr(norm, "add_forward"):
                raise RuntimeError(
                    f"parallel.fused_add_norm: {type(norm).__name__} has no fused sum (set fused_elementwise compile or liger)"
                )
        self.handoff: list = []  # the MLP output of the layer before, not yet added
        self.takes_over = self.hands_on = False

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, rotary_pos_emb: Any = None, **kwargs: Any) -> tuple:
        given = sorted(k for k, v in kwargs.items() if v is not None)
        if given:
            raise RuntimeError(f"parallel.fused_add_norm: the layer was given {', '.join(given)}, which it does not handle")
        if self.takes_over:
            if len(self.handoff) != 1:
                raise RuntimeError(f"parallel.fused_add_norm: layer {self.layer_number} has no MLP output handed on from the layer before")
            normed, x = self.input_layernorm.add_forward(self.handoff.pop(), hidden_states)
        else:
            self.handoff.clear()
            x = hidden_states
            normed = self.input_layernorm(x)
        attention, _ = self.self_attention(normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        normed, mid = self.pre_mlp_layernorm.add_forward(attention, x)
        mlp, _ = self.mlp(normed)
        if self.hands_on:
            self.handoff.append(mlp)
            return mid, None
        return mid + mlp, None


def link_layers(layers: Any) -> None:
    """The layers of one stage, in order, hand their last sum on to the next (HalvesOverlapLayer:
    B's last MLP sum; AddNormLayer: the last MLP output)."""
    shared: list = []
    layers = list(layers)
    for i, layer in enumerate(layers):
        layer.handoff, layer.takes_over, layer.hands_on = shared, i > 0, i < len(layers) - 1


def _set_mlp_submodules(spec: ModuleSpec, **modules: Any) -> None:
    """The MLP's submodules named in ``modules``: its activation module (which megatron calls on
    the whole ``[gate; up]`` fc1 output when ``config.use_te_activation_func`` is set), its linear
    layers. The MLP is a ModuleSpec in megatron-core 0.16 and a
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` in 0.19."""
    mlp = spec.submodules.mlp
    if isinstance(mlp, ModuleSpec):
        mlp.submodules = dataclasses.replace(mlp.submodules, **modules)
    elif isinstance(mlp, functools.partial) and "submodules" in mlp.keywords:
        subs = dataclasses.replace(mlp.keywords["submodules"], **modules)
        spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})
    else:
        raise RuntimeError(f"this megatron-core's MLP spec ({type(mlp).__name__}) is not one the case knows (setting {', '.join(modules)})")


def fused_elementwise_in_use(s: Settings) -> str:
    """``parallel.fused_elementwise`` as it applies: to megatron's local spec.  Where
    ``transformer_impl: auto`` finds TransformerEngine, TE's own fused norms and activation
    serve instead and this is ``none`` (run_meta shows it; settings refuse the switch with
    ``transformer_impl: transformer_engine``)."""
    return "none" if use_transformer_engine(s) else s.layout.fused_elementwise


def fused_add_norm_in_use(s: Settings) -> bool:
    """``parallel.fused_add_norm`` as it applies: in the case's own norms
    (:func:`fused_elementwise_in_use`); where TransformerEngine serves, its norms are fused into
    the following GEMM instead and this is false (run_meta shows it)."""
    return s.layout.fused_add_norm and fused_elementwise_in_use(s) != "none"


def decoder_spec(s: Settings, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """What GPTModel builds its decoder from: the layer spec, or with fused elementwise kernels
    this stage's layers and the final norm (megatron's block takes the final norm from here)."""
    spec = layer_spec(s)
    fused = fused_elementwise_in_use(s)
    if fused == "none":
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=kernels.NORMS[fused])


def attention_kernel(s: Settings) -> str:
    """The core attention as this process runs it, for run_meta."""
    if s.layout.attention != "cudnn":
        return s.layout.attention
    modes = set(kernels._CUDNN_MODE.values())
    return "cudnn, GQA " + ("/".join(sorted(modes)) if modes else "unchecked")


def transformer_config(s: Settings) -> TransformerConfig:
    sh, lay = s.shape, s.layout
    dtype = DTYPES[s.common.train.precision]
    kw: dict[str, Any] = dict(
        num_layers=sh.num_layers,
        hidden_size=sh.hidden_size,
        ffn_hidden_size=sh.ffn_hidden_size,
        num_attention_heads=sh.num_heads,
        num_query_groups=sh.num_kv_groups,
        kv_channels=sh.hidden_size // sh.num_heads,
        normalization="RMSNorm",
        layernorm_epsilon=sh.norm_eps,
        gated_linear_unit=True,  # SwiGLU: silu(x W1) * (x W3), then W2
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=s.common.train.init_std,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        sequence_parallel=lay.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=s.common.train.precision == "bf16",
        fp16=s.common.train.precision == "fp16",
        # megatron allocates the weights on the device and leaves them undrawn:
        # startweights.overwrite gives every layout the same starting model
        use_cpu_initialization=False,
        perform_initialization=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        # parallel.fused_rope: qkv takes megatron's unsplit-QKV RoPE path (kernels.qkv_rope)
        fused_single_qkv_rope=lay.fused_rope == "qkv",
        gradient_accumulation_fusion=lay.gradient_accumulation_fusion,  # the trainer installs kernels.install_wgrad_accumulation
        persist_layer_norm=False,
        # parallel.cross_entropy: fused is megatron's own fused vocabulary-parallel cross-entropy
        cross_entropy_loss_fusion=lay.cross_entropy == "fused",
        cross_entropy_fusion_impl="native",
        deallocate_pipeline_outputs=True,
        # the MLP calls an activation module (kernels.py) on the whole fc1 output
        use_te_activation_func=fused_elementwise_in_use(s) != "none",
    )
    if lay.recompute != "none":
        kw["recompute_granularity"] = lay.recompute
        if lay.recompute == "full":
            kw["recompute_method"] = lay.recompute_method
            kw["recompute_num_layers"] = lay.recompute_num_layers
    if lay.sequence_parallel and fused_elementwise_in_use(s) == "none" and not use_transformer_engine(s):
        raise RuntimeError(
            "parallel.sequence_parallel needs TransformerEngine's norms or those of parallel.fused_elementwise: "
            "compile | liger (megatron's torch RMSNorm wrapper refuses it)"
        )
    return TransformerConfig(**kw)


class FusedLossGPTModel(GPTModel):
    """GPTModel whose last stage computes the output layer and the loss in one
    (``parallel.fused_linear_loss: chunked``, kernels.LinearCrossEntropy): the output layer hands
    the final norm's output on unchanged, and the loss multiplies it by the output layer's
    weight (the same parameter, so DDP, the optimizer and the starting weights see no change)
    a chunk of tokens at a time. Under sequence parallelism the loss first gathers the ranks'
    shares of the sequence, as the output layer would have."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.post_process:
            self.output_layer.forward = _hand_on

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.config.hidden_size:
            raise RuntimeError(f"fused_linear_loss: the output layer handed on {tuple(logits.shape)}, not hidden states")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        if not self.config.sequence_parallel:
            return kernels.linear_cross_entropy(logits, self.output_layer.weight, labels, group)
        # the output layer would gather the sequence shares itself; the loss needs the whole
        # sequence on each rank (its vocabulary share of every token): all-gather forward; the
        # backward's reduce-scatter sums the ranks' partial gradients of the hidden states, so
        # the loss leaves them unreduced
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=True, group=group)
        return kernels.linear_cross_entropy(hidden, self.output_layer.weight, labels, group, reduce_dx=False)


class LigerLossGPTModel(GPTModel):
    """GPTModel whose cross-entropy after the output layer is liger-kernel's vocabulary-parallel
    one (``parallel.cross_entropy: liger``, kernels.liger_cross_entropy); the output layer and
    everything before it are megatron's."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        loss = kernels.liger_cross_entropy(logits, labels.transpose(0, 1).contiguous(), group)  # [s, b]
        return loss.transpose(0, 1).contiguous()


def _hand_on(hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **kwargs: Any) -> tuple:
    """The output layer's forward under the fused loss: the hidden states, no bias."""
    if weight is not None:
        raise RuntimeError("fused_linear_loss: the output layer is handed a weight (tied embeddings), which it does not support")
    return hidden_states, None


def build_model(s: Settings, config: TransformerConfig) -> GPTModel:
    """This rank's pipeline stage of the model (all layers when pp == 1)."""
    kernels.install_rope(s.layout.fused_rope, config)
    model_class = GPTModel
    if s.layout.fused_linear_loss == "chunked":
        model_class = FusedLossGPTModel
    elif s.layout.cross_entropy == "liger":
        model_class = LigerLossGPTModel
    model = model_class(
        config=config,
        transformer_layer_spec=decoder_spec(s, config),
        vocab_size=s.shape.vocab_size,
        max_sequence_length=s.shape.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(s.shape.rope_base),
    )
    if s.layout.tp_comm_overlap == "halves" or fused_add_norm_in_use(s):
        link_layers(model.decoder.layers)
    on_one_device(model)
    return model


def on_one_device(model: torch.nn.Module) -> None:
    """Megatron builds its own layers on the current device (``use_cpu_initialization=False``);
    the case's own modules (kernels.py's norms) torch builds on its default device, the host.
    Megatron's distributed optimizer would move them into its device buffer, its plain one
    would not: this moves them to the device megatron's layers are on, whatever the optimizer."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        model.to(next(d for d in devices if d.type != "cpu"))


def local_param_count(model: torch.nn.Module) -> int:
    """Parameters this rank contributes to the model's total.

    Tensor-parallel shards count on every TP rank; replicated parameters
    (norm weights) count on TP rank 0 only.  Summed over all TP and PP ranks of
    one data-parallel replica this is the model's exact parameter count.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    total = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total += p.numel()
    return total


def framework_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown"))
