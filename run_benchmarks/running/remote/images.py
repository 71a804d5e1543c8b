"""Images for hosts that cannot pull: saved once here, loaded into each host's engine over SSH.

The harness never pulls (``containers.ensure_image``): the base image of a vendor
Dockerfile must already be on every host. Where the hosts have no registry, this module
puts it there: each image is written once to a ``docker save`` archive (from the docker
engine of this machine, or an archive given as is, ``.tar`` or compressed) and streamed
to every engine that lacks it, through the same SSH connection the runs use
(``docker load`` over the engine's API). An archive that is a root filesystem (a tarball
of ``/``, as the project's own base image is kept) is imported instead (``docker import``),
under the name of each image it stands for.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .containers import base_images, engine_errors, engine_name, has_image, longer_calls
from .errors import ContainerError

#: an image's save or load over one engine call: minutes for a framework image, not the
#: engine's usual bound (the cluster file's command_timeout_s)
TRANSFER_TIMEOUT_S = 3600.0


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
    with engine_errors(engine_name(source), f"saving {ref}", TRANSFER_TIMEOUT_S), longer_calls(source, TRANSFER_TIMEOUT_S):
        if not has_image(source, ref):
            raise ContainerError(
                engine_name(source),
                f"image {ref} is not here to be loaded onto the hosts: build or import it on this machine first, or give its archive",
            )
        with open(path, "wb") as out:
            for chunk in source.images.get(ref).save(named=True):
                out.write(chunk)
    return path


def is_rootfs(archive: Path) -> bool:
    """True for a tarball of a root filesystem, False for a ``docker save`` archive (it has a
    ``manifest.json`` or an OCI ``index.json`` at its top); compressed or not."""
    try:
        with tarfile.open(archive, "r|*") as tar:
            for member in tar:
                if member.name.removeprefix("./") in ("manifest.json", "index.json", "oci-layout"):
                    return False
    except (OSError, tarfile.TarError) as exc:
        raise ContainerError("this machine", f"{archive}: not a tar archive ({exc})") from None
    return True


def load_archive(engine: Any, archive: Path, refs: list[str] | None = None) -> None:
    """Stream a ``docker save`` archive into an engine; with ``refs``, import the archive
    (a root filesystem) under each of those names instead."""
    with engine_errors(engine_name(engine), f"loading {archive.name}", TRANSFER_TIMEOUT_S), longer_calls(engine, TRANSFER_TIMEOUT_S):
        if refs is None:
            with open(archive, "rb") as data:
                engine.images.load(data)
            return
        first, *more = refs
        repository, _, tag = first.rpartition(":") if ":" in first.rsplit("/", 1)[-1] else (first, "", "latest")
        engine.api.import_image_from_file(str(archive), repository=repository, tag=tag)
        for ref in more:
            engine.images.get(first).tag(ref)


def load_images(engines: dict[str, Any], refs: list[str], source: Any = None, archive: Path | None = None) -> list[str]:
    """Put the images ``refs`` on every engine (host name -> client) that lacks one, from the
    engine ``source`` (saved once) or from ``archive`` (a ``docker save`` file holding them).
    One line per host saying what it got or that it had everything."""
    missing = {host: [r for r in refs if not has_image(e, r)] for host, e in engines.items()}
    lines = [f"host {h}: has {', '.join(refs)}" for h, m in missing.items() if not m]
    needed = sorted({r for m in missing.values() for r in m})
    if not needed:
        return lines
    rootfs = archive is not None and is_rootfs(archive)
    with tempfile.TemporaryDirectory(prefix="flagbench-images-") as tmp:
        files = {r: archive for r in needed} if archive else {r: save_image(source, r, Path(tmp)) for r in needed}
        for host, wanted in ((h, m) for h, m in missing.items() if m):
            for archive_file in dict.fromkeys(files[r] for r in wanted):  # an archive once per host
                load_archive(engines[host], archive_file, wanted if rootfs else None)
            still = [r for r in wanted if not has_image(engines[host], r)]
            if still:
                raise ContainerError(
                    host, f"{', '.join(still)} not there after loading {archive_file.name}: the archive does not hold it under that name"
                )
            size = sum(os.path.getsize(f) for f in dict.fromkeys(files[r] for r in wanted)) / 1e6
            how = "imported {} from a root filesystem" if rootfs else "loaded {}"
            lines.append(f"host {host}: {how.format(', '.join(wanted))} ({size:.0f} MB)")
    return lines


__all__ = ["dockerfile_bases", "is_rootfs", "load_archive", "load_images", "save_image"]
