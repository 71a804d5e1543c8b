"""``python -m training.conformance --config resolved.json [--config ...] [--no-cache]``: the check
alone, each config's verdict printed as one JSON object on a line of its own, in the order given
(``flagbench conformance`` runs it in the case's environment). With several configs the probes
are forked from this process once its imports are made (training/conformance/forking.py)."""

from __future__ import annotations

import argparse
import json
import sys

from training import conformance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.conformance")
    ap.add_argument("--config", required=True, action="append", help="a resolved.json; repeat to check several in turn")
    ap.add_argument("--no-cache", action="store_true", help="check again even where this stack has a verdict")
    args = ap.parse_args(argv)
    for path in args.config:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
        try:
            verdict = conformance.check(cfg, path, use_cache=not args.no_cache, fork_alone=len(args.config) > 1)
        except conformance.ProbeError as exc:
            verdict = {"verdict": "error", "message": str(exc), "tail": exc.tail, "cached": False}
        print(json.dumps(verdict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
