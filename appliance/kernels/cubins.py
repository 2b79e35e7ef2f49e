"""The native kernels' cubins, compiled by NVRTC once per machine and kept on disk.

A cubin is keyed by everything that makes it (the source, the GPU architecture, NVRTC's
version and options), so a changed source or another GPU never reads a stale one. Each
file ends with the SHA-256 of its cubin: a truncated or corrupted file is compiled again
and replaced, never loaded. Files are written to a temporary name and renamed, so a crash
mid-write leaves no half file under the real name; a directory that cannot be written
(full disk, read-only) costs a compile per process, nothing else.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from appliance.kernels.nvrtc import compile_cubin, version

log = logging.getLogger("omlx.kernels")

OPTIONS = ("-std=c++17",)
_DIGEST = 32  # bytes of SHA-256 after the cubin


def key(source: str, *, arch: str) -> str:
    """Returns the name a cubin is kept under: a digest of what it is made from."""
    major, minor = version()
    made_of = "\0".join((source, arch, f"nvrtc {major}.{minor}", *OPTIONS))
    return hashlib.sha256(made_of.encode()).hexdigest()[:32]


def cubin(source: str, *, name: str, arch: str, directory: Path | None) -> bytes:
    """Returns the cubin of `source` for `arch`: read from `directory` where an intact one
    is kept, else compiled (CompileError where it does not compile) and kept there."""
    path = directory / f"{name}-{key(source, arch=arch)}.cubin" if directory is not None else None
    if path is not None:
        kept = _read(path)
        if kept is not None:
            return kept
    compiled = compile_cubin(source, name=name, arch=arch, options=OPTIONS)
    if path is not None:
        _write(path, compiled)
    return compiled


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("kept kernel %s cannot be read (%s); compiling it again", path, e)
        return None
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if len(data) <= _DIGEST or hashlib.sha256(body).digest() != digest:
        log.warning("kept kernel %s is damaged (%d bytes); compiling it again", path, len(data))
        return None
    return body


def _write(path: Path, compiled: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(compiled + hashlib.sha256(compiled).digest())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        log.warning("compiled kernel not kept in %s (%s): the next process compiles it again", path.parent, e)
