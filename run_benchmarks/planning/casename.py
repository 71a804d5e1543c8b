"""The case-name grammar: ``model:framework:hardware:nnodes:nprocs[:repeat]``."""

from __future__ import annotations

import dataclasses
import re

from run_benchmarks.errors import InputError

# A name field: letters, digits, '_', '-', '.', starting with a letter or digit,
# never '..'; so it is safe as a path component and in a command line.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_INT = re.compile(r"^[0-9]{1,6}$")
GRAMMAR = "model:framework:hardware:nnodes:nprocs[:repeat]"


def check_name(value: str, what: str) -> str:
    """Validate one name field (also used for vendor and variant names)."""
    if not _NAME.match(value) or ".." in value:
        raise InputError(
            f"{what} {value!r} is not a valid name: use letters, digits, '_', '-', '.' "
            "(starting with a letter or digit, at most 64 characters)"
        )
    return value


def _positive(value: str, what: str, case_name: str) -> int:
    if not _INT.match(value) or int(value) < 1:
        raise InputError(f"case name {case_name!r}: {what} must be a positive integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class CaseName:
    model: str
    framework: str
    hardware: str
    nnodes: int
    nprocs: int
    repeat: int = 1

    @property
    def size(self) -> str:
        """``<HW>x<N>x<M>``, the suffix of the vendor config file."""
        return f"{self.hardware}x{self.nnodes}x{self.nprocs}"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nprocs

    def __str__(self) -> str:
        return f"{self.model}:{self.framework}:{self.hardware}:{self.nnodes}:{self.nprocs}:{self.repeat}"

    @classmethod
    def parse(cls, text: str) -> CaseName:
        parts = text.split(":")
        if len(parts) not in (5, 6):
            raise InputError(f"case name {text!r} must have the form {GRAMMAR} (got {len(parts)} fields)")
        model, framework, hardware = (
            check_name(p, f"case name {text!r}: {w}") for p, w in zip(parts[:3], ("model", "framework", "hardware"))
        )
        nnodes = _positive(parts[3], "nnodes", text)
        nprocs = _positive(parts[4], "nprocs", text)
        repeat = _positive(parts[5], "repeat", text) if len(parts) == 6 else 1
        return cls(model, framework, hardware, nnodes, nprocs, repeat)
