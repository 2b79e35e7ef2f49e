"""The SSD writer: a daemon thread that stores blocks behind the request, never in its way.

`submit` only appends to a queue bounded in bytes; when the queue is full the block is
dropped and counted, because a slow disk must never stall decoding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from appliance.cache.block import Block
from appliance.cache.ssd import SsdTier

log = logging.getLogger("omlx.cache")


class SsdWriter:
    def __init__(self, tier: SsdTier, *, max_pending_bytes: int):
        self.tier = tier
        self.max_pending_bytes = max_pending_bytes
        self._queue: deque[Block] = deque()
        self._pending: set[tuple[str, bytes]] = set()  # (dir, key): queued or being written
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._num = {"submitted": 0, "dropped": 0, "written": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="omlx-ssd-writer", daemon=True)
        self._thread.start()

    def submit(self, block: Block) -> bool:
        """Returns whether the block was queued (or is already queued); never blocks on I/O.

        The payload is written later, so the caller must not mutate its buffer afterwards.
        """
        nbytes = block.payload_nbytes
        with self._cond:
            if (block.dir, block.key) in self._pending:
                return True
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes:
                self._num["dropped"] += 1
                return False
            self._queue.append(block)
            self._pending.add((block.dir, block.key))
            self._pending_bytes += nbytes
            self._num["submitted"] += 1
            self._cond.notify_all()
            return True

    def room_bytes(self) -> int:
        """Returns how many more payload bytes the queue takes now (0 once closed)."""
        with self._cond:
            return 0 if self._closed else max(self.max_pending_bytes - self._pending_bytes, 0)

    def count_dropped(self, num_blocks: int) -> None:
        """Counts blocks the caller did not submit because the queue had no room for them."""
        with self._cond:
            self._num["dropped"] += num_blocks

    def is_pending(self, key: bytes, *, dir: str) -> bool:
        """Returns whether the block is queued or being written right now."""
        with self._cond:
            return (dir, key) in self._pending

    def flush(self, timeout_s: float) -> bool:
        """Returns whether every submitted block was handled within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Returns whether the queue drained and the thread stopped within `timeout_s`.

        New submits are refused from here on; what is queued is still written.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stats(self) -> dict:
        """Returns submit/drop/write counts and what is waiting in the queue."""
        with self._cond:
            return {**self._num, "pending_blocks": len(self._pending),
                    "pending_bytes": self._pending_bytes}

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                block = self._queue.popleft()
            try:
                ok = self.tier.put(block)
            except Exception:  # a bug in one block must not kill the writer
                log.exception("SSD cache put failed for block %s", block.key.hex()[:16])
                ok = False
            with self._cond:
                self._num["written" if ok else "failed"] += 1
                self._pending.discard((block.dir, block.key))
                self._pending_bytes -= block.payload_nbytes
                self._cond.notify_all()
