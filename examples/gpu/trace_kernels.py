"""The kernels of a profiled step by total time (``train.profile_step``'s trace,
``profile_rank0_stepK.json.gz`` in the round's output folder):

    python3 examples/gpu/trace_kernels.py TRACE [TRACE ...]

Each line: milliseconds, calls, the kernel's name (first 150 characters), over every GPU
kernel, copy and memset the trace holds (the profiler's window, which can reach past the step
that the results' step breakdown counts).
"""

from __future__ import annotations

import collections
import gzip
import json
import sys


def main() -> None:
    for path in sys.argv[1:]:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as fh:
            events = json.load(fh).get("traceEvents", [])
        kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        total: dict[str, float] = collections.defaultdict(float)
        calls: collections.Counter = collections.Counter()
        for e in kernels:
            name = e["name"][:150]
            total[name] += e.get("dur", 0)
            calls[name] += 1
        print(f"== {path}: {len(kernels)} kernels, {sum(total.values()) / 1e6:.3f} s")
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:60]:
            print(f"{us / 1e3:9.1f} ms {calls[name]:6d}  {name}")


if __name__ == "__main__":
    main()
