"""Where a token corpus is, how a blend of corpora is sampled, and whole-corpus checks.

``data.prefix`` names the corpus inside ``data.data_dir`` in one of three ways:

- null: the only corpus there is taken (one ``<name>.idx`` beside its ``<name>.bin``;
  for PaddleNLP's GPT data also one ``<name>_ids.npy`` + ``<name>_idx.npz`` pair);
- ``name`` (or an absolute path): that corpus, ``.bin``/``.idx`` suffixes allowed;
- Megatron's blended list, ``"0.3 wudao_a 0.7 wudao_b"`` (weight, prefix, weight,
  prefix, ... as ``--data-path`` takes it; a YAML list of the same items works too;
  prefixes alone, ``"wudao_a wudao_b"``, weigh them equally):
  sample ``k`` of the run comes from the corpus whose share so far lags its
  normalised weight the most (Megatron's blending rule), and inside that corpus
  from its own seeded window order.

Every error names ``data.prefix`` or ``data.data_dir`` and the file concerned.
numpy and the standard library only: the host's pre-launch check and the ranks'
readers share this code.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from training.data.content import RangeScan
from training.data.indexed import TokenWindows, bin_path, idx_path

#: tokens read per chunk when a whole corpus is scanned (64 Mi of them: a few hundred MiB)
SCAN_CHUNK = 1 << 26


class DataError(ValueError):
    """A corpus that cannot be read as configured; the message names the setting and the file."""


def _strip(path: str) -> str:
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def parse_blend(spec: Any) -> list[tuple[float, str]] | None:
    """``data.prefix`` as ``[(weight, prefix), ...]``; None when it names one corpus (or none).

    A blend is an even number of items, alternately a positive number and a prefix, or
    several prefixes without numbers (equal weights)."""
    if spec is None or spec == "":
        return None
    items = [str(x) for x in spec] if isinstance(spec, (list, tuple)) else str(spec).split()
    if len(items) == 1:
        return None

    def number(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    if all(number(x) is None for x in items):
        return [(1.0, x) for x in items]
    if len(items) % 2 or any(number(w) is None for w in items[0::2]) or any(number(p) is not None for p in items[1::2]):
        raise DataError(
            f"data.prefix {' '.join(items)!r}: a blend is 'weight prefix weight prefix ...' "
            "(Megatron's --data-path), e.g. '0.3 wudao_a 0.7 wudao_b', or prefixes alone for equal weights"
        )
    weights = [float(w) for w in items[0::2]]
    if any(not np.isfinite(w) or w <= 0 for w in weights):
        raise DataError(f"data.prefix {' '.join(items)!r}: blend weights must be positive numbers")
    return list(zip(weights, items[1::2]))


def _found(data_dir: str, pattern: str, suffix: str, partner: str) -> list[str]:
    names = sorted(p[: -len(suffix)] for p in glob.glob(os.path.join(data_dir, pattern)))
    return [p for p in names if os.path.isfile(p + partner)]


def lone_halves(data_dir: str, pairs: Sequence[tuple[str, str]]) -> list[str]:
    """Each file of ``data_dir`` that is one half of a corpus pair without the other, as
    ``"<path> has no <name> beside it"``; ``pairs`` are the two suffixes of a pair."""
    out = []
    for a, b in pairs:
        for first, second in ((a, b), (b, a)):
            for path in sorted(glob.glob(os.path.join(data_dir, "*" + first))):
                partner = path[: -len(first)] + second
                if not os.path.exists(partner):
                    out.append(f"{path} has no {os.path.basename(partner)} beside it")
    return out


def megatron_prefixes(data_dir: str, spec: Any) -> list[tuple[float, str]]:
    """The Megatron indexed corpora ``data.prefix`` names in ``data_dir``, as (weight, prefix) pairs
    (weight 1.0 for a single corpus). FileNotFoundError / DataError naming the setting otherwise."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data.data_dir {data_dir}: no such directory")
    blend = parse_blend(spec)
    if blend is None and spec not in (None, ""):
        blend = [(1.0, str(spec[0] if isinstance(spec, (list, tuple)) else spec))]
    if blend is None:
        found = _found(data_dir, "*.idx", ".idx", ".bin")
        lone = lone_halves(data_dir, [(".bin", ".idx")])
        if not found and lone:
            raise FileNotFoundError(f"data.data_dir {data_dir} holds no Megatron corpus (<name>.bin + <name>.idx): {lone[0]}")
        if len(found) != 1:
            names = ", ".join(os.path.basename(p) for p in found)
            raise FileNotFoundError(
                f"data.data_dir {data_dir} holds {len(found)} Megatron corpora (<name>.bin + <name>.idx)"
                + (
                    f": {names}; name one with data.prefix (or blend them: 'weight prefix weight prefix')"
                    if found
                    else "; set data.prefix to the corpus's prefix (e.g. my-gpt2_text_document for my-gpt2_text_document.bin/.idx)"
                )
            )
        return [(1.0, found[0])]
    out = []
    for weight, name in blend:
        path = _strip(name if os.path.isabs(name) else os.path.join(data_dir, name))
        missing = [p for p in (idx_path(path), bin_path(path)) if not os.path.isfile(p)]
        if missing:
            have = ", ".join(os.path.basename(p) for p in _found(data_dir, "*.idx", ".idx", ".bin")) or "none"
            raise FileNotFoundError(f"data.prefix {name!r}: {missing[0]} does not exist (data.data_dir {data_dir}; corpora there: {have})")
        out.append((weight, path))
    return out


def scan_tokens(tokens: np.ndarray, vocab_size: int, chunk: int = SCAN_CHUNK) -> dict[str, Any]:
    """Smallest and largest id of a whole token array (a memory map is read chunk by chunk), and
    the first position holding an id outside ``[0, vocab_size)`` with that id (None when all fit)."""
    scan = RangeScan(vocab_size)
    for start in range(0, int(tokens.shape[0]), chunk):
        scan.add(np.asarray(tokens[start : start + chunk]), start)
    return scan.result()


def blend_order(weights: Sequence[float], count: int) -> tuple[np.ndarray, np.ndarray]:
    """Which corpus each of the first ``count`` samples comes from, and its index within that corpus:
    sample ``i`` goes to the corpus whose count lags ``w_d * max(i, 1)`` the most (Megatron's rule)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    taken = np.zeros(len(w), dtype=np.int64)
    which = np.empty(count, dtype=np.int64)
    within = np.empty(count, dtype=np.int64)
    for i in range(count):
        d = int(np.argmax(w * max(i, 1) - taken))
        which[i], within[i] = d, taken[d]
        taken[d] += 1
    return which, within


class BlendedWindows:
    """Samples drawn from several corpora by weight; each corpus keeps its own seeded window order.

    The same interface as :class:`TokenWindows` where the cases use it (``window``, ``batch``,
    ``num_windows``); with one corpus it is that corpus's order exactly.
    """

    def __init__(self, corpora: Sequence[TokenWindows], weights: Sequence[float]):
        if len(corpora) != len(weights) or not corpora:
            raise ValueError("one weight per corpus")
        self.corpora, self.weights = list(corpora), list(weights)
        self.num_windows = sum(c.num_windows for c in self.corpora)
        self._which = np.zeros(0, dtype=np.int64)
        self._within = np.zeros(0, dtype=np.int64)

    def _extend(self, count: int) -> None:
        if count > len(self._which):
            size = max(count, 2 * len(self._which), 1024)
            self._which, self._within = blend_order(self.weights, size)

    def source(self, k: int) -> tuple[int, int]:
        """(corpus, sample within it) of sample ``k``."""
        if len(self.corpora) == 1:
            return 0, int(k)
        self._extend(int(k) + 1)
        return int(self._which[k]), int(self._within[k])

    def window(self, k: int) -> np.ndarray:
        d, j = self.source(k)
        return self.corpora[d].window(j)

    def batch(self, first: int, count: int) -> np.ndarray:
        return np.stack([self.window(first + i) for i in range(count)])


def open_windows(token_arrays: Sequence[np.ndarray], weights: Sequence[float], seq_length: int, seed: int) -> BlendedWindows:
    """Windows over one corpus or a blend; corpus ``d`` of a blend draws its order from ``seed + d``."""
    corpora = [TokenWindows(t, seq_length, seed + d) for d, t in enumerate(token_arrays)]
    return BlendedWindows(corpora, weights)
