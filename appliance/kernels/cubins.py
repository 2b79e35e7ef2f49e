"""The native kernels' cubins, compiled by NVRTC once per machine and kept on disk.

`compiled(source(FILE, instance), kernel)` is the cubin of a kernel of kernels/cuda/FILE.cu
(after prelude.cuh) for this GPU, kept beside MLX's own compiled kernels (`cubin_dir`);
`cubin` keeps any source's.

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
from functools import cache
from pathlib import Path

from appliance.kernels.cuda_driver import compute_capability
from appliance.kernels.gate import GATE
from appliance.kernels.nvrtc import compile_cubin, version
from appliance.platform import kernel_dir

log = logging.getLogger("omlx.kernels")

OPTIONS = ("-std=c++17",)
_DIGEST = 32  # bytes of SHA-256 after the cubin
SOURCES = Path(__file__).resolve().parent / "cuda"
DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "float"}  # MLX dtype -> type in prelude.cuh


def source(file: str, instance: str = "") -> str:
    """Returns what NVRTC compiles for kernels/cuda/FILE.cu: prelude.cuh, the file, then
    `instance` (the extern "C" kernel of a template's instance)."""
    return "\n".join(((SOURCES / "prelude.cuh").read_text(), (SOURCES / f"{file}.cu").read_text(), instance))


def compiled(source: str, kernel: str) -> bytes:
    """Returns the cubin of `source` (whose extern "C" `kernel` it is run as) for this GPU,
    compiled once per machine and kept in `cubin_dir`."""
    return cubin(source, name=kernel, arch=_arch(), directory=cubin_dir())


@cache
def _arch() -> str:
    """The GPU's architecture as NVRTC names it (sm_90 on an H100 or H200)."""
    major, minor = compute_capability()
    return f"sm_{major}{minor}"


def cubin_dir() -> Path | None:
    """Where compiled kernels are kept: beside MLX's own (platform.kernel_dir)."""
    mlx_kernels = kernel_dir()
    return mlx_kernels / "omlx" if mlx_kernels is not None else None


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
    with GATE.outside():  # host work only: the engines' steps need not wait for it (kernels/gate.py)
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
