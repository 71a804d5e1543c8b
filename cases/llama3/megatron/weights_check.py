"""Check that parallel layouts of the llama3 case start from the same model.

    python -m torch.distributed.run --nproc-per-node N cases/llama3/megatron/weights_check.py \\
        --config resolved.json --out layout.pt
    python cases/llama3/megatron/weights_check.py --compare a.pt b.pt [...]

The first form sets the run up exactly as train.py does (``Trainer.init_distributed``
and ``Trainer.build_trained_model``: model, start weights, Float16Module, DDP, optimizer), then
joins every parameter's tensor-parallel shards back into its TP1 tensor and collects
the pipeline stages on rank 0, which saves ``{"weights": {layout-free name: float32
tensor}, ...}``.  The joining is written here again, from megatron's layouts, rather
than taken from startweights' rules: it checks the sharding instead of repeating it.  With
``--megatron-std`` (one process) the file also holds, per parameter, the standard
deviation megatron's own initialisation gives it, to check startweights' rule against.

The second form exits 0 when all files hold the same names and bit-equal tensors.
Run with the repository root on PYTHONPATH, in the megatron-core environment.
"""

from __future__ import annotations

import argparse
import os
import sys

# the case's modules are imported as cases.llama3.megatron.<module> (training/case.py): this
# folder off sys.path; --compare needs only torch, and no PYTHONPATH
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]


def _unwrap(model):
    while hasattr(model, "module"):  # DDP, then Float16Module
        model = model.module
    return model


def megatron_split(name: str) -> tuple[int | None, int]:
    """(partition dim, stride) of a parameter in megatron's layers, by its name: vocab-parallel
    embedding and output layer, column-parallel QKV on dim 0; row-parallel linear_proj and
    linear_fc2 on dim 1; SwiGLU's fc1 column-parallel with stride 2; norms replicated."""
    if name.endswith(("layernorm.weight", ".layer_norm_weight")):
        return None, 1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    return 0, 2 if name.endswith("linear_fc1.weight") else 1


def join_shards(name: str, shards: list, dim: int | None, stride: int):
    """The TP1 tensor of ``name`` from the shards of every TP rank, in rank order: megatron's
    layout, where a rank's shard holds its piece of each of ``stride`` blocks (SwiGLU's fc1:
    ``[gate_r; up_r]``, and the full weight is ``[gate; up]``)."""
    import torch

    if dim is None:
        if any(not torch.equal(x, shards[0]) for x in shards[1:]):
            raise AssertionError(f"{name}: the TP ranks hold different copies of a replicated parameter")
        return shards[0]
    pieces = [x.chunk(stride, dim) for x in shards]  # [rank][block]
    return torch.cat([pieces[r][b] for b in range(stride) for r in range(len(shards))], dim)


def gather(trainer) -> dict | None:
    """Every parameter's TP1 tensor (float32, CPU) on global rank 0; None elsewhere."""
    import torch
    import torch.distributed as dist

    from cases.llama3.megatron import startweights as sw

    model = _unwrap(trainer.model)
    names = sw.layout_free_names(model)
    ps = trainer.ps
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    stage: dict = {}
    for local, p in model.named_parameters():
        name = names[local]
        shards = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(shards, p.detach().contiguous(), group=tp_group)
        stage[name] = join_shards(name, [x.float().cpu() for x in shards], *megatron_split(name))
    every = [None] * dist.get_world_size()
    dist.gather_object(stage if trainer.tp_rank == 0 and trainer.dp_rank == 0 else None, every if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    full: dict = {}
    for part in every:
        for name, t in (part or {}).items():
            if name in full:
                raise AssertionError(f"{name} came from two pipeline stages")
            full[name] = t
    return full


def megatron_std(trainer) -> dict:
    """Per layout-free name, the standard deviation of megatron's own (CPU) initialisation."""
    import copy

    from cases.llama3.megatron import modeling
    from cases.llama3.megatron import startweights as sw

    config = copy.copy(trainer.tconfig)
    config.perform_initialization, config.use_cpu_initialization = True, True
    model = modeling.build_model(trainer.s, config)
    names = sw.layout_free_names(model)
    return {names[n]: float(p.detach().float().std()) for n, p in model.named_parameters()}


def dump(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from training import runtime
    from training.metriclog import MetricLogger

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--megatron-std", action="store_true")
    args, rest = ap.parse_known_args(argv)
    cfg = runtime.setup(rest)
    from cases.llama3.megatron import train

    trainer = train.Trainer(cfg, MetricLogger(stream=sys.stderr))
    trainer.init_distributed()
    trainer.build_trained_model()
    if args.megatron_std and dist.get_world_size() != 1:
        raise SystemExit("--megatron-std needs one process")
    full = gather(trainer)
    if full is not None:
        out = {"weights": full}
        if args.megatron_std:
            out["megatron_std"] = megatron_std(trainer)
        torch.save(out, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def difference(a, b) -> str:
    """How two tensors that are not equal differ: a shape, or how many elements, by how much and
    where (a few elements off in their last bits is a math library's rounding; all of them, another
    draw or a later write)."""
    if a.shape != b.shape:
        return f"has shape {tuple(b.shape)}, not {tuple(a.shape)},"
    off = (a != b) & ~(a.isnan() & b.isnan())
    diff = (a.double() - b.double()).abs().where(off, 0.0)
    at = int(diff.flatten().argmax())
    first = int(off.flatten().nonzero()[0])
    return (
        f"differs in {int(off.sum()):,} of {a.numel():,} elements (first at flat index {first:,}; largest "
        f"|difference| {float(diff.flatten()[at]):.3g} at {at:,}, {float(a.flatten()[at]):.9g} vs {float(b.flatten()[at]):.9g})"
    )


def compare(paths: list[str]) -> int:
    import torch

    first = torch.load(paths[0])["weights"]
    bad = []
    for path in paths[1:]:
        other = torch.load(path)["weights"]
        if set(other) != set(first):
            bad.append(f"{path}: names differ from {paths[0]}: {sorted(set(other) ^ set(first))[:6]}")
            continue
        bad += [
            f"{path}: {n} {difference(first[n], other[n])} from {paths[0]}" for n in sorted(first) if not torch.equal(first[n], other[n])
        ]
    print("\n".join(bad) if bad else f"{len(first)} tensors equal in {len(paths)} files")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2:]))
    sys.exit(dump(sys.argv[1:]))
