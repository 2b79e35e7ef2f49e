"""Page-locked ("pinned") host memory on CUDA, through the driver API (libcuda, which every
machine with an NVIDIA driver has): memory the GPU reads and writes directly over PCIe,
at ~50 GB/s on an H200's host link, where MLX's own host paths (numpy into an `mx.array`,
an `mx.array` read by numpy) run at 1.5-2.2 GB/s (../shared/gpu/README.md).

MLX cannot wrap foreign memory in an array, so the native kernels (kernels/cuda/) take
a pinned buffer's device address as a uint64 input and read or write it themselves.
Pinned memory is allocated with CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP: valid in every
context, mapped into the device's address space (with unified addressing the device
address equals the host address; it is asked for anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from functools import cache

from appliance.kernels.cuda_driver import CudaError, CurrentContext, check, driver
from appliance.kernels.gate import GATE

_PORTABLE, _DEVICEMAP = 0x01, 0x02


class PinnedBuffer:
    """`nbytes` of pinned host memory: `view` for the host, `device_address` for kernels.
    Freed by `free()` or when garbage collected."""

    def __init__(self, nbytes: int):
        lib = driver()
        ptr = ctypes.c_void_p()
        with GATE.alone(), CurrentContext():  # page-locking synchronizes the device (kernels/gate.py)
            check(lib.cuMemHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), _PORTABLE | _DEVICEMAP),
                   f"cuMemHostAlloc of {nbytes} bytes")
            dptr = ctypes.c_uint64()
            code = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ptr, 0)
            if code != 0:
                lib.cuMemFreeHost(ptr)
        check(code, "cuMemHostGetDevicePointer")
        self.nbytes = nbytes
        self.host_address: int = ptr.value
        self.device_address: int = dptr.value
        self.view = memoryview((ctypes.c_uint8 * nbytes).from_address(ptr.value)).cast("B")

    def free(self, *, gated: bool = True) -> None:
        """Unpins and frees the memory; `gated` false frees it without waiting for the
        gate (garbage collection, which may run inside the gate's own code)."""
        if self.host_address:
            with GATE.alone() if gated else contextlib.nullcontext(), CurrentContext():
                driver().cuMemFreeHost(ctypes.c_void_p(self.host_address))
            self.host_address = 0

    def __del__(self):
        try:
            self.free(gated=False)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


def available() -> str | None:
    """Returns None when pinned memory works here, else why not."""
    try:
        PinnedBuffer(1 << 12).free()
    except CudaError as e:
        return str(e)
    return None


SLOT_ALIGN = 1 << 20  # slots come in whole MiB, so blocks of one model share a size


@cache
def _slot_type(nbytes: int) -> type:
    """A ctypes array type of `nbytes` that takes attributes (its `slot` keeps the pinned
    buffer out of the pool while any view of it lives)."""
    return type(f"PinnedBytes{nbytes}", (ctypes.c_uint8 * nbytes,), {})


class _Slot:
    def __init__(self, pool: PinnedPool, buffer: PinnedBuffer):
        self.pool, self.buffer = pool, buffer

    def __del__(self):
        self.pool._free[self.buffer.nbytes].append(self.buffer)  # made by take; list.append is atomic


class PinnedPool:
    """Pinned host memory handed out as memoryviews and taken back when the last view of
    one is gone (blocks in the host tier, the SSD writer's queue, a restore in flight).

    Pinning is slow (the driver locks every page), so freed buffers are kept for reuse,
    up to `keep_free_bytes`; every block of a model needs the same size.
    """

    def __init__(self, *, keep_free_bytes: int = 2 << 30, limit_bytes: int | None = None, allocate=PinnedBuffer):
        self._free: dict[int, list[PinnedBuffer]] = {}  # size -> buffers back from their views
        self._keep_free = keep_free_bytes
        self.limit_bytes = limit_bytes  # reserve_one pins no more than this in all
        self.total_bytes = 0
        self._allocate = allocate
        self._lock = threading.Lock()  # reader threads take buffers too

    def take(self, nbytes: int, *, allocate: bool = True) -> tuple[memoryview, int] | None:
        """Returns (view, device address) of `nbytes` of pinned memory; None when no slot is
        free and `allocate` is false (pinning stalls the GPU: see `reserve`)."""
        size = -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
        with self._lock:
            free = self._free.setdefault(size, [])
            buffer = free.pop() if free else None
            trimmed = self._trim()
        for extra in trimmed:  # outside the lock: a free waits for the engines' steps (kernels/gate.py)
            extra.free()
        if buffer is None:
            if not allocate:
                return None
            buffer = self._new(size)
        raw = _slot_type(size).from_address(buffer.host_address)
        raw.slot = _Slot(self, buffer)
        return memoryview(raw).cast("B")[:nbytes], buffer.device_address

    def reserve_one(self, nbytes: int) -> bool:
        """Pins one more free slot for blocks of `nbytes`, unless the pool keeps enough free
        already; returns whether it did. Pinning is slow (1.4 GB/s on an H200 machine) and
        holds the GPU up while it runs, so the engines call this only when idle."""
        size = -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
        if not self.wants(nbytes):
            return False
        buffer = self._new(size)
        with self._lock:
            self._free.setdefault(size, []).append(buffer)
        return True

    def wants(self, nbytes: int) -> bool:
        """Returns whether `reserve_one(nbytes)` would pin another slot."""
        size = -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
        room = self.limit_bytes is None or self.total_bytes + size <= self.limit_bytes
        return room and self.free_bytes + size <= self._keep_free

    def _new(self, size: int) -> PinnedBuffer:
        buffer = self._allocate(size)
        self.total_bytes += size
        return buffer

    def _trim(self) -> list[PinnedBuffer]:
        """Takes the free buffers beyond `keep_free_bytes` out of the pool (`_lock` held);
        returns them, for the caller to free."""
        trimmed = []
        for free in list(self._free.values()):
            while free and self.free_bytes > self._keep_free:
                buffer = free.pop()
                self.total_bytes -= buffer.nbytes
                trimmed.append(buffer)
        return trimmed

    def free_bytes_of(self, nbytes: int) -> int:
        """Returns the bytes of free slots that hold `nbytes`."""
        size = -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
        return size * len(self._free.get(size, ()))

    @property
    def free_bytes(self) -> int:
        return sum(size * len(free) for size, free in list(self._free.items()))

    @staticmethod
    def owns(view: memoryview) -> bool:
        """Returns whether `view` is pinned memory a pool handed out."""
        return isinstance(view, memoryview) and hasattr(view.obj, "slot")

    @staticmethod
    def address_of(view: memoryview) -> int:
        """Returns the device address of a pinned view's first byte (a view into a slot
        may start past the slot's first byte)."""
        start = ctypes.addressof(ctypes.c_char.from_buffer(view))  # host address of view[0]
        base = view.obj.slot.buffer
        return base.device_address + (start - base.host_address)
