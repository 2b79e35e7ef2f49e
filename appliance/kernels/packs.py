"""MLX's kernels compiled for a GPU architecture on another machine and shipped with omlx.

NVRTC needs no GPU, so the modules of a manifest (kernels/ahead.py) compile anywhere from
the CUDA build's libmlx: a pack (kernels/ahead/mlx-VERSION-ARCH.zip, built by
`bench/kernels_ahead.py pack`) holds each module's cubin and kernel names, for one build
of libmlx and one architecture. A machine's first start writes the modules its model needs
from the pack into MLX's kernel cache, instead of compiling them: a 4-bit model's
quantized matmul took 42-51 s to compile on an H100's host, a bfloat16 model's six modules
5-7 s on every core beside the load.

A pack is used only where it was built for this libmlx (its wheel's SHA-256), this GPU's
architecture, and a driver at least as new as the NVRTC that compiled it; a module only
where its source is the manifest's (by SHA-256) and its cubin loads on this GPU (`verify`:
on CUDA, `ahead` loads it into a context and unloads it first). Anything else, and any
pack that cannot be read, is compiled ahead as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

log = logging.getLogger("omlx.kernels")

INDEX = "pack.json"


@dataclass(frozen=True)
class Compiled:
    """One module as a pack holds it."""

    name: str
    source: str
    cubin: bytes
    names: str  # MLX's NAME.txt: each kernel's name expression, a tab, its lowered name


@dataclass(frozen=True)
class Pack:
    path: Path
    mlx: str
    build: str  # libmlx's SHA-256, as its wheel's RECORD gives it
    arch: str  # e.g. sm_90a
    nvrtc: tuple[int, int]  # the NVRTC that compiled it
    sources: dict[str, str]  # module name -> its source's SHA-256
    verify: Callable[[bytes], None] | None = field(default=None, compare=False)  # raises where a cubin cannot run

    def read(self, name: str, source: str) -> tuple[bytes, str] | None:
        """Returns the cubin and kernel names of module `name` compiled from `source`, its
        cubin verified; None where the pack holds no such module. Raises OSError,
        zipfile.BadZipFile, KeyError, or what `verify` raises."""
        if self.sources.get(name) != digest(source):
            return None
        with zipfile.ZipFile(self.path) as z:
            cubin, names = z.read(f"{name}.ptx"), z.read(f"{name}.txt").decode()
        if self.verify is not None:
            self.verify(cubin)
        return cubin, names


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def pack_path(directory: Path, mlx: str, arch: str) -> Path:
    return directory / f"mlx-{mlx}-{arch}.zip"


def load(path: Path) -> Pack:
    """Returns the pack at `path`. Raises OSError, zipfile.BadZipFile, KeyError or ValueError."""
    with zipfile.ZipFile(path) as z:
        index = orjson.loads(z.read(INDEX))
    major, minor = index["nvrtc"]
    return Pack(path, index["mlx"], index["build"], index["arch"], (int(major), int(minor)), dict(index["modules"]))


def find(directory: Path, *, mlx: str, build: str, arch: str, driver: tuple[int, int]) -> Pack | None:
    """Returns the pack shipped in `directory` for this libmlx `build` and `arch`, where a
    driver of CUDA version `driver` loads its cubins; None otherwise."""
    path = pack_path(directory, mlx, arch)
    if not path.is_file():
        return None
    try:
        pack = load(path)
    except (OSError, zipfile.BadZipFile, KeyError, ValueError, TypeError) as e:
        log.warning("the shipped kernels %s cannot be read (%s); they are compiled here instead", path.name, e)
        return None
    if (pack.build, pack.arch) != (build, arch):
        return None
    if driver < pack.nvrtc:
        log.info("the driver (CUDA %d.%d) is older than the NVRTC of the shipped kernels (%d.%d); they are compiled "
                 "here instead", *driver, *pack.nvrtc)
        return None
    return pack


def write(path: Path, *, mlx: str, build: str, arch: str, nvrtc: tuple[int, int], modules: list[Compiled]) -> None:
    """Writes a pack of `modules` to `path`, whole (renamed into place)."""
    index = {"mlx": mlx, "build": build, "arch": arch, "nvrtc": list(nvrtc),
             "modules": {m.name: digest(m.source) for m in sorted(modules, key=lambda m: m.name)}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".pack-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            z.writestr(INDEX, orjson.dumps(index, option=orjson.OPT_INDENT_2))
            for m in sorted(modules, key=lambda m: m.name):
                z.writestr(f"{m.name}.ptx", m.cubin)
                z.writestr(f"{m.name}.txt", m.names)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
