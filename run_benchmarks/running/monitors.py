"""Host monitors sampled for the duration of a round.

Each sample is one JSON line: ``{"t": ..., "host": {cpu_percent, mem_used_gib,
mem_total_gib}, "gpus": [{index, util_percent, mem_used_gib, mem_total_gib,
power_w, temp_c}]}``; NVML's also carry ``energy_mj`` (the card's energy counter), ``sm_clock_mhz``, ``sm_clock_max_mhz`` and
``clock_held``, the reasons the driver gives for holding the SM clock below its maximum
(``HELD_REASONS``).  GPU readers are chosen by the vendor's ``monitor``
field: ``nvml`` (nvidia-ml-py), ``ixsmi`` (Iluvatar's ixsmi CSV query output),
``none``, or the vendor's own ``module:function`` (see ``gpu_reader``).  Run as ``python -m
run_benchmarks.running.monitors --kind nvml --out F`` (or ``--kind vendors.acme.monitor:sample``, the code
root on PYTHONPATH) on remote hosts; locally as a thread.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

GIB = 1024**3
IXSMI_FIELDS = "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu"


def host_sample() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "mem_used_gib": (vm.total - vm.available) / GIB,
        "mem_total_gib": vm.total / GIB,
    }


#: NVML's clock-event reasons that slow a busy GPU, by the name a sample gives them (an idle GPU,
#: application clocks, sync boost and the display are left out: they are not a busy GPU held down)
HELD_REASONS = {
    "power cap": "nvmlClocksEventReasonSwPowerCap",
    "slowdown": "nvmlClocksEventReasonHwSlowdown",
    "thermal (driver)": "nvmlClocksEventReasonSwThermalSlowdown",
    "thermal (hardware)": "nvmlClocksEventReasonHwThermalSlowdown",
    "power brake": "nvmlClocksEventReasonHwPowerBrakeSlowdown",
}


class NVMLReader:
    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        # nvidia-ml-py before 12.535 names the reasons "ClocksThrottleReason" (the same bits)
        bits = {
            name: getattr(pynvml, attr, getattr(pynvml, attr.replace("ClocksEvent", "ClocksThrottle"), None))
            for name, attr in HELD_REASONS.items()
        }
        self.held = {name: bit for name, bit in bits.items() if bit is not None}
        self.reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )

    def _or_none(self, get: Callable[[], Any]) -> Any:
        try:
            return get()
        except (self.nv.NVMLError, AttributeError, TypeError):  # a device, driver or binding that does not tell
            return None

    def clocks(self, h: Any) -> dict[str, Any]:
        """The SM clock now and its maximum (MHz), and why the driver holds it down (HELD_REASONS)."""
        nv = self.nv
        mask = self._or_none(lambda: self.reasons(h))
        return {
            "sm_clock_mhz": self._or_none(lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
            "sm_clock_max_mhz": self._or_none(lambda: float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))),
            "clock_held": None if mask is None else [name for name, bit in self.held.items() if mask & bit],
        }

    def identity(self) -> list[dict[str, Any]]:
        """What names each device and the limits its figures were measured under: its UUID and
        serial, the enforced power limit, the maximum SM and memory clocks, the driver."""
        return [self._device_identity(i, h) for i, h in enumerate(self.handles)]

    def _device_identity(self, i: int, h: Any) -> dict[str, Any]:
        nv = self.nv

        def text(v: Any) -> Any:
            return v.decode() if isinstance(v, bytes) else v

        return {
            "index": i,
            "name": self._or_none(lambda: text(nv.nvmlDeviceGetName(h))),
            "uuid": self._or_none(lambda: text(nv.nvmlDeviceGetUUID(h))),
            "serial": self._or_none(lambda: text(nv.nvmlDeviceGetSerial(h))),
            "power_limit_w": self._or_none(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
            "sm_clock_max_mhz": self._or_none(lambda: float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))),
            "mem_clock_max_mhz": self._or_none(lambda: float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM))),
            "driver": self._or_none(lambda: text(nv.nvmlSystemGetDriverVersion())),
        }

    def __call__(self) -> list[dict[str, Any]]:
        nv, out = self.nv, []
        for i, h in enumerate(self.handles):
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            out.append(
                {
                    "index": i,
                    "util_percent": float(util.gpu),
                    "mem_used_gib": mem.used / GIB,
                    "mem_total_gib": mem.total / GIB,
                    "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    # mJ since the driver loaded (Volta and later; None where the card has no counter)
                    "energy_mj": self._or_none(lambda h=h: float(nv.nvmlDeviceGetTotalEnergyConsumption(h))),
                    "temp_c": float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                    **self.clocks(h),
                }
            )
        return out


def host_identity() -> dict[str, Any]:
    """The host's name and its machine id (/etc/machine-id: distinct between hosts that share a
    name), so that a result says which machine made it."""
    try:
        machine_id: str | None = Path("/etc/machine-id").read_text().strip() or None
    except OSError:
        machine_id = None
    return {"hostname": socket.gethostname(), "machine_id": machine_id}


def _num(text: str) -> float | None:
    text = text.strip().split(" ")[0]
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_ixsmi_csv(text: str) -> list[dict[str, Any]]:
    """Parse ``ixsmi --query-gpu=<IXSMI_FIELDS> --format=csv`` output (MiB, W, C)."""
    rows = list(csv.reader(io.StringIO(text.strip())))
    if not rows:
        return []
    header = [h.strip().split(" ")[0] for h in rows[0]]
    out = []
    for row in rows[1:]:
        if not row or len(row) != len(header):
            continue
        cell = dict(zip(header, row))
        used, total = _num(cell.get("memory.used", "")), _num(cell.get("memory.total", ""))
        out.append(
            {
                "index": int(_num(cell.get("index", "0")) or 0),
                "util_percent": _num(cell.get("utilization.gpu", "")),
                "mem_used_gib": used / 1024 if used is not None else None,
                "mem_total_gib": total / 1024 if total is not None else None,
                "power_w": _num(cell.get("power.draw", "")),
                "temp_c": _num(cell.get("temperature.gpu", "")),
            }
        )
    return out


def ixsmi_reader() -> list[dict[str, Any]]:
    text = subprocess.run(
        ["ixsmi", f"--query-gpu={IXSMI_FIELDS}", "--format=csv"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return parse_ixsmi_csv(text)


def gpu_reader(kind: str) -> Callable[[], list[dict[str, Any]]] | None:
    """The device sampler of ``kind`` (``open_reader``), None where it cannot run."""
    return open_reader(kind)[0]


def open_reader(kind: str) -> tuple[Callable[[], list[dict[str, Any]]] | None, str | None]:
    """The device sampler a vendor names: a built-in (nvml, ixsmi, none) or its own
    ``module:function`` (imported from the code root, e.g. ``vendors.acme.monitor:sample``),
    called once per interval and returning one dict per device with the keys of
    ``NVMLReader`` (index, util_percent, mem_used_gib, mem_total_gib, power_w, temp_c; None
    where the device does not tell); with why it cannot run, where it cannot (host metrics
    only then: the round goes on, and the reason reaches the round's monitor summary)."""
    if ":" in kind:
        import importlib

        module, _, func = kind.partition(":")
        try:
            return getattr(importlib.import_module(module), func), None
        except (ImportError, AttributeError) as exc:
            return None, f"monitor {kind}: {type(exc).__name__}: {exc}"
    if kind == "nvml":
        try:
            return NVMLReader(), None
        except Exception as exc:  # no driver on this host
            return None, f"monitor nvml: {type(exc).__name__}: {exc}"
    if kind == "ixsmi":
        return ixsmi_reader, None
    return None, None


class MonitorThread:
    """Samples every ``interval`` seconds into a JSON-lines file until stopped."""

    def __init__(self, kind: str, out: Path, interval: float = 1.0) -> None:
        self.kind, self.out, self.interval = kind, out, interval
        self._stop = threading.Event()
        self.error: str | None = None  # why sampling ended early (its file could not be written)
        self._thread = threading.Thread(target=self._loop, name=f"monitor-{kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        try:
            self._sample()
        except OSError as exc:  # its file cannot be written (the log folder full): the samples end, the round goes on
            self.error = f"{self.out}: {exc.strerror or exc}"

    def _sample(self) -> None:
        read, why = open_reader(self.kind)
        psutil.cpu_percent(interval=None)
        with open(self.out, "a", encoding="utf-8") as fh:
            first = True
            while not self._stop.is_set():
                sample: dict[str, Any] = {"t": time.time(), "host": host_sample(), "gpus": []}
                if first:  # the first sample names the host and, where the reader tells, its devices
                    sample["identity"] = host_identity()
                    if hasattr(read, "identity"):
                        try:
                            sample["identity"]["gpus"] = read.identity()
                        except Exception as exc:  # the identity is a record, never a failure
                            sample["identity"]["gpu_error"] = str(exc)
                    first = False
                    if why:
                        sample["gpu_error"] = why
                if read is not None:
                    try:
                        sample["gpus"] = read()
                    except Exception as exc:  # a reader failing must not fail the round
                        sample["gpu_error"] = f"monitor {self.kind}: {type(exc).__name__}: {exc}"
                fh.write(json.dumps(sample) + "\n")
                fh.flush()
                self._stop.wait(self.interval)


def monitor_summary(path: Path) -> dict[str, Any] | None:
    """Peak memory used/total per GPU, mean utilisation and power, host CPU/memory."""
    if not path.is_file():
        return None
    samples = []
    for ln in filter(str.strip, path.read_text().splitlines()):
        try:
            samples.append(json.loads(ln))
        except ValueError:  # a line cut short (a full disk, the monitor's stop)
            continue
    if not samples:
        return None
    gpus: dict[int, dict[str, list[float]]] = {}
    for s in samples:
        for g in s.get("gpus", []):
            d = gpus.setdefault(int(g["index"]), {"mem": [], "total": [], "util": [], "power": []})
            for key, field in (("mem", "mem_used_gib"), ("total", "mem_total_gib"), ("util", "util_percent"), ("power", "power_w")):
                if g.get(field) is not None:
                    d[key].append(float(g[field]))

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    failed = [s["gpu_error"] for s in samples if s.get("gpu_error")]
    return {
        # the device sampler's failure, once: no device figures came from this node
        "error": failed[0] if failed else None,
        "failed_samples": len(failed),
        "identity": next((s["identity"] for s in samples if "identity" in s), None),
        "samples": len(samples),
        "duration_s": samples[-1]["t"] - samples[0]["t"],
        "host_cpu_mean_percent": mean([s["host"]["cpu_percent"] for s in samples]),
        "host_mem_peak_gib": max(s["host"]["mem_used_gib"] for s in samples),
        "host_mem_total_gib": max((s["host"].get("mem_total_gib") or 0.0) for s in samples) or None,
        "gpus": {
            str(i): {
                "mem_peak_gib": max(d["mem"]) if d["mem"] else None,
                "mem_total_gib": max(d["total"]) if d["total"] else None,
                "util_mean_percent": mean(d["util"]),
                "power_mean_w": mean(d["power"]),
            }
            for i, d in sorted(gpus.items())
        },
    }


_PLUGIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")  # config.py's "module:function"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sample host and GPU metrics until terminated")
    ap.add_argument("--kind", required=True, help="nvml, ixsmi, none, or the vendor's sampler as module:function")
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.kind not in ("nvml", "ixsmi", "none") and not _PLUGIN.match(args.kind):
        ap.error(f"--kind {args.kind!r} is neither nvml, ixsmi, none nor a sampler's 'module:function'")
    mon = MonitorThread(args.kind, Path(args.out), args.interval)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    mon.start()
    done.wait()
    mon.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
