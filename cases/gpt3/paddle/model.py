"""GPT-3 through PaddleNLP's GPT: config, model, recompute, parameter count.

The model is PaddleNLP's ``GPTForCausalLM`` (``GPTForCausalLMPipe`` when
pipeline-parallel): learned position embeddings, pre-LayerNorm blocks with
biases, GELU (tanh approximation) MLP of ``ffn_hidden_size``, multi-head
attention, output layer tied to the token embedding; TP layers from
``fleet.meta_parallel`` when ``tp > 1``.

Options passed through from the seed's configs and what they do here
(PaddleNLP 2.8.1):

* ``use_flash_attention``: paddle's flash-attention kernel, only where the
  paddle build has CUDA and the run is on a GPU; elsewhere the model's own
  attention runs and the meta record says so.
* ``recompute``: ``full`` recomputes every decoder layer in backward
  (PaddleNLP 2.8.1's non-pipeline GPT ignores its own ``"full"`` granularity,
  so the case sets the decoder-level switch itself), ``full_attn`` the attention
  block of each layer, ``core_attn`` only softmax(QK^T)V.
* ``use_fused_rms_norm``: no effect for GPT-3 on any device: the model has
  LayerNorm, not RMSNorm (FlagPerf passed the flag for every paddle case).
* ``fuse_attention_qkv``: one QKV matmul instead of three (any device).
* ``fuse_attention_ffn``: no effect (not implemented in PaddleNLP's GPT).
"""

from __future__ import annotations

from typing import Any

from cases.gpt3.paddle.settings import Settings


def framework_version() -> str:
    import paddle
    import paddlenlp

    return f"paddle {paddle.__version__}, paddlenlp {paddlenlp.__version__}"


def flash_attention_available(device: str) -> bool:
    """Whether paddle's flash-attention kernel can run for this device."""
    import paddle

    if device != "gpu" or not paddle.is_compiled_with_cuda():
        return False
    try:
        from paddle.nn.functional.flash_attention import flash_attention  # noqa: F401
    except ImportError:
        return False
    return True


def inert_flags(s: Settings, flash: bool) -> list[str]:
    """Requested options that do nothing in this run, for the meta record."""
    lay = s.layout
    out = []
    if lay.use_fused_rms_norm:
        out.append("use_fused_rms_norm (GPT-3 has LayerNorm)")
    if lay.fuse_attention_ffn:
        out.append("fuse_attention_ffn (not implemented by PaddleNLP's GPT)")
    if lay.use_flash_attention and not flash:
        out.append(f"use_flash_attention (no flash-attention kernel on {s.device})")
    return out


def gpt_config(s: Settings, tp_degree: int, tp_rank: int, flash: bool) -> Any:
    from paddlenlp.transformers import GPTConfig

    sh, lay = s.shape, s.layout
    eos = 50256 if sh.vocab_size > 50256 else sh.vocab_size - 1
    return GPTConfig(
        vocab_size=sh.vocab_size,
        hidden_size=sh.hidden_size,
        num_hidden_layers=sh.num_layers,
        num_attention_heads=sh.num_heads,
        intermediate_size=sh.ffn_hidden_size,
        hidden_activation=sh.hidden_act,
        hidden_dropout_prob=s.own.hidden_dropout,
        attention_probs_dropout_prob=s.own.attention_dropout,
        max_position_embeddings=sh.seq_length,
        seq_length=sh.seq_length,
        initializer_range=s.common.train.init_std,
        layer_norm_eps=sh.norm_eps,
        eos_token_id=eos,
        bos_token_id=0,
        pad_token_id=0,
        ignore_index=-100,  # every label counts (PaddleNLP's default 0 would drop token id 0)
        tensor_parallel_degree=tp_degree,
        tensor_parallel_rank=tp_rank,
        tensor_parallel_output=True,
        sequence_parallel=lay.sequence_parallel,
        use_flash_attention=flash,
        fuse_attention_qkv=lay.fuse_attention_qkv,
        fuse_attention_ffn=lay.fuse_attention_ffn,
        use_fused_rms_norm=lay.use_fused_rms_norm,
        recompute_granularity={"none": "full", "full": "full_attn"}.get(lay.recompute, lay.recompute),
        use_recompute=lay.recompute != "none",
        recompute_use_reentrant=False,
        use_cache=False,
    )


def build_model(s: Settings, config: Any) -> Any:
    """GPTForCausalLM, or GPTForCausalLMPipe when pp > 1 (needs fleet initialised)."""
    if s.layout.pp > 1:
        from paddlenlp.transformers import GPTForCausalLMPipe

        if s.layout.recompute == "full":
            config.recompute_granularity = "full"  # the pipeline layers implement "full" themselves
        model = GPTForCausalLMPipe(config)
    else:
        from paddlenlp.transformers import GPTForCausalLM

        model = GPTForCausalLM(config)
    set_recompute(model, s.layout.recompute, s.layout.pp > 1)
    return model


def set_recompute(model: Any, mode: str, pipeline: bool) -> None:
    """Switch recompute on at the one level ``mode`` names (see the module docstring)."""
    from paddlenlp.transformers.gpt import modeling as gm

    if mode == "none":
        return
    if mode == "full":
        target = gm.GPTDecoderLayer if pipeline else gm.TransformerDecoder
    elif mode == "full_attn":
        target = gm.GPTDecoderLayer
    else:  # core_attn
        target = gm.MultiHeadAttention
    hits = 0
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, target):
            layer.enable_recompute = True
            hits += 1
    if not hits:
        raise RuntimeError(f"recompute {mode!r}: no {target.__name__} in the model")


def local_param_count(model: Any, tp_rank: int, pipeline_stage: int, num_stages: int) -> int:
    """Parameters this rank contributes to the model's total.

    TP-split parameters (``is_distributed``) count on every TP rank (each holds
    its shard); replicated ones on TP rank 0 only.  The tied token embedding,
    which the pipeline keeps on its first and last stage, counts on the first.
    """
    import numpy as np

    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not getattr(p, "is_distributed", False) and tp_rank != 0:
            continue
        if num_stages > 1 and pipeline_stage == num_stages - 1 and "shared_layers" in name and pipeline_stage != 0:
            continue
        total += int(np.prod(p.shape))
    return total
