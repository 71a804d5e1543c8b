"""Lower bounds of a layout's memory: the weights, gradients and optimizer states alone.

A case names its model in case.yaml (``memory: training.memory:zero_states``), as it names its
FLOPs counter. The harness checks the bound before anything starts: a layout whose states
alone leave no room on the device (or, with offload, on the host) is refused with the
figures, instead of dying minutes later with an out-of-memory error or a SIGKILL.
Activations, communication buffers, the framework's workspace and the CUDA context come on
top, which is why the limits in run_benchmarks/planning/plan.py stay below the full capacity.

Mixed-precision Adam throughout: bf16/fp16 weights (2 bytes), fp32 master weights (4) and two
fp32 moments (8). Frozen parameters (LLaVA's vision tower) hold weights only. Standard
library only.
"""

from __future__ import annotations

from typing import Any

GiB = 1024**3


def _trainable(counts: dict[str, Any]) -> tuple[float, float]:
    """(all parameters, trained parameters) of a phase."""
    total = float(counts["params_exact"])
    return total, float(counts.get("params_trainable", total))


def zero_states(counts: dict[str, Any], parallel: dict[str, Any], world: int, per_node: int) -> dict[str, Any]:
    """DeepSpeed ZeRO (stage 0-3, optimizer and parameter offload to the CPU), data parallel
    over ``world`` ranks: stage 1 partitions the optimizer states, 2 also the gradients, 3 also
    the weights. With ``offload_optimizer: cpu`` the fp32 master weights, moments and fp32
    gradients (16 bytes per trained parameter) live in host memory."""
    zero = parallel.get("zero") or {}
    stage = int(zero.get("stage", 0))
    off_opt = str(zero.get("offload_optimizer", "none")) == "cpu"
    off_par = str(zero.get("offload_param", "none")) == "cpu" and stage == 3
    p, t = _trainable(counts)

    def split(n: float, from_stage: int) -> float:
        return n / world if stage >= from_stage else n

    weights, grads, optim = split(2 * p, 3), split(2 * t, 2), split(12 * t, 1)
    device = (0 if off_par else weights) + grads + (0 if off_opt else optim)
    host = (weights if off_par else 0) + (16 * t / world if off_opt else 0)
    parts = [f"ZeRO-{stage} over {world}", f"{p:.3g} params ({t:.3g} trained)"]
    if off_opt:
        parts.append("optimizer on the host")
    if off_par:
        parts.append("weights on the host")
    return {"device_bytes": device, "host_bytes_per_node": host * per_node, "basis": ", ".join(parts)}


def megatron_states(counts: dict[str, Any], parallel: dict[str, Any], world: int, per_node: int) -> dict[str, Any]:
    """megatron-core: a rank holds 1/(tp*pp) of the model; bf16 weights (2 bytes) and fp32
    gradient buffers (4); the fp32 master weights and moments (12) split over data parallel
    ranks with the distributed optimizer. ``optimizer_cpu_offload`` moves the moments (the
    ``optimizer_offload_fraction`` of them) to the host, where each offloaded parameter also has
    an fp32 copy of its master weight and of its gradient for the host's step (16 bytes in all;
    8.03e9 parameters at fraction 1.0 peaked at 124.2 of 125.9 GiB, killed; at 0.5 ran); the
    device keeps its master weights.

    A mixture of experts (``params_experts`` in the counts, training.flops) holds all its
    experts, not only the active ones: they split over ``parallel.ep`` expert-parallel ranks
    too, and the distributed optimizer shards their states over the dp / ep ranks that hold
    the same experts."""
    tp, pp, ep = int(parallel.get("tp", 1)), int(parallel.get("pp", 1)), int(parallel.get("ep", 1))
    dp = max(1, world // (tp * pp))
    p, t = _trainable(counts)
    experts = float(counts.get("params_experts", 0.0))
    distributed = parallel.get("distributed_optimizer", True)
    frac = float(parallel.get("optimizer_offload_fraction", 1.0)) if parallel.get("optimizer_cpu_offload") else 0.0

    def states(params: float, trained: float, shard: int) -> tuple[float, float]:
        """(device, host) bytes of ``params`` on this rank, optimizer states over ``shard`` ranks."""
        shard = shard if distributed else 1
        moments = 8 * trained / shard
        device = 2 * params + 4 * trained + 4 * trained / shard + moments * (1 - frac)
        return device, (moments + 8 * trained / shard) * frac  # moments, fp32 master and gradient copies

    dense = states((p - experts) / (tp * pp), (t - experts) / (tp * pp), dp)
    expert = states(experts / (tp * pp * ep), experts / (tp * pp * ep), max(1, dp // ep)) if experts else (0.0, 0.0)
    basis = f"TP{tp} PP{pp} DP{dp}, {p / (tp * pp):.3g} params per rank"
    if experts:
        basis = f"TP{tp} PP{pp} DP{dp} EP{ep}, {(p - experts) / (tp * pp) + experts / (tp * pp * ep):.3g} params per rank ({experts:.3g} in experts)"
    if frac:
        basis += ", moments on the host"
    return {"device_bytes": dense[0] + expert[0], "host_bytes_per_node": (dense[1] + expert[1]) * per_node, "basis": basis}


def paddle_states(counts: dict[str, Any], parallel: dict[str, Any], world: int, per_node: int) -> dict[str, Any]:
    """paddle's hybrid-parallel fleet (PaddleNLP's trainer): a rank holds 1/(tp*pp) of the
    model; AMP O2 keeps fp16/bf16 weights (2 bytes) and gradients of the weights' dtype (2), the
    optimizer's fp32 master weights and two moments (12). Sharding over ``sharding_degree`` of
    the data-parallel ranks partitions the optimizer states from stage 1 on, the gradients too
    from stage 2 on. A run in fp32 holds more (4-byte weights and gradients, no master copy):
    this stays a lower bound for it."""
    tp, pp = int(parallel.get("tp", 1)), int(parallel.get("pp", 1))
    stage, degree = int(parallel.get("sharding_stage", 0)), max(1, int(parallel.get("sharding_degree", 1)))
    p, t = _trainable(counts)
    n, trained = p / (tp * pp), t / (tp * pp)
    device = 2 * n + 2 * trained / (degree if stage >= 2 else 1) + 12 * trained / (degree if stage >= 1 else 1)
    basis = f"TP{tp} PP{pp} DP{max(1, world // (tp * pp))}, {n:.3g} params per rank"
    if stage:
        basis += f", sharding stage {stage} over {degree}"
    return {"device_bytes": device, "host_bytes_per_node": 0.0, "basis": basis}
