"""Images for hosts that cannot pull: saved once here, loaded into each host's engine over SSH.

The harness never pulls (``containers.ensure_image``): the base image of a vendor
Dockerfile must already be on every host. Where the hosts have no registry, this module
puts it there: each image is written once to a ``docker save`` archive (from the docker
engine of this machine, or an archive given as is, ``.tar`` or compressed) and streamed
to every engine that lacks it, through the same SSH connection the runs use
(``docker load`` over the engine's API).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .containers import base_images, engine_errors, engine_name, has_image
from .errors import ContainerError


def dockerfile_bases(contexts: Iterable[Path], buildargs: dict[str, str] | None = None) -> list[str]:
    """The external images the Dockerfiles of these build contexts start from."""
    refs: list[str] = []
    for ctx in contexts:
        if (ctx / "Dockerfile").is_file():
            refs += [r for r in base_images((ctx / "Dockerfile").read_text(), buildargs) if r not in refs]
    return refs


def save_image(source: Any, ref: str, directory: Path) -> Path:
    """``docker save`` of ``ref`` from the engine ``source`` into a file under ``directory``."""
    path = directory / (ref.replace("/", "_").replace(":", "_") + ".tar")
    with engine_errors(engine_name(source), f"saving {ref}"):
        if not has_image(source, ref):
            raise ContainerError(
                engine_name(source),
                f"image {ref} is not here to be loaded onto the hosts: build or import it on this machine first, or give its archive",
            )
        with open(path, "wb") as out:
            for chunk in source.images.get(ref).save(named=True):
                out.write(chunk)
    return path


def load_archive(engine: Any, archive: Path) -> None:
    """Stream a ``docker save`` archive into an engine."""
    with engine_errors(engine_name(engine), f"loading {archive.name}"), open(archive, "rb") as data:
        engine.images.load(data)


def load_images(engines: dict[str, Any], refs: list[str], source: Any = None, archive: Path | None = None) -> list[str]:
    """Put the images ``refs`` on every engine (host name -> client) that lacks one, from the
    engine ``source`` (saved once) or from ``archive`` (a ``docker save`` file holding them).
    One line per host saying what it got or that it had everything."""
    missing = {host: [r for r in refs if not has_image(e, r)] for host, e in engines.items()}
    lines = [f"host {h}: has {', '.join(refs)}" for h, m in missing.items() if not m]
    needed = sorted({r for m in missing.values() for r in m})
    if not needed:
        return lines
    with tempfile.TemporaryDirectory(prefix="flagbench-images-") as tmp:
        files = {r: archive for r in needed} if archive else {r: save_image(source, r, Path(tmp)) for r in needed}
        for host, wanted in ((h, m) for h, m in missing.items() if m):
            for archive_file in dict.fromkeys(files[r] for r in wanted):  # an archive once per host
                load_archive(engines[host], archive_file)
            still = [r for r in wanted if not has_image(engines[host], r)]
            if still:
                raise ContainerError(
                    host, f"{', '.join(still)} not there after loading {archive_file.name}: the archive does not hold it under that name"
                )
            size = sum(os.path.getsize(f) for f in dict.fromkeys(files[r] for r in wanted)) / 1e6
            lines.append(f"host {host}: loaded {', '.join(wanted)} ({size:.0f} MB)")
    return lines


__all__ = ["dockerfile_bases", "load_archive", "load_images", "save_image"]
