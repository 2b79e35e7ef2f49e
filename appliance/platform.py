"""Where we run: MLX backend, OpenBLAS preloading on Linux CPUs, dtype defaults."""

from __future__ import annotations

import logging
import os
import sys
from functools import cache

log = logging.getLogger("omlx.platform")

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
_REEXEC_MARK = "OMLX_BLAS_REEXEC"


def openblas_path() -> str | None:
    """Returns the path of Debian's OpenBLAS when it is installed, else None."""
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def blas_preloaded() -> bool:
    """Returns whether an OpenBLAS library is mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            return "libopenblas" in f.read()
    except OSError:
        return False


def ensure_blas_preloaded() -> None:
    """Re-executes this process with OpenBLAS in LD_PRELOAD when it exists and is missing.

    MLX's Linux CPU wheel uses a slow reference BLAS; OpenBLAS gives identical results
    about 30x faster. The library must be preloaded before MLX loads, hence the re-exec.
    """
    if not sys.platform.startswith("linux") or os.environ.get(_REEXEC_MARK):
        return
    lib = openblas_path()
    if lib is None or blas_preloaded():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "appliance", *sys.argv[1:]], env)


def log_blas_status() -> None:
    if not sys.platform.startswith("linux"):
        return
    if blas_preloaded():
        log.info("OpenBLAS preloaded: fast float32 matmuls on the CPU")
    elif device_kind() == "cpu":
        log.warning("OpenBLAS not loaded: CPU inference will be slow; "
                    "install it with `apt-get install libopenblas0-pthread`")


@cache
def device_kind() -> str:
    """Returns "gpu" when MLX runs on Metal or CUDA, else "cpu"."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def resolve_dtype(dtype: str) -> str | None:
    """Returns the dtype to cast weights to; None keeps the checkpoint's own dtype.

    "auto" is float32 on CPUs (the only fast matmul path there) and the checkpoint's
    dtype on GPUs.
    """
    if dtype != "auto":
        return dtype
    return "float32" if device_kind() == "cpu" else None


def limit_device_memory(fraction: float = 0.9) -> None:
    """Caps MLX's allocations on GPUs below the device's memory.

    MLX CUDA allocates managed memory; asking for more than the card has can hang the
    GPU itself, not only the process, so a limit is set before anything loads.
    """
    import mlx.core as mx

    if device_kind() != "gpu":
        return
    try:
        size = int(mx.device_info().get("memory_size", 0))
    except Exception:
        return
    if size:
        mx.set_memory_limit(int(size * fraction))
        log.info("MLX memory limit: %.1f GiB (%.0f%% of the device)", size * fraction / 2**30, fraction * 100)
