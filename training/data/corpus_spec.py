"""The synthetic corpus's version and parameters (``data.synthetic``), without numpy: the host
reads them for the data's identity, the ranks for the generator (training/data/synthetic.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

CORPUS_VERSION = 1  # the Markov chain alone
SETS_VERSION = 2  # the chain with spans' sets mixed in


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the generator draws besides vocabulary, size and seed (``data.synthetic``)."""

    version: int = CORPUS_VERSION
    set_prob: float = 0.0  # version 2: probability that a next token comes from its span's set
    set_size: int = 0  # ids in a span's set
    alphabet: int = 0  # ids the sets are drawn from
    span: int = 0  # tokens that share one set

    def key(self) -> str:
        """The parameters in the corpus's file name (empty for version 1)."""
        if self.version == CORPUS_VERSION:
            return ""
        return f"_P{self.set_prob:g}_K{self.set_size}_A{self.alphabet}_L{self.span}"

    def identity(self) -> dict[str, Any]:
        return dataclasses.asdict(self) if self.version != CORPUS_VERSION else {"version": CORPUS_VERSION}


V1 = Spec()


def read_spec(given: Any, where: str = "data.synthetic") -> Spec:
    """``data.synthetic`` as given (null or a mapping): ValueError naming the key otherwise."""
    if given is None:
        return V1
    if not isinstance(given, dict):
        raise ValueError(f"{where}: a mapping with version (1 or 2) and, for 2, set_prob, set_size, alphabet, span; got {given!r}")
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(Spec)})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (version, set_prob, set_size, alphabet, span)")
    version = given.get("version", CORPUS_VERSION)
    if version == CORPUS_VERSION:
        if set(given) - {"version"}:
            raise ValueError(f"{where}: version 1 (the Markov chain alone) takes no other key, got {sorted(set(given) - {'version'})}")
        return V1
    if version != SETS_VERSION:
        raise ValueError(f"{where}.version: 1 or 2, not {version!r}")
    missing = [k for k in ("set_prob", "set_size", "alphabet", "span") if given.get(k) is None]
    if missing:
        raise ValueError(f"{where}: version 2 needs {', '.join(missing)}")
    spec = Spec(SETS_VERSION, float(given["set_prob"]), int(given["set_size"]), int(given["alphabet"]), int(given["span"]))
    if not 0.0 < spec.set_prob < 1.0:
        raise ValueError(f"{where}.set_prob: between 0 and 1, not {spec.set_prob}")
    if not 1 <= spec.set_size <= spec.alphabet:
        raise ValueError(f"{where}: set_size {spec.set_size} must be from 1 to alphabet {spec.alphabet}")
    if spec.span < 1:
        raise ValueError(f"{where}.span: at least 1, not {spec.span}")
    return spec


def fingerprint(spec: Spec) -> str:
    """The corpus's fingerprint in data identities and reference names: ``synthetic`` for version 1
    (the name every curve made on it carries), ``synthetic-v2-<hash of its parameters>`` after."""
    if spec.version == CORPUS_VERSION:
        return "synthetic"
    digest = hashlib.blake2b(json.dumps(spec.identity(), sort_keys=True).encode(), digest_size=6).hexdigest()
    return f"synthetic-v{spec.version}-{digest}"
