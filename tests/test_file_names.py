"""Tracked file names are plain: no whitespace and no control characters.

Such a name (a stray file cut from a pasted line, a trailing newline) breaks shell globs,
archives and the host's file transfer, and is almost always a mistake.
"""

from __future__ import annotations

import subprocess
import unicodedata

from run_benchmarks.planning.registry import ROOT


def bad_names(names: list[str]) -> list[str]:
    """The names holding a whitespace or control character (Unicode category C*)."""
    return [n for n in names if any(c.isspace() or unicodedata.category(c).startswith("C") for c in n)]


def test_bad_names_are_found():
    names = ["cases/llama3/megatron/train.py", "a b.py", "tab\there", "line\nbreak", "bell\x07", "nbsp\u00a0x", "zw\u200bsp"]
    assert bad_names(names) == names[1:]


def test_tracked_file_names_are_plain():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    names = out.decode("utf-8", "surrogateescape").split("\0")[:-1]
    assert names, "git ls-files listed nothing"
    bad = bad_names(names)
    assert not bad, "tracked file names with whitespace or control characters: " + ", ".join(map(ascii, bad))
