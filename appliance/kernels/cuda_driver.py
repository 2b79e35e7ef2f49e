"""The CUDA driver API (libcuda, which every machine with an NVIDIA driver has), through
ctypes: what MLX does not expose. Pinned host memory (kernels/pinned.py), the device's
free memory (`device_memory`), which counts what other processes hold too, and its
compute capability (which GPU architecture NVRTC compiles for).
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache

_COMPUTE_CAPABILITY_MAJOR, _COMPUTE_CAPABILITY_MINOR = 75, 76  # CUdevice_attribute


class CudaError(RuntimeError):
    """The driver refused (no driver, no device, out of memory)."""


@cache
def driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaError(f"no CUDA driver library: {e}") from None
    check(lib.cuInit(0), "cuInit")
    return lib


def check(code: int, what: str) -> None:
    if code != 0:
        raise CudaError(f"{what} failed with CUDA driver error {code}")


_context_lock = threading.Lock()
_context: ctypes.c_void_p | None = None


def _primary_context() -> ctypes.c_void_p:
    """Returns device 0's primary context (the one MLX's runtime calls use), retained once."""
    global _context
    with _context_lock:
        if _context is None:
            lib = driver()
            device = ctypes.c_int()
            check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
            _context = ctx
        return _context


class CurrentContext:
    """Makes the primary context current on this thread for the duration (driver calls need one)."""

    def __enter__(self):
        check(driver().cuCtxPushCurrent_v2(_primary_context()), "cuCtxPushCurrent")

    def __exit__(self, *exc):
        driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


@cache
def compute_capability() -> tuple[int, int]:
    """Returns device 0's compute capability, (9, 0) on an H100 or H200. Raises CudaError."""
    lib = driver()
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(lib.cuDeviceGetAttribute(ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
    check(lib.cuDeviceGetAttribute(ctypes.byref(minor), _COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
    return major.value, minor.value


@cache
def driver_version() -> tuple[int, int]:
    """Returns the CUDA version the driver supports, (13, 0) for driver 580. Raises CudaError."""
    version = ctypes.c_int()
    check(driver().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value // 1000, version.value % 1000 // 10


def check_module(image: bytes) -> None:
    """Loads a cubin into the primary context and unloads it. Raises CudaError where this
    GPU and driver cannot load it (another architecture, a newer toolkit's format). Loading
    a module may synchronize the device: hold the gate alone (kernels/gate.py)."""
    lib = driver()
    module = ctypes.c_void_p()
    with CurrentContext():
        check(lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)), "cuModuleLoadData")
        lib.cuModuleUnload(module)


def device_memory() -> tuple[int, int]:
    """Returns (free, total) bytes of device 0's memory as the driver sees it: what every
    process on the device holds is taken (MLX's own cache included). Raises CudaError."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    with CurrentContext():
        check(driver().cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return free.value, total.value
