"""LLaVA images read before launch: each one's header decoded (Pillow's ``verify``) and its bytes hashed.

Pillow is imported where it is used: the host's pre-launch check (``run_benchmarks/planning/datacheck.py``)
calls :func:`inspect` and the ranks never need this module.
"""

from __future__ import annotations

import hashlib


def inspect(path: str) -> tuple[str | None, str | None]:
    """(problem, sha256) of one image file: problem None and the hash of its bytes when Pillow
    decodes its header and structure, else what is wrong with it and None."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as fh:
            blob = fh.read()
        with Image.open(path) as im:
            im.verify()
    except UnidentifiedImageError:
        return "not an image Pillow can read", None
    except (OSError, SyntaxError, ValueError) as exc:
        return f"corrupt image ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})", None
    return None, hashlib.sha256(blob).hexdigest()
