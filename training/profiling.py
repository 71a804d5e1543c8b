"""Where a training step's time goes: one step profiled and split into parts.

A case asks for it with ``train.profile_step: K`` (0: off).  Step K runs under
``torch.profiler``; its trace is written next to the rank's logs
(``profile_rank<R>[_<phase>]_step<K>.json.gz``, readable in Perfetto or chrome://tracing)
and reduced to one ``step_breakdown`` metric line::

    {"step": K, "step_time_s": ..., "source": "cuda kernels" | "cpu ops",
     "busy_s": ..., "idle_s": ...,            # idle: wall time with no kernel running
     "categories": {"attention": {"kernel_s": ..., "share": ...}, "gemm": ...,
                    "communication": ..., "optimizer": ..., "other": ...},
     "communication_exposed_s": ...,          # collectives not hidden under compute
     "optimizer_wall_s": ...,                 # the optimizer region, host work included
     "optimizer_idle_s": ...,                 # of it, wall time with no kernel running
     "gaps": [{"s": ..., "at_s": ..., "host": ...}, ...],  # the longest stretches with no kernel
     "largest": {"other": [{"name": ..., "kernel_s": ..., "calls": ...}, ...], ...}}
                                              # each category's largest kernels by summed time

``kernel_s`` sums kernel durations (kernels on several streams may overlap, so the
sum can exceed the busy time); ``share`` is ``kernel_s / step_time_s``.  A kernel
belongs to the first category that claims it: communication (collective kernels, the barriers of
torch's symmetric memory, and copies from one device to another: the "Memcpy PtoP" of
``tp_comm_overlap: symm_mem``, which moves data without a kernel; other copies are not counted),
optimizer (launched inside the :data:`OPTIMIZER_RANGE` region), attention, GEMM,
other.  On a CPU the training thread's operators stand in for kernels: each
operator's self time counts once, in its own category or else its caller's.

``gaps`` (GPU traces) lists the :data:`GAPS` longest stretches between kernels, each with its
start after the first kernel and ``host``, the outermost host event (a range such as
``fb_optimizer``, else a torch operator) spanning its middle, or "" when none does: host work
that calls no torch operator.

The profiled step is slower than the others (the profiler's own cost), so its
``train_step`` line carries ``profiled: true`` and the harness leaves it out of the
throughput window.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

OPTIMIZER_RANGE = "fb_optimizer"
CATEGORIES = ("attention", "gemm", "communication", "optimizer", "other")
LARGEST = 5  # kernels named per category in ``largest``, by their summed time
GAPS = 5  # stretches with no kernel named in ``gaps``, longest first
NAME_CHARS = 160  # a kernel's name as kept there (C++ template names run to thousands)

_COMM = re.compile(
    r"nccl|rccl|hccl|cncl|bkcl|mccl|xccl|gloo|all_?reduce|all_?gather|reduce_?scatter|alltoall|broadcast|sendrecv|symmetric_memory", re.I
)
_PEER_COPY = re.compile(r"PtoP|peer", re.I)  # a copy between devices (the profiler's "Memcpy PtoP")
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|_efficient_attention|softmax_warp", re.I)
_GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d\d_|aten::(mm|addmm|bmm|baddbmm|matmul)$|ampere_|hopper_", re.I)


def classify(name: str, in_optimizer: bool = False) -> str:
    """The category of one kernel (or CPU leaf operator) by its name and where it ran."""
    if _COMM.search(name):
        return "communication"
    if in_optimizer:
        return "optimizer"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "other"


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Time spans merged where they overlap or touch, sorted."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total overlap of two sorted, disjoint span lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _cpu_pieces(ops: list[dict[str, Any]], in_optimizer: Any) -> tuple[list[tuple[str, float, str]], list[tuple[float, float]]]:
    """One thread's operators as (category, self time, name) pieces, and the spans of its
    outermost ones.

    An operator takes its own category when its name has one, else its caller's: the
    helpers an ``aten::mm`` calls count as GEMM time, and each microsecond counts once.
    """
    pieces: list[tuple[str, float, str]] = []
    top: list[tuple[float, float]] = []
    stack: list[list[Any]] = []  # [end, category, self time, name]

    def close(upto: float) -> None:
        while stack and stack[-1][0] <= upto:
            _, cat, own, name = stack.pop()
            pieces.append((cat, own, name))

    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        close(e["ts"])
        cat = classify(str(e.get("name", "")), in_optimizer(e))
        if cat == "other" and stack and stack[-1][1] != "other":
            cat = stack[-1][1]
        if stack:
            stack[-1][2] -= e["dur"]
        else:
            top.append((e["ts"], e["ts"] + e["dur"]))
        stack.append([e["ts"] + e["dur"], cat, float(e["dur"]), str(e.get("name", ""))])
    close(float("inf"))
    return pieces, top


def breakdown(events: list[dict[str, Any]], step_time_s: float) -> dict[str, Any]:
    """Reduce the events of a chrome trace (times in microseconds) to the step's parts."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "Kernel") and "dur" in e]
    kernels += [e for e in events if e.get("cat") == "gpu_memcpy" and "dur" in e and _PEER_COPY.search(str(e.get("name", "")))]
    source = "cuda kernels" if kernels else "cpu ops"
    gpu_opt = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name") == OPTIMIZER_RANGE]
    cpu_opt = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation" and e.get("name") == OPTIMIZER_RANGE]
    opt_spans = gpu_opt if kernels else cpu_opt

    def in_optimizer(e: dict[str, Any]) -> bool:
        mid = e["ts"] + e["dur"] / 2
        return any(a <= mid <= b for a, b in opt_spans)

    sums = {c: 0.0 for c in CATEGORIES}
    spans: dict[str, list[tuple[float, float]]] = {c: [] for c in CATEGORIES}
    named: dict[tuple[str, str], list[float]] = {}  # (category, name) -> [time, calls]

    def add(cat: str, name: str, dur: float) -> None:
        sums[cat] += dur
        entry = named.setdefault((cat, name[:NAME_CHARS]), [0.0, 0])
        entry[0] += dur
        entry[1] += 1

    if kernels:  # a GPU: kernels are leaves, each counted in one category
        for e in kernels:
            name = str(e.get("name", ""))
            cat = "communication" if e.get("cat") == "gpu_memcpy" else classify(name, in_optimizer(e))
            add(cat, name, e["dur"])
            spans[cat].append((e["ts"], e["ts"] + e["dur"]))
        every = union([s for c in CATEGORIES for s in spans[c]])
        compute = union([s for c in CATEGORIES if c != "communication" for s in spans[c]])
        counted = len(kernels)
    else:  # a CPU: the training thread's operators by self time, collectives of the other threads
        ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
        busiest = Counter(e.get("tid") for e in ops).most_common(1)
        main_tid = busiest[0][0] if busiest else None  # the training thread runs the most
        pieces, top = _cpu_pieces([e for e in ops if e.get("tid") == main_tid], in_optimizer)
        for cat, own, name in pieces:
            add(cat, name, own)
        collectives = [
            e
            for e in events
            if e.get("cat") in ("user_annotation", "cpu_op")
            and "dur" in e
            and e.get("tid") != main_tid
            and _COMM.search(str(e.get("name", "")))
        ]
        spans["communication"] = [(e["ts"], e["ts"] + e["dur"]) for e in collectives]
        for e in collectives:
            add("communication", str(e["name"]), e["dur"])
        compute = union(top)
        every = union(top + spans["communication"])
        counted = len(pieces)
    comm = union(spans["communication"])
    busy = _length(every) / 1e6
    wall = float(step_time_s)
    opt_wall = union(cpu_opt)
    return {
        "step_time_s": wall,
        "source": source,
        "busy_s": busy,
        "idle_s": max(0.0, wall - busy),
        "categories": {c: {"kernel_s": sums[c] / 1e6, "share": (sums[c] / 1e6 / wall) if wall > 0 else None} for c in CATEGORIES},
        "communication_exposed_s": (_length(comm) - _intersection(comm, compute)) / 1e6,
        "optimizer_wall_s": _length(opt_wall) / 1e6,
        "optimizer_idle_s": (_length(opt_wall) - _intersection(opt_wall, every)) / 1e6,
        "gaps": _gaps(every, events) if kernels else [],
        "kernels": counted,
        "largest": {
            c: [
                {"name": name, "kernel_s": t / 1e6, "calls": int(n)}
                for (_, name), (t, n) in sorted(((k, v) for k, v in named.items() if k[0] == c), key=lambda kv: -kv[1][0])[:LARGEST]
            ]
            for c in CATEGORIES
        },
    }


def idle_stretches(
    busy: list[tuple[float, float]], events: list[dict[str, Any]], n: int
) -> list[tuple[float, float, list[dict[str, Any]]]]:
    """The ``n`` longest stretches between the sorted, disjoint ``busy`` spans, longest first, each
    as (start, end, the host events of any thread spanning its middle, outermost first)."""
    host = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and "dur" in e]
    out = []
    for a, b in sorted(zip(busy, busy[1:]), key=lambda ab: ab[0][1] - ab[1][0])[:n]:
        mid = (a[1] + b[0]) / 2
        around = sorted((e for e in host if e["ts"] <= mid <= e["ts"] + e["dur"]), key=lambda e: -e["dur"])
        out.append((a[1], b[0], around))
    return out


def _gaps(busy: list[tuple[float, float]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``gaps`` of a breakdown: the :data:`GAPS` longest stretches with no kernel and the outermost
    host event around each."""
    return [
        {"s": (end - start) / 1e6, "at_s": (start - busy[0][0]) / 1e6, "host": str(around[0]["name"])[:NAME_CHARS] if around else ""}
        for start, end, around in idle_stretches(busy, events, GAPS)
    ]


def device_activity(device_type: str) -> Any:
    """torch.profiler's activity for the kernels of a device type: the one named after it (CUDA,
    XPU, MTIA, HPU), PrivateUse1 for the backend a vendor's torch extension registers under its
    own name (npu, mlu, musa ...) where the profiler supports it, None on the CPU or for a type
    the profiler has no trace of (its step is then broken down from the CPU operators)."""
    import torch
    import torch.profiler as tp

    if device_type == "cpu":
        return None
    named = getattr(tp.ProfilerActivity, device_type.upper(), None)
    if named is not None:
        return named
    plugin = getattr(tp.ProfilerActivity, "PrivateUse1", None)
    backend = getattr(torch._C, "_get_privateuse1_backend_name", lambda: None)()
    return plugin if device_type == backend and plugin in tp.supported_activities() else None


class StepProfiler:
    """Profiles one step of a training loop; a no-op for every other step.

    ``with prof.step(k): ... with prof.optimizer(): optimizer.step() ...``, the step's time
    taken, then ``prof.result(k, step_time_s, reduce=...)`` writes the trace and gives the
    breakdown (None when step k was not profiled).
    """

    def __init__(self, profile_step: int, output_dir: str | None, rank: int, device_type: str, tag: str = ""):
        self.profile_step = int(profile_step or 0)
        self.output_dir = output_dir
        self.rank = rank
        self.device_type = device_type
        self.name = f"profile_rank{rank}" + (f"_{tag}" if tag else "")  # tag: a phase of a multi-phase case
        self._prof: Any = None  # the finished profiler of the profiled step, until result() writes its trace

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step != self.profile_step:
            yield
            return
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU]
        kernels = device_activity(self.device_type)
        if kernels is not None:
            activities.append(kernels)
        with tp.profile(activities=activities) as prof:
            yield
        self._prof = prof  # the trace is written by result(), after the step's time is taken

    @contextlib.contextmanager
    def optimizer(self) -> Iterator[None]:
        import torch.profiler as tp

        with tp.record_function(OPTIMIZER_RANGE):
            yield

    def result(self, step: int, step_time_s: float, reduce: bool = True) -> dict[str, Any] | None:
        """After the profiled step: write its trace; with ``reduce``, return its breakdown.

        Every rank keeps its trace; only the ranks that report need the reduction. None for
        any other step, or without ``reduce``.
        """
        if step != self.profile_step or self._prof is None:
            return None
        prof, self._prof = self._prof, None
        d = self.output_dir or "."
        os.makedirs(d, exist_ok=True)
        raw = os.path.join(d, f".{self.name}_step{step}_{os.getpid()}.json")
        trace_path = os.path.join(d, f"{self.name}_step{step}.json.gz")
        t0 = time.perf_counter()
        prof.export_chrome_trace(raw)
        try:
            with open(raw, "rb") as src, gzip.open(trace_path, "wb", compresslevel=3) as dst:
                shutil.copyfileobj(src, dst)
            if not reduce:
                return None
            with open(raw, encoding="utf-8") as fh:
                trace = json.load(fh)
        finally:
            os.remove(raw)
        events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
        out = {"step": step, **breakdown(events, step_time_s), "trace": os.path.basename(trace_path)}
        out["reduce_s"] = round(time.perf_counter() - t0, 3)
        return out
