"""The stretches of a profiled step with no GPU kernel running, and what the host ran meanwhile
(``train.profile_step``'s trace, ``profile_rank0_<phase>_stepK.json.gz`` in the round's output
folder):

    PYTHONPATH=$PWD python3 examples/gpu/trace_gaps.py TRACE [MIN_MS]

Kernels, copies and memsets are merged into busy intervals; each gap between two of them longer
than MIN_MS (default 0.2 ms) is a gap. The 40 longest are listed (training/profiling.py's
``idle_stretches``, which the step breakdown's ``gaps`` come from too) with the host events (torch
operators, the harness's own ranges such as ``fb_optimizer``) that span the gap's midpoint,
longest first, then the gap time summed by the outermost of those events. A gap with no host
event is host work that calls no torch operator (Python of the framework, a wait on the host).
The profiler's own host cost lengthens host-bound parts of a profiled step, so gap times are an
upper bound of an ordinary step's.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys

from training.profiling import idle_stretches, union

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def main() -> None:
    path = sys.argv[1]
    min_us = 1e3 * float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        events = [e for e in json.load(fh).get("traceEvents", []) if e.get("ph") == "X"]
    busy = union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in DEVICE])
    if not busy:
        sys.exit(f"{path}: no GPU kernel in the trace")
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] > min_us]
    span = busy[-1][1] - busy[0][0]
    print(
        f"== {path}: GPU span {span / 1e3:.1f} ms, busy {sum(e - s for s, e in busy) / 1e3:.1f} ms, "
        f"{len(gaps)} gaps > {min_us / 1e3:g} ms: {sum(e - s for s, e in gaps) / 1e3:.1f} ms"
    )
    by_outer: dict[str, float] = collections.defaultdict(float)
    for start, end, around in idle_stretches(busy, events, min(40, len(gaps))):
        names = " > ".join(f"{e['name'][:60]}({e.get('dur', 0) / 1e3:.1f})" for e in around[:6])
        by_outer[around[0]["name"][:60] if around else "-"] += end - start
        print(f"{(end - start) / 1e3:7.2f} ms at +{(start - busy[0][0]) / 1e3:8.1f}: {names}")
    print("-- gap time by the outermost CPU event:")  # of the 40 longest gaps
    for name, us in sorted(by_outer.items(), key=lambda kv: -kv[1]):
        print(f"{us / 1e3:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
