"""The pinned-memory pool: views hand slots out, the last view's end hands them back.

The driver's pinned allocation needs an NVIDIA GPU (tests/kernels/test_kv_move.py uses
it there); here the pool allocates ordinary memory, which exercises the same bookkeeping.
"""

from __future__ import annotations

import ctypes
import gc

import pytest

from appliance.kernels.pinned import SLOT_ALIGN, PinnedPool, available


class PlainBuffer:
    """Ordinary memory with PinnedBuffer's interface."""

    def __init__(self, nbytes: int):
        self.memory = (ctypes.c_uint8 * nbytes)()
        self.nbytes = nbytes
        self.host_address = self.device_address = ctypes.addressof(self.memory)
        self.freed = False

    def free(self) -> None:
        self.freed = True


def test_a_slot_returns_to_the_pool_when_its_last_view_is_gone():
    pool = PinnedPool(allocate=PlainBuffer)
    view, address = pool.take(100)
    assert len(view) == 100 and PinnedPool.owns(view) and PinnedPool.owns(view[10:20])
    assert PinnedPool.address_of(view[10:20]) == address + 10
    part = view[4:]
    del view
    gc.collect()
    assert pool.free_bytes == 0  # `part` still reads it
    del part
    gc.collect()
    assert pool.free_bytes == SLOT_ALIGN
    again, reused = pool.take(SLOT_ALIGN)
    assert reused == address and pool.free_bytes == 0


def test_the_pool_frees_what_it_keeps_beyond_its_limit():
    buffers = []

    def allocate(n):
        buffers.append(PlainBuffer(n))
        return buffers[-1]

    pool = PinnedPool(keep_free_bytes=SLOT_ALIGN, allocate=allocate)
    views = [pool.take(10)[0] for _ in range(3)]
    del views
    gc.collect()
    kept = pool.take(10)  # takes one back, trims the others down to the limit
    assert sum(b.freed for b in buffers) == 1 and pool.free_bytes == SLOT_ALIGN and kept


def test_ordinary_memory_is_not_taken_for_pinned():
    assert not PinnedPool.owns(memoryview(bytearray(16)))


def test_without_a_driver_pinned_memory_says_why():
    why = available()
    if why is None:
        pytest.skip("this machine has a CUDA driver: pinned memory works")
    assert "CUDA" in why or "cuda" in why


def test_free_bytes_are_counted_per_slot_size():
    pool = PinnedPool(keep_free_bytes=8 * SLOT_ALIGN, allocate=PlainBuffer)
    assert pool.reserve_one(3 * SLOT_ALIGN) and pool.reserve_one(SLOT_ALIGN - 5)
    assert pool.free_bytes_of(3 * SLOT_ALIGN - 1) == 3 * SLOT_ALIGN
    assert pool.free_bytes_of(1) == SLOT_ALIGN and pool.free_bytes_of(2 * SLOT_ALIGN) == 0
    assert pool.free_bytes == 4 * SLOT_ALIGN


def test_the_pool_frees_what_it_trims_outside_its_lock():
    """A free waits for the engines' steps (kernels/gate.py); an engine taking a slot in
    its step must not wait for the pool's lock meanwhile."""
    freed_with_lock_held = []

    class Buffer(PlainBuffer):
        def free(self):
            freed_with_lock_held.append(pool._lock.locked())

    pool = PinnedPool(keep_free_bytes=0, allocate=Buffer)
    views = [pool.take(10)[0] for _ in range(2)]
    del views
    gc.collect()
    assert pool.take(10, allocate=False)  # takes one back, trims the other
    assert freed_with_lock_held == [False]
