"""The engine: one thread per model running continuous batching (see scheduler.py).

Requests join the running batch at any step and leave when done; short prompts start
together and get their first token in the step that prefilled them, long ones advance in
time-sized chunks between decode steps, so a long prompt never stalls streams already
generating. Tokens go out between a step's decode and its prefill chunk. All MLX work
happens on the engine's own thread; the asyncio side only submits, cancels and reads events.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from appliance.cache.model_cache import ModelCache, Saving
from appliance.engine.request import Finished, GenerationRequest, RequestStats
from appliance.engine.scheduler import GPU_SHAPE_TOKENS, Scheduler
from appliance.engine.slot import Slot
from appliance.engine.step_trace import StepTrace
from appliance.engine.thread import EngineThread
from appliance.engine.warm_up import WARM_UP_CHAT, described, idle_shapes, prefill_s_per_token, run_shape, warm_up
from appliance.models.loaded import LoadedModel
from appliance.moving_average import moving_average
from appliance.platform import on_cuda
from appliance.spec import BatchingSpec

log = logging.getLogger("omlx.engine")

RECENT_REQUESTS = 256
# The phases of the engine thread's time (Engine.phase_s): admitting requests (cache
# lookups and restores), starting prompts (their batched prefill), decoding, handing tokens
# out (finished requests' saves included), advancing a long prompt by a chunk, and saving
# the blocks prompts computed.
PHASES = ("admit", "start", "decode", "deliver", "advance", "save")
IDLE_RECHECK_S = 1.0  # an idle engine looks for idle work (pinning) this often
# An idle engine does its idle work (call shapes, pinning host memory) only this long
# after its last step or arrival: each piece holds the engine thread and the GPU for
# ~35-300 ms, and a busy server's gaps between one wave of requests and the next are
# milliseconds long (on an H100, 8 GiB pinned over the first seconds of a throughput run
# took 4.2 s of the engine thread, in those gaps).
IDLE_QUIET_S = 1.0
GATHER_ROUNDS = 4  # an idle engine gathers arrivals for at most this many `gather_ms` (Engine._gather)
RESTORE_LOG_TOKENS = 4096  # restores this long are logged with their time
RATE_TOKENS = 64  # a request's prefill speed counts when it computed this many prompt tokens
# CUDA errors that leave the process's context unusable: every later call fails too, so
# the process must restart (the others, out-of-memory included, fail one batch only).
DEVICE_LOST_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert",
                      "misaligned address", "illegal instruction", "uncorrectable ECC error",
                      "device kernel image is invalid", "device has fallen off the bus")


def device_lost(error: BaseException) -> bool:
    """Returns whether `error` says the GPU context is lost for good (CUDA's sticky errors)."""
    text = str(error)
    return any(marker in text for marker in DEVICE_LOST_ERRORS)


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

    async def __aiter__(self):
        while self.finished is None:
            for event in await self._events.get():
                if isinstance(event, Finished):
                    self.finished = event
                yield event


def _push_all(deliveries: list[tuple[RequestHandle, list]]) -> None:
    """Hands events to their requests from the engine thread, with one wake-up per event
    loop, not one per request (64 streams decoding would otherwise mean 64 cross-thread
    calls a step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for handle, events in deliveries:
        by_loop.setdefault(handle._loop, []).append((handle._events, events))
    for loop, batch in by_loop.items():
        if not loop.is_closed():  # a closed loop has no one left to read the events
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue, list]]) -> None:
    for queue, events in batch:
        queue.put_nowait(events)


@dataclass
class _Commands:
    submitted: list[Slot] = field(default_factory=list)
    cancelled: list[Slot] = field(default_factory=list)


class Engine:
    """Continuous batching for one loaded model, restoring cached prefixes at admission."""

    def __init__(self, loaded: LoadedModel, limits: BatchingSpec, *, cache: ModelCache | None = None,
                 prefetcher: Executor | None = None, thread: EngineThread | None = None):
        """`thread`: the thread to run on, when work meant for it (a warm-up beside the
        load) was queued there already; it runs the engine once that work is done."""
        self.loaded = loaded
        self.limits = limits
        self.cache = cache
        self._prefetcher = prefetcher
        # Measured, for restore-or-recompute; kept in the store, which keeps it across restarts.
        self.prefill_tok_s: float | None = cache.store.prefill_tok_s.get(cache.dir) if cache is not None else None
        self._prefill_s: float | None = None  # the measured prefills' seconds, averaged (`_prefilled`)
        # Restores and saves keep to multiples of this many tokens: on MLX CUDA the GPU
        # scheduler's prefill shape (see `_restore`), elsewhere any length.
        self.whole_tokens = GPU_SHAPE_TOKENS if on_cuda() else 1
        self.recent: deque[RequestStats] = deque(maxlen=RECENT_REQUESTS)
        # Where the engine thread's time goes, in seconds per phase of a step (PHASES), with
        # the steps and batched-start prefill calls counted: read by /metrics.
        self.phase_s: Counter[str] = Counter()
        self.num_steps = 0
        self.num_prefill_calls = 0
        self._trace = StepTrace.from_env()  # a line a step, when OMLX_STEP_TRACE is set
        self.on_finished: Callable[[RequestStats], None] | None = None  # metrics, on this thread
        self.on_device_lost: Callable[[str], None] | None = None  # the process must restart; on this thread
        self._cond = threading.Condition()
        self._commands = _Commands()
        self._num_live = 0  # submitted and not yet finished
        self._wakeups = 0  # prefetches finished since the engine last looked
        self._submitted_at = 0.0  # time.monotonic() of the last submit
        self._active_at = 0.0  # time.monotonic() of the engine loop's last work (IDLE_QUIET_S)
        self._accepting = True
        self._stopping = False
        self._waiting: deque[Slot] = deque()  # engine thread only
        self._running: dict[int, Slot] = {}  # engine thread only: uid -> slot
        self._scheduler: Scheduler | None = None
        self._thread = thread or EngineThread(f"engine-{loaded.name}")
        self._warm = threading.Event()
        self.warm_up_s: float | None = None
        self.warm_up_error: str | None = None
        # The call shapes left to run while idle (warm_up.idle_shapes), engine
        # thread only; their seconds so far.
        self._shapes: list[tuple[int, int]] = []
        self._shapes_s = 0.0
        self._shape_prompt: tuple[int, ...] | None = None  # what the call shapes are made of, encoded once

    def start_warm(self) -> Engine:
        """Starts the engine and returns once its warm-up has run; raises RuntimeError when
        the warm-up failed (the model cannot serve)."""
        self.start()
        self._warm.wait()
        if self.warm_up_error is not None:
            raise RuntimeError(f"warm-up failed: {self.warm_up_error}")
        return self

    # --- asyncio side -------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.submit(self._run)
        self._thread.close()
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
            if self.cache is not None and self._prefetcher is not None:
                # SSD reads start now, not when the request reaches the front of the queue.
                slot.prefetch = self._prefetcher.submit(
                    self.cache.prefetch, request.prompt_tokens, tenant=request.tenant,
                    prefill_tok_s=self.prefill_tok_s, multiple=self.whole_tokens,
                    started=lambda: self._reading(slot))
                slot.prefetch.add_done_callback(lambda _: self._wake())
            self._num_live += 1
            self._commands.submitted.append(slot)
            self._submitted_at = time.monotonic()
            self._cond.notify()
        return handle

    def attach(self, cache: ModelCache) -> None:
        """Gives a running engine its KV cache (the runtime attaches it once the weights'
        fingerprint is known); requests admitted from then on use it."""
        with self._cond:
            if self.prefill_tok_s is None:
                self.prefill_tok_s = cache.store.prefill_tok_s.get(cache.dir)
            self.cache = cache
            self._cond.notify()
        log.info("model %s: KV cache attached", self.loaded.name)

    def _reading(self, slot: Slot) -> None:
        """A prefetch's reads for `slot` are under way (on a reader thread)."""
        slot.reading = True
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._wakeups += 1
            self._cond.notify()

    def set_limits(self, limits: BatchingSpec) -> None:
        """Applies new batching limits from the next step on; running requests keep going."""
        with self._cond:
            self.limits = limits
            if self._scheduler is not None:
                self._scheduler.set_limits(limits)
            self._cond.notify()

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
        try:
            self._scheduler = Scheduler.for_device(self.loaded.model, self.limits)
            if self._warm_up():
                self._loop()
        except BaseException:  # never leave requests hanging on a dead engine
            log.exception("engine of model %s stopped on an error", self.loaded.name)
            with self._cond:
                self._accepting = False
                stranded = [*self._commands.submitted, *self._waiting, *self._running.values()]
            for slot in stranded:
                if not slot.done:
                    self._finish(slot, "error", error="the engine stopped on an internal error")
            raise

    def _warm_up(self) -> bool:
        """Returns whether the model ran the warm-up requests (warm_up.py) before the first
        real one. Their KV is not saved."""
        started = time.perf_counter()
        try:
            parts = warm_up(self.loaded, self._scheduler, self.limits)
        except Exception as e:
            log.exception("warm-up failed on model %s", self.loaded.name)
            self.warm_up_error = str(e)
            with self._cond:
                self._accepting = False
            self._warm.set()
            return False
        self.warm_up_s = time.perf_counter() - started
        log.info("model %s warmed up in %.2f s (%s)", self.loaded.name, self.warm_up_s, described(parts))
        self._shapes = idle_shapes(self.limits, prefill_s_per_token(parts, self.limits, self.loaded.context_tokens,
                                                                     self.prefill_tok_s))
        self._warm.set()
        return True

    def _loop(self) -> None:
        self._active_at = time.monotonic()
        while True:
            commands = self._next_commands()
            if commands is None:
                break
            if commands.submitted and not self._running and not self._waiting:
                self._gather(commands)
            for slot in commands.cancelled:
                self._drop(slot, "cancelled")
            self._waiting.extend(s for s in commands.submitted if not s.done)
            started = time.perf_counter()
            self._admit()
            admit_s = time.perf_counter() - started
            self.phase_s["admit"] += admit_s
            if self._running:
                self._step(admit_s)
            self._active_at = time.monotonic()
        for slot in [*self._waiting, *self._running.values()]:
            self._drop(slot, "cancelled")

    def _next_commands(self) -> _Commands | None:
        """Returns the commands that arrived since the last step; None once stopping. While
        idle, the engine does its idle work a piece at a time (`_idle_work`), never while
        requests run, nor while one waits for its SSD reads, which it would slow down, nor
        within `IDLE_QUIET_S` of the last step or arrival, when more requests are likely to
        come."""
        with self._cond:
            while not (self._commands.submitted or self._commands.cancelled or self._running
                       or self._stopping or self._wakeups or self._admissible()):
                work = self._idle_work()
                if work is None:
                    # Timed: the native kernels' self-test may enable pinning at any moment.
                    self._cond.wait(timeout=IDLE_RECHECK_S if self.cache is not None else None)
                    continue
                quiet_s = self._active_at + IDLE_QUIET_S - time.monotonic()
                if quiet_s > 0:
                    self._cond.wait(timeout=quiet_s)
                    continue
                self._cond.release()
                try:
                    work()
                finally:
                    self._cond.acquire()
            if self._stopping:
                return None
            return self._take_commands()

    def _idle_work(self) -> Callable[[], object] | None:
        """Returns the next piece of idle work, if any (`_cond` held): a call shape
        (`_warm_shape`) ahead of the first request that would meet it, then pinning host memory
        for the KV cache's native path, a slot at a time (pinning holds the GPU and the
        host's memory up)."""
        if self._waiting:
            return None
        if self._shapes and self.limits.idle_shapes != "off":  # turned off live: the rest are left
            return self._warm_shape
        if self.cache is not None and self.cache.store.wants_pinned():
            return self.cache.store.pin_one
        return None

    def _warm_shape(self) -> None:
        """Runs the next call shape left (warm_up.run_shape); on a failure
        drops the rest, which real waves then meet as they would have."""
        rows, length = self._shapes[0]
        started = time.perf_counter()
        try:
            if self._shape_prompt is None:
                self._shape_prompt = tuple(self.loaded.encode_chat(list(WARM_UP_CHAT)))
            run_shape(self._scheduler, self.loaded, self._shape_prompt, rows, length)
        except Exception:
            log.exception("model %s: a call shape of %d x %d tokens failed; the rest are left to requests",
                          self.loaded.name, rows, length)
            self._shapes = []
            return
        finally:
            self._shapes_s += time.perf_counter() - started
        if len(self._shapes) == 1:  # logged before the status says none is left
            log.info("model %s ran its idle call shapes in %.2f s", self.loaded.name, self._shapes_s)
        self._shapes = self._shapes[1:]

    @property
    def shapes_to_warm(self) -> int:
        """Returns how many call shapes the idle engine has yet to run."""
        return len(self._shapes) if self.limits.idle_shapes != "off" else 0

    @property
    def matmul_choices(self) -> dict[int, str]:
        """Returns what the decode passes of each count of rows run now, native or generic,
        where this engine chooses (engine/matmul_choice.py; copied, from any thread)."""
        return self._scheduler.matmuls.choices() if self._scheduler is not None else {}

    def _gather(self, commands: _Commands) -> None:
        """Adds to `commands`, which woke an idle engine, what arrives until none has for
        `gather_ms` (at most `GATHER_ROUNDS` times that in all): clients sent together
        start as one batch, not the first alone and the rest joining its batch a step
        later (on an H100, 8 and 32 HTTP clients ran 1.2-1.6x the tokens/s with 5 ms:
        BENCHMARKS.md, "gathering a wave")."""
        quiet = self.limits.gather_ms / 1000
        if not quiet:
            return
        with self._cond:
            deadline = time.monotonic() + GATHER_ROUNDS * quiet
            while not self._stopping:
                now = time.monotonic()
                until = min(self._submitted_at + quiet, deadline)
                if now >= until:
                    break
                self._cond.wait(timeout=until - now)
            more = self._take_commands()
            commands.submitted += more.submitted
            commands.cancelled += more.cancelled

    def _take_commands(self) -> _Commands:
        """Returns the commands that arrived and starts collecting anew (`_cond` held)."""
        commands, self._commands = self._commands, _Commands()
        self._wakeups = 0
        return commands

    def _admissible(self) -> bool:
        """True when a waiting request could start now (a batch that just emptied at once
        leaves queued requests with nothing else to wake the engine)."""
        return len(self._running) < self.limits.max_running and any(map(self._ready, self._waiting))

    def _ready(self, slot: Slot) -> bool:
        """True when `slot` may start: its prefetch is done, or its reads are under way and
        nothing runs, so its restore may wait on them (it moves the blocks read first to the
        device while the rest are read) without holding anyone up."""
        return slot.prefetch is None or slot.prefetch.done() or (slot.reading and not self._running)

    def _admit(self) -> None:
        """Moves waiting requests into the batch, oldest first, once they are ready (`_ready`)."""
        for slot in list(self._waiting):
            if len(self._running) >= self.limits.max_running:
                return
            if not self._ready(slot):
                continue
            self._waiting.remove(slot)
            restored = self._restore(slot)
            try:
                slot.uid = self._scheduler.insert(**slot.insert_args(restored))
            except Exception as e:
                log.exception("could not admit a request on model %s", self.loaded.name)
                self._finish(slot, "error", error=f"could not start generation: {e}")
                continue
            slot.stats.admitted_at = time.perf_counter()
            slot.saved_tokens = slot.stats.cached_tokens
            self._running[slot.uid] = slot

    def _restore(self, slot: Slot) -> Any:
        """Restores the cached prefix of `slot`'s prompt worth restoring; on MLX CUDA whole
        prefill shapes of it (`whole_tokens`), the rest recomputed. A restored
        prefix adds its length to the keys of the call that starts the prompt, and MLX
        CUDA builds an attention graph per shape: over HTTP on an H100, chat prompts
        restoring their template's 24-34 tokens started waves of 8 and 32 in 0.45-0.65 s
        and 0.85-1.9 s of calls, against 0.17 and 0.29 s restoring none (BENCHMARKS.md)."""
        if self.cache is None:
            return None
        prompt = slot.request.prompt_tokens
        started = time.perf_counter()
        try:
            lookup = self.cache.restorable(prompt, tenant=slot.request.tenant, prefill_tok_s=self.prefill_tok_s,
                                           multiple=self.whole_tokens)
            restored = self.cache.restore(lookup, prompt_tokens=len(prompt))
        except Exception:  # a cache fault costs a recompute, never the request
            log.exception("cache restore failed on model %s; recomputing", self.loaded.name)
            return None
        if restored.num_tokens >= RESTORE_LOG_TOKENS:
            log.info("model %s: restored %d of %d prompt tokens (%s) in %.3f s", self.loaded.name,
                     restored.num_tokens, len(prompt), restored.tiers, time.perf_counter() - started)
        slot.stats.cached_tokens = restored.num_tokens
        slot.stats.cached_by_tier = restored.tiers
        return restored

    def _save(self, slot: Slot, cache: list | None, tokens: list[int] | None, *,
              skip_tokens: int | None = None) -> None:
        """Stores the request's new KV blocks (prompt and generated tokens), those of
        `tokens` past `skip_tokens` (default: past its restored prefix)."""
        self._save_all([(slot, cache, tokens)], skip_tokens=skip_tokens)

    def _save_all(self, finished: list[tuple[Slot, list | None, list[int] | None]], *,
                  skip_tokens: int | None = None) -> None:
        """`_save` for several requests, with one wait for the device (`ModelCache.save_all`).
        On MLX CUDA only whole prefill shapes of their tokens (`whole_tokens`): no more is
        ever restored (`_restore`), and a short chat's partial block cost its wave's last
        step on an H100 29-35 ms at 8 rows, 61-71 ms at 32."""
        if self.cache is None:
            return
        whole = self.whole_tokens
        savings = [Saving(cache, tokens[:len(tokens) // whole * whole], slot.request.tenant,
                          slot.stats.cached_tokens if skip_tokens is None else skip_tokens)
                   for slot, cache, tokens in finished if cache and tokens and len(tokens) >= whole]
        if not savings:
            return
        try:
            self.cache.save_all(savings)
        except Exception:
            log.exception("cache save failed on model %s", self.loaded.name)

    def _step(self, admit_s: float = 0.0) -> None:
        """One scheduler step: start and decode, hand the tokens out, then advance a prefill
        (`admit_s`: what admitting requests took before it, for the step trace)."""
        scheduler = self._scheduler
        cpu_started = time.thread_time() if self._trace is not None else 0.0  # for the trace only
        try:
            prefilled, generated = scheduler.step()
        except Exception as e:
            return self._failed(e)
        t0 = time.perf_counter()
        self._deliver(prefilled, generated)
        t1 = time.perf_counter()
        try:
            scheduler.advance()
        except Exception as e:
            return self._failed(e)
        t2 = time.perf_counter()
        self._save_computed()
        phases = {"start": scheduler.last_start_s, "decode": scheduler.last_decode_s,
                  "deliver": t1 - t0, "advance": t2 - t1, "save": time.perf_counter() - t2}
        self.phase_s.update(phases)
        self.num_steps += 1
        self.num_prefill_calls += scheduler.last_prefill_calls
        if self._trace is not None:
            self._trace.write(self.loaded.name, {
                "running": len(self._running), "waiting": len(self._waiting), "started": len(prefilled),
                "tokens_out": len(generated), "prefill_calls": scheduler.last_prefill_calls,
                "advanced": scheduler.last_advanced_tokens, "calls": scheduler.last_calls,
                "phases_ms": {k: round(1000 * v, 2) for k, v in {"admit": admit_s, **phases}.items()},
                "cpu_ms": round(1000 * (time.thread_time() - cpu_started), 2),
                "small_matmul": scheduler.matmuls.last})

    def _save_computed(self) -> None:
        """Saves the full prompt blocks that running requests computed, at most one
        prefill chunk's worth a step (or what the step advanced), so each copy follows
        the chunk that made it (the last chunks, prefilled with the first token, over the
        next few steps) and concurrent requests share a long prompt's prefix before it
        finishes.

        Saved all at once after the prefill, a 25K-token prompt's 50 blocks stalled the
        next decode step by 110-145 ms on an H200 (BENCHMARKS.md, "GPU"). A lone prompt
        advances by several chunks a step, and the saves keep pace with it. Full blocks
        only: the prompt's partial tail block is saved once, at the finish, with the
        generated tokens (and whatever this left, if it finishes first).
        """
        if self.cache is None:
            return
        b = self.cache.block_tokens
        budget = max(self.limits.prefill_chunk_tokens, b, self._scheduler.last_advanced_tokens)
        for slot in list(self._running.values()):
            full = slot.stats.prompt_tokens // b * b
            if slot.saved_tokens >= full:
                continue
            if budget < b:
                return
            cache, tokens = self._scheduler.extract(slot.uid, copy=False)  # the save copies its blocks
            if not cache or not tokens or cache[0].keys is None:
                continue
            end = min(len(tokens), cache[0].offset, full, slot.saved_tokens + budget) // b * b
            if end > slot.saved_tokens:
                self._save(slot, cache, tokens[:end], skip_tokens=slot.saved_tokens)
                budget -= end - slot.saved_tokens
                slot.saved_tokens = end

    def _failed(self, error: Exception) -> None:
        """An MLX failure fails the batch, not the engine; one that lost the GPU's context
        (`device_lost`) is reported to `on_device_lost`, since nothing on it works again."""
        log.exception("engine step failed on model %s", self.loaded.name)
        for slot in list(self._running.values()):
            self._finish(slot, "error", error=f"generation failed: {error}")
        self._running.clear()
        self._scheduler = Scheduler.for_device(self.loaded.model, self.limits)
        if device_lost(error) and self.on_device_lost is not None:
            self.on_device_lost(str(error))

    def _deliver(self, prefilled: list[int], generated: list) -> None:
        now = time.perf_counter()
        started = [self._running[uid] for uid in prefilled if uid in self._running]
        for slot in started:
            slot.stats.prefilled_at = now
        deliveries, finished, ended = [], [], []
        for r in generated:
            slot = self._running.get(r.uid)
            if slot is None:
                continue
            events, reason = slot.on_token(r.token, r.logprobs, r.finish_reason)
            if reason is not None:
                if r.finish_reason is None:  # a stop string: the scheduler still holds it
                    self._remove(slot)
                else:
                    finished.append((slot, r.cache, r.tokens))
                del self._running[r.uid]
                ended.append((slot, reason, events))
            deliveries.append((slot.handle, events))
        self._save_all(finished)  # saved before their ends are told: a next turn finds them
        for slot, reason, events in ended:
            events.append(self._finished(slot, reason))
        _push_all(deliveries)
        for slot in started:
            self._prefilled(slot)

    def _prefilled(self, slot: Slot) -> None:
        """Moves `prefill_tok_s` toward the speed `slot`'s prompt was prefilled at: its
        tokens over its share of the seconds of the calls that computed them
        (Scheduler.last_prefilled). Not its wait for its first token: rows sharing a call
        divide that, and restores then look worth more than they are (on an H200, 7 prompts
        of ~125 tokens started together in 0.37 s: ~340 tok/s each, against 27K tok/s for a
        lone 25K-token prefill).

        Tokens and seconds are averaged apart, so each prefill weighs by its seconds: the
        short tail a memory hit leaves runs at a fraction of a long prompt's speed (on an
        H100, three of 158 tokens after a 25K-token prefill took a plain average of speeds
        from 13.6K to 8.2K tok/s, and a recompute of 25K tokens that took 2.0 s was
        estimated at 3.0 s)."""
        tokens, seconds = self._scheduler.last_prefilled.get(slot.uid, (0, 0.0))
        if tokens < RATE_TOKENS or seconds <= 0:
            return
        # A speed known without its seconds (kept from an earlier run) weighs as a second's prefill.
        before_s = None if self.prefill_tok_s is None else self._prefill_s or 1.0
        average_s = moving_average(before_s, seconds)
        average_tokens = moving_average(None if before_s is None else self.prefill_tok_s * before_s, tokens)
        self.prefill_tok_s, self._prefill_s = average_tokens / average_s, average_s
        if self.cache is not None:
            self.cache.store.prefill_tok_s[self.cache.dir] = self.prefill_tok_s

    def _remove(self, slot: Slot) -> None:
        """Takes a request out of the batch, keeping its KV."""
        self._save(slot, *self._scheduler.remove(slot.uid, keep_cache=self.cache is not None))

    def _drop(self, slot: Slot, reason: str) -> None:
        if slot.done:
            return
        if slot.uid is not None and self._running.pop(slot.uid, None) is not None:
            self._remove(slot)
        elif slot in self._waiting:
            self._waiting.remove(slot)
        self._finish(slot, reason)

    def _finish(self, slot: Slot, reason: str, *, error: str | None = None) -> None:
        _push_all([(slot.handle, [self._finished(slot, reason, error=error)])])

    def _finished(self, slot: Slot, reason: str, *, error: str | None = None) -> Finished:
        slot.done = True
        stats = slot.stats
        stats.finished_at = time.perf_counter()
        stats.finish_reason = reason
        self.recent.append(stats)
        if self.on_finished is not None:
            self.on_finished(stats)
        with self._cond:
            self._num_live -= 1
            self._cond.notify_all()
        return Finished(reason=reason, stats=stats, error=error)

