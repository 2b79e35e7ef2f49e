"""The engine: one thread per model running mlx-lm's continuous batching.

Requests join the running batch at any step and leave when done; prefill runs in
chunks of `prefill_chunk_tokens`, one chunk per step between decode steps, so a long
prompt never stalls streams already generating. All MLX work happens on the engine's
own thread; the asyncio side only submits, cancels and reads events.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.request import Finished, GenerationRequest, RequestStats
from appliance.engine.slot import Slot
from appliance.models.loaded import LoadedModel
from appliance.spec import BatchingSpec

log = logging.getLogger("omlx.engine")

RECENT_REQUESTS = 256


class QueueFull(Exception):
    """Admission refused: `max_running` are running and `max_queued` are waiting."""


class EngineClosed(Exception):
    """The engine is shutting down and takes no new requests."""


class RequestHandle:
    """The asyncio side of one request: iterate for `Delta`s, ending with one `Finished`."""

    def __init__(self, engine: Engine, slot: Slot, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._slot = slot
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self.finished: Finished | None = None

    @property
    def stats(self) -> RequestStats:
        return self._slot.stats

    def cancel(self) -> None:
        """Ends the request at the next step and frees its batch slot; idempotent."""
        if self.finished is None:
            self._engine.cancel(self._slot)

    def _push(self, events: list) -> None:
        # Called on the engine thread.
        self._loop.call_soon_threadsafe(self._events.put_nowait, events)

    async def __aiter__(self):
        while self.finished is None:
            for event in await self._events.get():
                if isinstance(event, Finished):
                    self.finished = event
                yield event


@dataclass
class _Commands:
    submitted: list[Slot] = field(default_factory=list)
    cancelled: list[Slot] = field(default_factory=list)


class Engine:
    """Continuous batching for one loaded model."""

    def __init__(self, loaded: LoadedModel, limits: BatchingSpec):
        self.loaded = loaded
        self.limits = limits
        self.recent: deque[RequestStats] = deque(maxlen=RECENT_REQUESTS)
        self._cond = threading.Condition()
        self._commands = _Commands()
        self._num_live = 0  # submitted and not yet finished
        self._accepting = True
        self._stopping = False
        self._waiting: deque[Slot] = deque()  # engine thread only
        self._running: dict[int, Slot] = {}  # engine thread only: uid -> slot
        self._batch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{loaded.name}", daemon=True)

    # --- asyncio side -------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    @property
    def num_live(self) -> int:
        return self._num_live

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Returns a handle streaming the request's events; raises QueueFull or EngineClosed."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if not self._accepting:
                raise EngineClosed(f"model {self.loaded.name} is shutting down")
            if self._num_live >= self.limits.max_running + self.limits.max_queued:
                raise QueueFull(
                    f"model {self.loaded.name} is busy: {self.limits.max_running} running, "
                    f"{self.limits.max_queued} queued"
                )
            slot = Slot(request, self.loaded)
            handle = RequestHandle(self, slot, loop)
            slot.handle = handle
            self._num_live += 1
            self._commands.submitted.append(slot)
            self._cond.notify()
        return handle

    def cancel(self, slot: Slot) -> None:
        with self._cond:
            self._commands.cancelled.append(slot)
            self._cond.notify()

    def stop(self, *, drain_s: float) -> None:
        """Refuses new requests, lets running ones finish for up to `drain_s`, cancels the rest."""
        with self._cond:
            self._accepting = False
            deadline = time.monotonic() + drain_s
            while self._num_live and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.05, max(deadline - time.monotonic(), 0)))
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # --- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        self._batch = self._new_batch()
        while True:
            commands = self._next_commands()
            if commands is None:
                break
            for slot in commands.cancelled:
                self._drop(slot, "cancelled")
            self._waiting.extend(s for s in commands.submitted if not s.done)
            self._admit()
            if self._running:
                self._step()
        for slot in [*self._waiting, *self._running.values()]:
            self._drop(slot, "cancelled")

    def _next_commands(self) -> _Commands | None:
        """Returns the commands that arrived since the last step; None once stopping."""
        with self._cond:
            while not (self._commands.submitted or self._commands.cancelled or self._running
                       or self._stopping):
                self._cond.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, _Commands()
            return commands

    def _new_batch(self) -> Any:
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(
            self.loaded.model,
            completion_batch_size=self.limits.max_running,
            prefill_batch_size=min(self.limits.max_running, 8),
            prefill_step_size=self.limits.prefill_chunk_tokens,
        )

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.limits.max_running:
            slot = self._waiting.popleft()
            slot.uid = self._batch.insert(**slot.insert_args())[0]
            slot.stats.admitted_at = time.perf_counter()
            self._running[slot.uid] = slot

    def _step(self) -> None:
        try:
            prompt_responses, generation_responses = self._batch.next()
        except Exception as e:  # an MLX failure fails this batch, not the engine
            log.exception("engine step failed on model %s", self.loaded.name)
            for slot in list(self._running.values()):
                self._finish(slot, "error", error=f"generation failed: {e}")
            self._running.clear()
            self._batch = self._new_batch()
            return
        now = time.perf_counter()
        for r in prompt_responses:
            slot = self._running.get(r.uid)
            if slot is not None and r.end_of_prompt:
                slot.stats.prefilled_at = now
        for r in generation_responses:
            slot = self._running.get(r.uid)
            if slot is None:
                continue
            events, reason = slot.on_token(r.token, r.logprobs, r.finish_reason)
            if reason is not None:
                if r.finish_reason is None:  # a stop string: mlx-lm still holds it
                    self._batch.remove([r.uid])
                del self._running[r.uid]
                events.append(self._finished(slot, reason))
            slot.handle._push(events)

    def _drop(self, slot: Slot, reason: str) -> None:
        if slot.done:
            return
        if slot.uid is not None and self._running.pop(slot.uid, None) is not None:
            self._batch.remove([slot.uid])
        elif slot in self._waiting:
            self._waiting.remove(slot)
        self._finish(slot, reason)

    def _finish(self, slot: Slot, reason: str, *, error: str | None = None) -> None:
        slot.handle._push([self._finished(slot, reason, error=error)])

    def _finished(self, slot: Slot, reason: str, *, error: str | None = None) -> Finished:
        slot.done = True
        stats = slot.stats
        stats.finished_at = time.perf_counter()
        stats.finish_reason = reason
        self.recent.append(stats)
        with self._cond:
            self._num_live -= 1
            self._cond.notify_all()
        return Finished(reason=reason, stats=stats, error=error)

