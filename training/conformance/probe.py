"""The conformance probe's process: ``python -m training.conformance.probe --config resolved.json
--out PROBE``, started by training/conformance/__init__.py on the node of rank 0.

It applies the vendor's adapter and hooks as every rank does (training/runtime.py), seeds, and
calls the case's probe (case.yaml's ``conformance``, in resolved.json's ``case``) with the run's
config, which builds the case's parts as the run does and fills the probe file.
"""

from __future__ import annotations

import argparse
import sys

from training import runtime
from training.conformance.export import ProbeFile


def main(argv: list[str] | None = None, adapted: bool = False) -> int:
    """``adapted``: forked from a rank that applied this config's adapter and hooks already."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = runtime.load_config(args.config)
    if not adapted:
        runtime.apply_adapter(cfg)
    runtime.seed_everything(int(cfg["train"].get("seed", 1234)))
    made: list[ProbeFile] = []

    def out(spec: dict, precision: str) -> ProbeFile:
        made.append(ProbeFile(spec, precision))
        return made[-1]

    runtime.resolve_hook(cfg["case"]["conformance"])(cfg, out)
    if len(made) != 1:
        raise RuntimeError(f"the conformance probe {cfg['case']['conformance']} made {len(made)} probe files, not one")
    made[0].write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
