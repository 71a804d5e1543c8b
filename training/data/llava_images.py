"""LLaVA images read before launch: each one's size read from its header, checked against the pixel
limit, then decoded whole and its pixels hashed (``training.data.content.image_pixels``).

Pillow is imported where it is used: the host's pre-launch check (``run_benchmarks/planning/datacheck.py``)
calls :func:`inspect` and the ranks never need this module.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from training.data import content

#: the default of data.max_image_pixels: Pillow's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS)
MAX_IMAGE_PIXELS = 89_478_485


def outside(name: str) -> str | None:
    """Why an entry's image path leaves its image folder (absolute, or ``..`` above it), checked on
    the path as written; None when it stays inside."""
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "an absolute path"
    norm = os.path.normpath(name)
    if norm == ".." or norm.startswith(".." + os.sep) or norm.startswith("../"):
        return "a path that leaves the image folder"
    return None


def inspect(
    path: str, new_hash: Callable[[], Any], max_pixels: int = MAX_IMAGE_PIXELS
) -> tuple[str | None, str | None, tuple[int, int] | None]:
    """(problem, digest of the decoded pixels, (width, height)) of one image file. The size is read
    from the header first: an image above ``max_pixels`` is not decoded (problem set, its size
    given). Otherwise Pillow decodes it whole; problem None when it does."""
    from PIL import Image, UnidentifiedImageError

    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None  # the size is checked here, against data.max_image_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                size = (int(im.size[0]), int(im.size[1]))
                if size[0] * size[1] > max_pixels:
                    return f"{size[0]:,} x {size[1]:,} pixels, above data.max_image_pixels {max_pixels:,}", None, size
                im.load()
                return None, content.image_pixels(im, new_hash), size
    except UnidentifiedImageError:
        return "not an image Pillow can read", None, None
    except Exception as exc:  # anything Pillow raises on a damaged file is the file's fault (OSError, SyntaxError, zlib, struct ...)
        return f"corrupt image ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})", None, None
    finally:
        Image.MAX_IMAGE_PIXELS = limit
