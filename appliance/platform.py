"""Where we run: MLX backend, the Linux process environment (OpenBLAS, glibc's allocator),
dtype defaults."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path

log = logging.getLogger("omlx.platform")


def configure_logging() -> None:
    """Sends omlx's log lines (INFO and up) to standard error, once per process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
_REEXEC_MARK = "OMLX_PROCESS_ENV"
# glibc's malloc, tuned for a process that allocates and frees large MLX buffers all the
# time (KV caches that grow, restored prefixes, logits):
# - buffers up to 32 MiB (the most glibc allows) come from the heap, not from fresh mmaps;
# - up to 2 GiB freed at the heap's top stays mapped for reuse instead of going back;
# - one arena, so memory one thread frees (a file reader) serves another (MLX's stream).
# Fresh pages can be costly: 12-13 µs each in a VM whose balloon has reclaimed the free
# memory (measured: bench/first_touch.py --settle 10), and a 2K-token prefix of a 135M
# model is 22,000 pages per copy.
MALLOC_TUNABLES = {
    "glibc.malloc.mmap_threshold": str(32 << 20),
    "glibc.malloc.trim_threshold": str(2 << 30),
    "glibc.malloc.arena_max": "1",
}
PREFAULT_MAX_BYTES = 1 << 30  # well under the trim threshold, so freeing it keeps it mapped
PREFAULT_CHUNK_BYTES = 16 << 20  # under the mmap threshold: served from the heap


def openblas_path() -> str | None:
    """Returns the path of Debian's OpenBLAS when it is installed, else None."""
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def preload(environ: Mapping[str, str], library: str | None) -> dict[str, str]:
    """Returns a copy of `environ` with `library` first in LD_PRELOAD (a plain copy when
    `library` is None or listed already)."""
    env = dict(environ)
    listed = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if library is not None and library not in listed:
        env["LD_PRELOAD"] = ":".join([library, *listed])
    return env


def openblas_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Returns a copy of `environ` that preloads OpenBLAS when it is installed: for a child
    process that imports MLX (a server, a benchmark's worker)."""
    return preload(environ, openblas_path())


def blas_preloaded() -> bool:
    """Returns whether an OpenBLAS library is mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            return "libopenblas" in f.read()
    except OSError:
        return False


def is_glibc() -> bool:
    """Returns whether this process runs on GNU libc (whose allocator reads GLIBC_TUNABLES)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def process_env(environ: dict[str, str], *, blas: str | None, blas_loaded: bool,
                glibc: bool) -> dict[str, str] | None:
    """Returns the environment this process should be re-executed with, or None when it
    already has what it needs (or has been re-executed once already).

    OpenBLAS is preloaded when installed and not loaded yet; glibc's malloc tunables are
    added, each only where the environment does not set it already.
    """
    if environ.get(_REEXEC_MARK):
        return None
    env = dict(environ)
    changed = False
    if blas is not None and not blas_loaded:
        env = preload(env, blas)
        changed = True
    if glibc:
        own = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        set_keys = {t.split("=", 1)[0] for t in own}
        missing = [f"{k}={v}" for k, v in MALLOC_TUNABLES.items() if k not in set_keys]
        if missing:
            env["GLIBC_TUNABLES"] = ":".join([*own, *missing])
            changed = True
    if not changed:
        return None
    env[_REEXEC_MARK] = "1"
    return env


def ensure_process_env(*, malloc: bool = True) -> None:
    """Re-executes this process (same interpreter and arguments) once, with OpenBLAS
    preloaded and (unless `malloc` is False) glibc's allocator tuned, when either is
    missing. Linux only; call it before anything imports MLX.

    MLX's Linux CPU wheel uses a slow reference BLAS; OpenBLAS gives identical results
    about 30x faster. The library must be preloaded before MLX loads, and glibc reads its
    tunables at startup: hence the re-exec.
    """
    if not sys.platform.startswith("linux"):
        return
    env = process_env(dict(os.environ), blas=openblas_path(), blas_loaded=blas_preloaded(),
                      glibc=malloc and is_glibc())
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def malloc_tuned() -> bool:
    """Returns whether this process runs with omlx's glibc malloc tunables."""
    own = os.environ.get("GLIBC_TUNABLES", "")
    return is_glibc() and all(f"{k}={v}" in own.split(":") for k, v in MALLOC_TUNABLES.items())


def prefault_heap(nbytes: int) -> int:
    """Touches up to `nbytes` (at most PREFAULT_MAX_BYTES) of heap and frees it again, so
    later buffers (restored KV, growing batch caches) land on pages the kernel has
    already handed over; returns how many bytes it touched.

    Only where it sticks: glibc with our tunables (freed heap stays mapped) and MLX on
    the CPU (its arrays are malloc'd). A no-op elsewhere.
    """
    if nbytes <= 0 or not malloc_tuned() or device_kind() != "cpu":
        return 0
    import ctypes

    import numpy as np

    chunks = []
    for _ in range(min(nbytes, PREFAULT_MAX_BYTES) // PREFAULT_CHUNK_BYTES):
        chunk = np.empty(PREFAULT_CHUNK_BYTES, dtype=np.uint8)
        # ctypes calls release the GIL: models load and warm up meanwhile.
        ctypes.memset(chunk.ctypes.data, 0, PREFAULT_CHUNK_BYTES)
        chunks.append(chunk)
    touched = len(chunks) * PREFAULT_CHUNK_BYTES
    del chunks
    return touched


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


@cache
def on_cuda() -> bool:
    """Returns whether MLX runs on an NVIDIA GPU (the default device, through MLX CUDA)."""
    import mlx.core as mx

    return device_kind() == "gpu" and mx.cuda.is_available()


def wanted_here(choice: str) -> bool:
    """Returns whether an `auto` / `on` / `off` key asks for its feature on this machine:
    "auto" means on CUDA, where the features such keys choose pay (a host-bound decode
    pass, kernels and attention graphs built per shape)."""
    import mlx.core as mx

    return choice == "on" or (choice == "auto" and mx.cuda.is_available())


def resolve_dtype(dtype: str) -> str | None:
    """Returns the dtype to cast weights to; None keeps the checkpoint's own dtype.

    "auto" is float32 on CPUs (the only fast matmul path there) and the checkpoint's
    dtype on GPUs.
    """
    if dtype != "auto":
        return dtype
    return "float32" if device_kind() == "cpu" else None


def device_memory_bytes() -> int | None:
    """Returns the GPU's memory as MLX reports it (Metal: `memory_size`; CUDA:
    `total_memory`, the key MLX 0.32.4 uses there), else None."""
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:
        return None
    return int(info.get("memory_size") or info.get("total_memory") or 0) or None


KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"  # where MLX CUDA keeps the kernels it compiled


def keep_compiled_kernels(cache_dir: Path) -> Path | None:
    """Points MLX CUDA's cache of the kernels it compiles at `cache_dir`/kernels/mlx-VERSION,
    unless the environment names one; returns that directory (None: named already).

    MLX's own default is under /tmp, which a reboot empties where it is a tmpfs: the next
    start then compiles every kernel again (~20 s on an H200 with NVRTC, more than an 8B
    model takes to load). MLX reads the variable at its first compile, so this must run
    before any model loads. The version is in the path as in MLX's default: another MLX
    must not read kernels compiled for this one.
    """
    if os.environ.get(KERNEL_CACHE_ENV):
        return None
    path = cache_dir / "kernels" / f"mlx-{mlx_version()}"
    os.environ[KERNEL_CACHE_ENV] = str(path)
    return path


def default_kernel_dir() -> Path:
    """Returns MLX CUDA's own default cache of the kernels it compiles: the temp dir's
    mlx/VERSION/ptx (MLX's version read without importing it)."""
    return Path(tempfile.gettempdir()) / "mlx" / mlx_version() / "ptx"


def mlx_version() -> str:
    """Returns the installed MLX's version without importing MLX (`kernels.ahead` runs
    before it is imported), nor importlib.metadata before it is needed: that is 20 ms of
    each of `omlx serve`'s two processes (the re-exec) before its weights' preload."""
    import importlib.metadata

    return importlib.metadata.version("mlx")


def kernel_dir() -> Path | None:
    """Returns where MLX CUDA keeps the kernels it compiles (`MLX_PTX_CACHE_DIR`, else
    `default_kernel_dir`); None off CUDA."""
    import mlx.core as mx

    return mlx_kernel_dir() if mx.cuda.is_available() else None


def mlx_kernel_dir() -> Path:
    """Returns where MLX CUDA would keep the kernels it compiles (`MLX_PTX_CACHE_DIR`, else
    `default_kernel_dir`), without importing MLX."""
    named = os.environ.get(KERNEL_CACHE_ENV)
    return Path(named) if named else default_kernel_dir()


DEFAULT_MEMORY_FRACTION = 0.85  # of the device, when the spec sets no limit
MAX_MEMORY_FRACTION = 0.95  # a larger limit from the spec is cut to this


def memory_limit_bytes(device_bytes: int, limit_gb: float | None) -> int:
    """Returns MLX's memory limit: `limit_gb` when set (at most 95% of the device), else
    85% of the device; the headroom is for the CUDA context, cuDNN and other processes."""
    if limit_gb is None:
        return int(device_bytes * DEFAULT_MEMORY_FRACTION)
    return min(int(limit_gb * 2**30), int(device_bytes * MAX_MEMORY_FRACTION))


def limit_device_memory(limit_gb: float | None = None) -> int | None:
    """Caps MLX's allocations on GPUs below the device's memory (`[server]
    mlx_memory_limit_gb`, see `memory_limit_bytes`); returns the limit set, None on CPUs.

    MLX CUDA allocates managed memory; asking for more than the card has can hang the
    GPU itself, not only the process, so a limit is set before anything loads.
    """
    import mlx.core as mx

    if device_kind() != "gpu":
        return None
    size = device_memory_bytes()
    if not size:
        return None
    limit = memory_limit_bytes(size, limit_gb)
    if limit_gb is not None and limit < limit_gb * 2**30:
        log.warning("[server] mlx_memory_limit_gb = %s is more than %.0f%% of the device's %.1f GiB; "
                    "using %.1f GiB", limit_gb, MAX_MEMORY_FRACTION * 100, size / 2**30, limit / 2**30)
    mx.set_memory_limit(limit)
    log.info("MLX memory limit: %.1f GiB (%.0f%% of the device)", limit / 2**30, 100 * limit / size)
    return limit
