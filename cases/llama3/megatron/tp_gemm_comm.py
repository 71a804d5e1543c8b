"""Sequence parallelism's gathers and reduce-scatters inside the GEMMs that need them
(``parallel.tp_comm_overlap: symm_mem``, with ``parallel.sequence_parallel``).

Under sequence parallelism each tensor-parallel rank keeps its share of the sequence between a
layer's two linear blocks. A column-parallel linear (qkv, fc1) gathers the shares before its GEMM;
a row-parallel one (proj, fc2) sums the ranks' partial products and leaves each rank its share of
the sum. Megatron runs the forward's gather and reduce-scatter as collectives before and after the
GEMM, with nothing beside them. Here each runs inside its GEMM, on torch's symmetric memory
(``torch.ops.symm_mem.fused_all_gather_matmul``; the reduce-scatter the same way here, with the
partial sums added by one elementwise kernel): the GEMM is cut by source (or destination) rank,
and while one part multiplies, the peer's part is copied over NVLink by a copy on a second stream.
The backward does the same the other way round: a column-parallel linear's input gradient is a
GEMM and a reduce-scatter, a row-parallel linear's output gradient is gathered into its input
gradient's GEMM. A column-parallel linear keeps its gathered input for its weight gradient
(megatron gathers it a second time in the backward), the memory the layer held without sequence
parallelism.

On devices other than CUDA the same arithmetic runs on plain collectives
(``all_gather_into_tensor``, ``reduce_scatter_tensor``), so the CPU tests hold these layers'
forward and backward to megatron's.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel import layers as megatron_layers

from cases.llama3.megatron import mcore_patches

_READY: set[str] = set()


def _symm_mem_group(group: Any) -> str:
    """The group's name, symmetric memory set up for it once (a no-op, deprecated, in newer torch)."""
    name = group.group_name
    if name not in _READY:
        try:
            from torch.distributed import _symmetric_memory
        except ImportError as exc:
            raise RuntimeError(
                f"parallel.tp_comm_overlap: symm_mem needs torch's symmetric memory (torch.distributed._symmetric_memory), "
                f"which this torch ({torch.__version__}) does not import: {exc}; set parallel.tp_comm_overlap: none"
            ) from exc
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            _symmetric_memory.enable_symm_mem_for_group(name)
        _READY.add(name)
    return name


def _symmetric(device_type: str) -> bool:
    """Whether the communication runs on torch's symmetric memory on this device type (CUDA's)."""
    return device_type == "cuda"


def path(device_type: str) -> str:
    """What carries the communication on a device of this type (run_meta's ``tp_comm_path``)."""
    if _symmetric(device_type):
        return "symmetric memory: peer copies beside the GEMMs"
    return "plain collectives: all_gather_into_tensor, reduce_scatter_tensor"


def all_gather_matmul(shard: torch.Tensor, b: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full, full @ b)`` with ``full`` the ranks' ``shard`` s gathered along dim 0, in rank order."""
    if _symmetric(shard.device.type):
        full, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(shard, [b], 0, _symm_mem_group(group), return_A=True)
        return full, out
    full = shard.new_empty((shard.shape[0] * group.size(), *shard.shape[1:]))
    dist.all_gather_into_tensor(full, shard.contiguous(), group=group)
    return full, torch.matmul(full, b)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Any) -> torch.Tensor:
    """``a @ b`` summed over the ranks, each keeping its share of dim 0 (rank r the r-th part)."""
    if _symmetric(a.device.type):
        rows = _symm_mem_matmul_reduce_scatter(a.reshape(-1, a.shape[-1]), b, group)
        return rows.view(a.shape[0] // group.size(), *a.shape[1:-1], b.shape[1])
    partial = torch.matmul(a, b)
    out = partial.new_empty((partial.shape[0] // group.size(), *partial.shape[1:]))
    dist.reduce_scatter_tensor(out, partial.contiguous(), group=group)
    return out


_SIDE: dict[int, Any] = {}  # the second stream of each device


def _symm_mem_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Any) -> torch.Tensor:
    """``a @ b`` (``a``: [M, k], M split into the ranks' row blocks) summed over the ranks, each
    keeping its block, through symmetric memory. On a second stream of higher priority each rank
    multiplies the row blocks the peers keep into its buffer's slots, and once every rank has
    (a barrier) copies its own slot of each peer's buffer; meanwhile it multiplies its own block
    on the current stream, then adds what it received (one elementwise sum, where torch's
    ``fused_matmul_reduce_scatter`` reduces the stacked partials with a reduction kernel). A
    barrier first, so that no rank overwrites its slots before the peers have copied them in the
    call before (every user of the group's workspace starts with one)."""
    from torch.distributed import _symmetric_memory

    ranks, rank = group.size(), group.rank()
    blocks = a.chunk(ranks)
    rows, cols = blocks[0].shape[0], b.shape[1]
    symm = _symmetric_memory.get_symm_mem_workspace(_symm_mem_group(group), min_size=rows * cols * a.element_size() * ranks)

    def slot(owner: int, keeper: int) -> torch.Tensor:
        return symm.get_buffer(owner, (rows, cols), a.dtype, keeper * rows * cols)

    current = torch.cuda.current_stream()
    side = _SIDE.setdefault(a.device.index, torch.cuda.Stream(device=a.device, priority=-1))
    peers = [(rank + step) % ranks for step in range(1, ranks)]
    out = torch.empty((rows, cols), dtype=a.dtype, device=a.device)
    received = [torch.empty_like(out) for _ in peers]
    symm.barrier(channel=0)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for peer in peers:
            torch.mm(blocks[peer], b, out=slot(rank, peer))
        symm.barrier(channel=1)
        for buf, peer in zip(received, peers):
            buf.copy_(slot(peer, rank))
    torch.mm(blocks[rank], b, out=out)
    current.wait_stream(side)
    for buf in received:
        out.add_(buf)
    return out


def _weight_grad(ctx: Any, weight: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient ``grad^T @ x`` as megatron's linear layers hand it: with
    ``gradient_accumulation_fusion`` added to the parameter's float32 ``main_grad`` inside the GEMM
    (megatron's ``fused_weight_gradient_mlp_cuda``: apex's, or kernels.install_wgrad_accumulation's)
    and a placeholder returned where megatron's DDP looks for one, else returned."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    if ctx.main_grad is None:
        return g2.t().matmul(x2)
    weight.main_grad = ctx.main_grad
    fused = megatron_layers.fused_weight_gradient_mlp_cuda
    (fused.wgrad_gemm_accum_fp32 if ctx.main_grad.dtype == torch.float32 else fused.wgrad_gemm_accum_fp16)(x2, g2, ctx.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # megatron's DDP runs its gradient hooks on the thread of the backward only when a gradient
    # comes back; the value is not read (zeros where the parameter asks for them)
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad.shape, dtype=x.dtype, device=x.device)


def _main_grad(weight: torch.Tensor, fuse: bool) -> torch.Tensor | None:
    return weight.main_grad if fuse and hasattr(weight, "main_grad") else None


class _GatherLinear(torch.autograd.Function):
    """A column-parallel linear of sequence shares: gather, then ``x W^T``; backward ``g W``
    reduce-scattered to the shares, ``g^T x`` for the weight."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, weight: torch.Tensor, fuse_wgrad: bool, group: Any) -> torch.Tensor:
        full, out = all_gather_matmul(shard, weight.t(), group)
        ctx.save_for_backward(full, weight)
        ctx.main_grad, ctx.group = _main_grad(weight, fuse_wgrad), group
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        full, weight = ctx.saved_tensors
        grad_shard = matmul_reduce_scatter(grad, weight, ctx.group)
        return grad_shard, _weight_grad(ctx, weight, full, grad), None, None


class _ReduceScatterLinear(torch.autograd.Function):
    """A row-parallel linear leaving sequence shares: ``x W^T`` summed over the ranks and
    scattered; backward the output gradient gathered into ``g W``, ``g^T x`` for the weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, fuse_wgrad: bool, group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.main_grad, ctx.group = _main_grad(weight, fuse_wgrad), group
        return matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx: Any, grad_shard: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        grad, grad_x = all_gather_matmul(grad_shard.contiguous(), weight, ctx.group)
        return grad_x, _weight_grad(ctx, weight, x, grad), None, None


def _check(layer: Any) -> None:
    cfg = layer.config
    why = []
    if not layer.sequence_parallel:
        why.append("sequence parallelism")
    if layer.bias is not None:
        why.append("no bias")
    if getattr(layer, "explicit_expert_comm", False):
        why.append("no expert communication of its own")
    if getattr(layer, "gtp_remat_size", 1) != 1 or cfg.defer_embedding_wgrad_compute:
        why.append("whole weights and no deferred weight gradients")
    if why:
        raise RuntimeError(f"parallel.tp_comm_overlap: symm_mem: {type(layer).__name__} needs {', '.join(why)}")


class GatherColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear with its input's sequence gather inside the GEMM."""

    def __init__(self, *args: Any, **kwargs: Any):
        mcore_patches.use("symm_mem_linears")  # overrides megatron's forward: its version guard
        super().__init__(*args, **kwargs)
        _check(self)
        if self.gather_output:
            raise RuntimeError("parallel.tp_comm_overlap: symm_mem: a column-parallel linear here keeps its output split")

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None) -> tuple:
        if weight is not None or runtime_gather_output:
            raise RuntimeError("parallel.tp_comm_overlap: symm_mem: the layer is handed a weight or asked to gather its output")
        return _GatherLinear.apply(input_, self.weight, self.gradient_accumulation_fusion, self.tp_group), None


class ReduceScatterRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear with its output's reduce-scatter inside the GEMM."""

    def __init__(self, *args: Any, **kwargs: Any):
        mcore_patches.use("symm_mem_linears")  # overrides megatron's forward: its version guard
        super().__init__(*args, **kwargs)
        _check(self)
        if not self.input_is_parallel:
            raise RuntimeError("parallel.tp_comm_overlap: symm_mem: a row-parallel linear here takes its input split")

    def forward(self, input_: torch.Tensor) -> tuple:
        return _ReduceScatterLinear.apply(input_, self.weight, self.gradient_accumulation_fusion, self.tp_group), None
