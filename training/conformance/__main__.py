"""``python -m training.conformance --config resolved.json [--no-cache]``: the check alone, its
verdict printed as one JSON object (``flagbench conformance`` runs it in the case's environment)."""

from __future__ import annotations

import argparse
import json
import sys

from training import conformance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.conformance")
    ap.add_argument("--config", required=True)
    ap.add_argument("--no-cache", action="store_true", help="check again even where this stack has a verdict")
    args = ap.parse_args(argv)
    with open(args.config, encoding="utf-8") as fh:
        cfg = json.load(fh)
    try:
        verdict = conformance.check(cfg, args.config, use_cache=not args.no_cache)
    except conformance.ProbeError as exc:
        verdict = {"verdict": "error", "message": str(exc), "tail": exc.tail, "cached": False}
    print(json.dumps(verdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
