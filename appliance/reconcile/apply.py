"""Applying a plan: every step prepares beside what serves, and commits only if all worked.

Each action's `prepare` builds the new thing next to the old one (a model loads while
the old one keeps serving, a new socket opens before the old one closes) and returns
how to undo and how to commit. A failed step undoes the steps before it, in reverse,
and the previous config keeps serving; `config.last_error` says what failed, where in
the TOML, and when.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from appliance.config import ConfigError, LoadedConfig
from appliance.reconcile.plan import (
    Action,
    LoadModel,
    Rebind,
    ReopenCache,
    ResizeCache,
    SelectKernels,
    SetBatching,
    UnloadModel,
    plan,
)
from appliance.runtime import Appliance, ModelEntry

log = logging.getLogger("omlx.reconcile")

Thunk = Callable[[], Awaitable[None] | None]

# Requests in flight on a swapped-out or removed model finish on it: there is no
# shutdown pressure, only memory held a little longer. This bounds a stuck client.
RETIRE_DRAIN_S = 600.0


@dataclass
class Step:
    undo: Thunk | None = None
    commit: Thunk | None = None


@dataclass(frozen=True)
class Outcome:
    applied: bool
    hash: str
    actions: tuple[str, ...] = ()
    error: dict | None = None
    seconds: float = 0.0


class StepFailed(Exception):
    def __init__(self, action: Action, path: str, cause: BaseException):
        super().__init__(f"{action.describe()} failed: {cause}")
        self.path = path


class Reconciler:
    """Makes the running appliance what the config says, one apply at a time."""

    def __init__(self, appliance: Appliance, *, rebind: Callable[[str, int], Awaitable[Any]] | None = None):
        self.appliance = appliance
        self._rebind = rebind  # opens a socket beside the current one; returns a closer pair
        self._lock = asyncio.Lock()
        self._store: Any = None  # the KV store models loaded by the current apply use
        self.applies = 0
        self.failures = 0  # applies undone and files rejected (for /metrics)

    async def apply(self, desired: LoadedConfig) -> Outcome:
        """Applies `desired`; returns what happened (an unchanged spec is a no-op)."""
        async with self._lock:
            started = time.perf_counter()
            app = self.appliance
            actions = plan(app.spec, desired.spec)
            self._store = app.store
            done: list[Step] = []
            try:
                for action in actions:
                    log.info("applying: %s", action.describe())
                    done.append(await self._prepare(action, desired))
            except StepFailed as e:
                for step in reversed(done):
                    await _call(step.undo)
                app.last_error = error_record(str(e), path=e.path, file=desired.path)
                self.failures += 1
                log.error("config not applied, the previous one keeps serving: %s", e)
                return Outcome(False, app.spec.hash, tuple(a.describe() for a in actions), app.last_error,
                               time.perf_counter() - started)
            app.config = desired
            for step in done:
                await _call(step.commit)
            app.last_error = None
            self.applies += 1
            if actions:
                log.info("config %s applied in %.2f s (%d actions)", desired.spec.hash,
                         time.perf_counter() - started, len(actions))
            return Outcome(True, desired.spec.hash, tuple(a.describe() for a in actions), None,
                           time.perf_counter() - started)

    def reject(self, error: ConfigError) -> None:
        """Records an invalid file: nothing changes, the error shows in the status."""
        first = error.issues[0] if error.issues else None
        self.failures += 1
        self.appliance.last_error = error_record(str(error), path=first.path if first and first.path else None,
                                                 file=error.file)
        log.error("config file invalid, the previous config keeps serving:\n%s", error)

    async def _prepare(self, action: Action, desired: LoadedConfig) -> Step:
        try:
            return await self._handlers[type(action)](self, action, desired)
        except StepFailed:
            raise
        except Exception as e:
            raise StepFailed(action, toml_path_of(action, desired), e) from e

    # --- one handler per action type -----------------------------------------------

    async def _resize(self, action: ResizeCache, desired: LoadedConfig) -> Step:
        store, old = self.appliance.store, self.appliance.spec.cache
        if store is None:
            return Step()
        c = action.cache
        await asyncio.to_thread(store.resize, memory_bytes=c.memory_bytes, host_bytes=c.host_bytes,
                                ssd_bytes=c.ssd_bytes)
        return Step(undo=lambda: asyncio.to_thread(store.resize, memory_bytes=old.memory_bytes,
                                                   host_bytes=old.host_bytes, ssd_bytes=old.ssd_bytes))

    async def _reopen(self, action: ReopenCache, desired: LoadedConfig) -> Step:
        app = self.appliance
        old_store = app.store
        new_dir = action.cache.path(desired.base_dir)
        moved = new_dir != app.cache_dir
        store = await asyncio.to_thread(app.open_store, action.cache, new_dir) if moved else old_store
        old_cache = app.spec.cache
        if not moved and store is not None:  # same store, new block size: budgets may change too
            c = action.cache
            await asyncio.to_thread(store.resize, memory_bytes=c.memory_bytes, host_bytes=c.host_bytes,
                                    ssd_bytes=c.ssd_bytes)
        self._store = store  # models loaded later in this apply use the new store
        caches = {name: await asyncio.to_thread(app.model_cache, e.engine.loaded, store, action.cache, new_dir)
                  for name, e in app.models.items() if e.engine is not None}

        def undo() -> None:
            if moved and store is not None:
                store.close()
            elif store is not None:
                store.resize(memory_bytes=old_cache.memory_bytes, host_bytes=old_cache.host_bytes,
                             ssd_bytes=old_cache.ssd_bytes)

        def commit() -> None:
            app.store = store
            for name, cache in caches.items():
                if name in app.models and app.models[name].engine is not None:
                    app.models[name].engine.cache = cache
            if moved and old_store is not None:
                threading.Thread(target=old_store.close, daemon=True).start()

        return Step(undo=undo, commit=commit)

    async def _batching(self, action: SetBatching, desired: LoadedConfig) -> Step:
        engines = [e.engine for e in self.appliance.models.values() if e.engine is not None]
        old = self.appliance.spec.batching
        def set_all(limits) -> None:
            for engine in engines:
                engine.set_limits(limits)

        set_all(action.batching)
        return Step(undo=lambda: set_all(old))

    async def _kernels(self, action: SelectKernels, desired: LoadedConfig) -> Step:
        # No native kernel exists yet: the selection is recorded and shown in the status.
        return Step()

    async def _unload(self, action: UnloadModel, desired: LoadedConfig) -> Step:
        app = self.appliance
        entry = app.models.pop(action.name)  # new requests get 404 from here on

        def undo() -> None:
            app.models[action.name] = entry

        def commit() -> None:
            app.retire(entry, drain_s=RETIRE_DRAIN_S)

        return Step(undo=undo, commit=commit)

    async def _load(self, action: LoadModel, desired: LoadedConfig) -> Step:
        app = self.appliance
        spec = action.spec
        if not action.replaces:
            entry = ModelEntry(spec, state="loading")
            app.models[spec.name] = entry  # requests wait (bounded) while it loads
            try:
                await asyncio.to_thread(app.load_into, entry, desired, store=self._store)
            except BaseException:
                app.models.pop(spec.name, None)
                raise
            if entry.state != "ready":
                app.models.pop(spec.name, None)
                raise RuntimeError(entry.error or "model did not load")
            return Step(undo=lambda: app.retire(app.models.pop(spec.name), drain_s=0))
        # A changed model loads beside the old one, which keeps serving until the swap.
        fresh = ModelEntry(spec, state="loading")
        await asyncio.to_thread(app.load_into, fresh, desired, store=self._store)
        if fresh.state != "ready":
            raise RuntimeError(fresh.error or "model did not load")
        old = app.models[spec.name]

        def commit() -> None:
            app.models[spec.name] = fresh  # in-flight requests finish on the old engine
            app.retire(old, drain_s=RETIRE_DRAIN_S)

        return Step(undo=lambda: app.retire(fresh, drain_s=0), commit=commit)

    async def _rebind_socket(self, action: Rebind, desired: LoadedConfig) -> Step:
        if self._rebind is None:
            raise RuntimeError("this server cannot rebind")
        close_new, close_old = await self._rebind(action.host, action.port)
        return Step(undo=close_new, commit=close_old)

    _handlers: dict[type, Callable[..., Awaitable[Step]]] = {
        ResizeCache: _resize,
        ReopenCache: _reopen,
        SetBatching: _batching,
        SelectKernels: _kernels,
        UnloadModel: _unload,
        LoadModel: _load,
        Rebind: _rebind_socket,
    }


def toml_path_of(action: Action, desired: LoadedConfig) -> str:
    """Returns where in the TOML the failing action's setting lives."""
    if isinstance(action, LoadModel):
        index = next(i for i, m in enumerate(desired.spec.models) if m.name == action.spec.name)
        return f"models[{index}].source"
    if isinstance(action, UnloadModel):
        return "models"
    if isinstance(action, Rebind):
        return "server.port"
    if isinstance(action, (ResizeCache, ReopenCache)):
        return "cache"
    if isinstance(action, SetBatching):
        return "batching"
    return "kernels"


def error_record(message: str, *, path: str | None, file: Any) -> dict:
    return {"message": message, "path": path, "file": str(file) if file else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


async def _call(thunk: Thunk | None) -> None:
    if thunk is None:
        return
    result = thunk()
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result
