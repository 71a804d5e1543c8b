"""Run megatron-core on CPU processes with the gloo backend.

megatron-core assumes CUDA in a handful of places that have nothing to do with
the model's arithmetic.  ``install(cfg)`` redirects them, once per process,
before the case imports megatron (``training.runtime.setup`` calls it), so that
the case's code is the same on every vendor.  Tested with megatron-core 0.16.1
and 0.19.2 (local layer spec, no TransformerEngine, no apex).

Redirections, and why each one is needed:

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")``: megatron
  passes it as ``device=`` to tensor factories (global memory buffer, DDP grad
  buffers, pipeline shape exchange, distributed optimizer shards).
* ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda")`` / an integer
  device index given to a torch tensor factory (``torch.empty``, ``zeros``,
  ``ones``, ``full``, ``tensor``, ``arange``, ``rand*``, ``*_like`` ...) or to
  ``Tensor.to`` becomes the CPU; ``Tensor.cuda()`` and ``Module.cuda()`` stay
  on the CPU (pipeline schedule token counters, grad-norm reduction, loss
  scale and found-inf buffers, the distributed optimizer's gather buffers).
* ``Tensor.type()`` (no argument) reports CPU tensors as ``torch.cuda.*``:
  the distributed optimizer sorts parameters by ``param.type()`` into
  fp16/bf16/fp32 groups and raises for anything that is not a CUDA type, and
  grad clipping asserts ``torch.cuda.FloatTensor``; ``Tensor.type("torch.cuda.X")``
  converts to ``torch.X``.
* CUDA RNG: ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed``
  / ``manual_seed_all`` and megatron's ``_get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` use the CPU generator.  ``model_parallel_cuda_manual_seed``
  and the RNG tracker (``get_cuda_rng_tracker().add/fork``) then keep and swap
  named CPU generator states, which is what they do with the CUDA generator on
  GPUs (per-TP-rank streams for initialisation and dropout).
* Streams and events: ``torch.cuda.Stream``, ``ExternalStream``,
  ``current_stream``, ``default_stream``, ``stream(...)``, ``set_stream``,
  ``Event`` become no-op stand-ins (CPU work is synchronous); 0.19.2's DDP
  asks for ``torch.cuda.current_stream()`` when it is built.
* ``torch.cuda.synchronize`` and ``torch.cuda.set_device`` do nothing;
  ``torch.cuda.nvtx.range_push/pop`` do nothing; ``is_current_stream_capturing``
  returns False.

* megatron's JIT fuser is off: megatron-core wraps a few elementwise helpers
  (fused bias-activations, its fused cross entropy's parts) in ``torch.compile``
  when it is imported, which costs about 3 s of each rank's start on a CPU
  (dynamo and inductor are imported for it), and compiling them on first use
  would need a C++ toolchain. They run as the plain functions they wrap.

``torch.cuda.is_available()`` is left False, and nothing of the model's
computation is changed: the same kernels run as in any CPU torch program.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

_INSTALLED = False
_CPU = torch.device("cpu")

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "normal",
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _fix_device_kw(kwargs: dict) -> None:
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs["device"] = _CPU


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _fix_device_kw(kwargs)
        return fn(*args, **kwargs)

    wrapper._fb_cpu_redirect = True  # type: ignore[attr-defined]
    return wrapper


def _patch_factories() -> None:
    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "_fb_cpu_redirect", False):
            setattr(torch, name, _wrap_factory(fn))

    orig_to = torch.Tensor.to

    @functools.wraps(orig_to)
    def to(self, *args, **kwargs):
        _fix_device_kw(kwargs)
        if args and _is_cuda(args[0]):
            args = (_CPU,) + args[1:]
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign]

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign]

    orig_type = torch.Tensor.type

    @functools.wraps(orig_type)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig_type(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not self.is_sparse:
                return "torch.cuda." + name[len("torch.") :]
            return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda.") :]
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type  # type: ignore[method-assign]


class _Stream:
    """Stands in for a CUDA stream: work on the CPU is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Event:
    """Stands in for a CUDA event."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_cuda_module() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _Stream
    cuda.ExternalStream = _Stream
    _default = _Stream()
    cuda.current_stream = lambda device=None: _default
    cuda.default_stream = lambda device=None: _default
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None
    cuda.Event = _Event
    cuda.is_current_stream_capturing = lambda: False
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None

    # the CPU default generator itself: torch.manual_seed calls
    # torch.cuda.manual_seed_all, so these must not call back into torch.manual_seed
    gen = torch.default_generator

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return gen.get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        gen.set_state(new_state)

    def manual_seed(seed: int) -> None:
        gen.manual_seed(int(seed))

    for mod in (cuda, cuda.random):
        mod.get_rng_state = get_rng_state
        mod.set_rng_state = set_rng_state
        mod.manual_seed = manual_seed
        mod.manual_seed_all = manual_seed


def _plain(model: Any = None, **_: Any) -> Any:
    """``torch.compile`` while megatron-core is imported: the function itself, or, called with
    options only, a decorator that returns it."""
    return model if model is not None else (lambda fn: fn)


def _import_megatron_without_jit_fuser() -> None:
    """megatron-core's first import, with its JIT fuser off. ``megatron.core.jit`` binds
    ``jit_fuser = torch.compile`` and the modules import that name as they load, so torch.compile
    is the plain wrapper for the length of the import; ``disable_jit_fuser`` then holds for
    modules imported later."""
    compile_ = torch.compile
    torch.compile = _plain
    try:
        import megatron.core.jit as mjit
    finally:
        torch.compile = compile_
    mjit.disable_jit_fuser()


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    gen = torch.default_generator

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return gen.get_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        gen.set_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def install(cfg: dict) -> None:
    """Adapter hook (``vendor.yaml``: ``adapters: {megatron: vendors.cpu.adapters.megatron:install}``)."""
    global _INSTALLED
    device = (cfg.get("vendor") or {}).get("device", "cpu")
    if device != "cpu" or _INSTALLED:
        return
    _INSTALLED = True
    _patch_factories()
    _patch_cuda_module()
    _import_megatron_without_jit_fuser()
    _patch_megatron_rng()
