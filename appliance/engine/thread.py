"""The thread an engine runs on, which may start, and warm up, before its model has loaded.

MLX CUDA keeps its attention graphs in a cache per thread (a `thread_local` in MLX's
scaled_dot_product_attention.cpp): shapes warmed up on one thread are cold on another.
So work meant to warm up an engine's shapes must run on the engine's own thread, and
that thread must exist before the engine does when the work runs beside the model's
load (stand_in.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class EngineThread:
    """Runs the jobs given to it, in order, on one daemon thread, until `close()`."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._lock = threading.Lock()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def submit(self, job: Callable[[], object]) -> None:
        """Queues `job` and starts the thread if it has not started. A job that raises
        ends the thread (the engine's loop handles its own errors)."""
        self._jobs.put(job)
        self._start()

    def close(self) -> None:
        """Lets the thread end once the jobs queued so far have run."""
        self._jobs.put(None)
        self._start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _start(self) -> None:
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()

    def _work(self) -> None:
        for job in iter(self._jobs.get, None):
            job()
