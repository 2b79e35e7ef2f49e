"""One gate between the engines' model calls and work that may synchronize the whole GPU.

MLX CUDA records its cuBLAS and cuDNN calls into CUDA graphs by stream capture. A call
that synchronizes the device while a capture is under way invalidates it (by one test
on NVIDIA GPUs, also from another thread of the same device, in every capture mode:
docs/GPU.md), and MLX then aborts the process from a destructor
(`terminate called ... cudaStreamEndCapture ... operation failed due to a previous error
during capture`). An H100 server died so once at start, right after the native kernels'
self-test had finished beside the engine's warm-up and its listeners had started pinning
host memory and loading the KV kernels. bench/capture_race.py did not reproduce it (docs/
GPU.md, "Work beside a stream capture"), so this rests on CUDA's rule: page-locking host
memory synchronizes the device (the CUDA programming guide's implicit synchronization);
freeing it and loading a kernel module are treated alike.

So the engines hold the gate `shared()` while they run their model (a scheduler step, a
layout's probe), any number of them at once, and work that may synchronize the device
holds it `alone()`: it waits for the steps under way to end, and steps that come while it
waits or runs wait for it. Such work comes in short pieces (one pinned slot, one kernel
check), so a step waits at most for one of them: the steps that waited for a piece run
before the next piece does (without that turn, a thread pinning slot after slot let an
engine run 2 passes in 6.6 s on an H100).

Both are reentrant on a thread. A thread that holds the gate shared and asks for it alone
(an engine pinning a slot for a demote) is between MLX calls, so it cannot be capturing:
it gives its share back while it waits, and takes it again after. `outside()` gives a
thread's holds back for a while (an NVRTC compile, which is host work only).

Deadlocks to avoid: a sharer must not wait for a thread that may ask for the gate alone
(the kv-read threads free the pinned slots a pool trims; so an engine holds the gate
around its model calls only, never while a restore waits for its reads), and no one waits
for the gate holding a lock that a sharer takes (`PinnedPool` frees after its lock).
MLX's own frees and managed allocations on other threads are not covered.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class Gate:
    def __init__(self):
        self._cond = threading.Condition()
        self._sharers = 0  # threads holding it shared (each counted once)
        self._alone_taken = False  # whether a thread holds it alone
        self._waiting = 0  # threads waiting to hold it alone
        self._queued = 0  # threads waiting to share it
        self._granted = 0  # of those, how many may come in before the next to hold it alone
        self._depth = threading.local()  # this thread's (shared, alone) nesting

    def _held(self) -> tuple[int, int]:
        return getattr(self._depth, "shared", 0), getattr(self._depth, "alone", 0)

    def _set(self, shared: int, alone: int) -> None:
        self._depth.shared, self._depth.alone = shared, alone

    @contextmanager
    def shared(self):
        """Holds the gate shared (with other sharers, never beside one holding it alone)."""
        shared, alone = self._held()
        if not (shared or alone):
            self._enter_shared()
        self._set(shared + 1, alone)
        try:
            yield
        finally:
            self._set(shared, alone)
            if not (shared or alone):
                self._leave_shared()

    @contextmanager
    def alone(self):
        """Holds the gate alone: no engine's step runs meanwhile."""
        shared, alone = self._held()
        if not alone:
            if shared:
                self._leave_shared()
            self._enter_alone()
        self._set(shared, alone + 1)
        try:
            yield
        finally:
            self._set(shared, alone)
            if not alone:
                self._leave_alone()
                if shared:
                    self._enter_shared()

    @contextmanager
    def outside(self):
        """Gives back this thread's hold on the gate, if any, for the block's time."""
        shared, alone = self._held()
        if alone:
            self._leave_alone()
        elif shared:
            self._leave_shared()
        self._set(0, 0)
        try:
            yield
        finally:
            if alone:
                self._enter_alone()
            elif shared:
                self._enter_shared()
            self._set(shared, alone)

    def _enter_shared(self) -> None:
        with self._cond:
            while self._alone_taken or (self._waiting and not self._granted):
                self._queued += 1
                try:
                    self._cond.wait()
                finally:
                    self._queued -= 1
            if self._granted:
                self._granted -= 1
            self._sharers += 1

    def _leave_shared(self) -> None:
        with self._cond:
            self._sharers -= 1
            if not self._sharers:
                self._cond.notify_all()

    def _enter_alone(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._alone_taken or self._sharers or self._granted:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._alone_taken = True

    def _leave_alone(self) -> None:
        with self._cond:
            self._alone_taken = False
            self._granted = self._queued  # the steps that waited run before the next piece of work
            self._cond.notify_all()


GATE = Gate()
