"""The reconcile actions: data saying what changes, and how each prepares, commits, undoes.

An action's fields are all the plan holds (frozen, comparable, printable). Its `prepare`
builds the new thing next to the old one (a model loads while the old one keeps serving,
a new socket opens before the old one closes) and returns a `Step`: how to commit once
every action of the apply has prepared, and how to undo if a later one fails. Adding a
kind of change is adding one class here and one line to `plan()`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.spec import BatchingSpec, CacheSpec, KernelsSpec, ModelSpec, Spec

if TYPE_CHECKING:
    from appliance.cache.store import KVStore
    from appliance.config import LoadedConfig
    from appliance.runtime import Appliance

Thunk = Callable[[], Awaitable[None] | None]

# Requests in flight on a swapped-out or removed model finish on it: there is no
# shutdown pressure, only memory held a little longer. This bounds a stuck client.
RETIRE_DRAIN_S = 600.0


@dataclass
class Step:
    """What a prepared action still has to do: `commit` when the apply succeeds, `undo`
    when a later action fails."""

    undo: Thunk | None = None
    commit: Thunk | None = None


@dataclass
class Run:
    """One apply in progress: what every action's `prepare` works on."""

    appliance: Appliance
    desired: LoadedConfig
    store: KVStore | None  # the store models loaded by this apply use (a reopen replaces it)
    rebind: Callable[[str, int], Awaitable[Any]] | None = None


class Action:
    """One change the plan asks for."""

    toml_path = ""  # where in the TOML the action's setting lives (for errors)

    def describe(self) -> str:
        """Returns the change in words, as `omlx diff` and the log show it."""
        raise NotImplementedError

    def path_in(self, desired: Spec) -> str:
        """Returns where in `desired`'s TOML this action's setting lives."""
        return self.toml_path

    async def prepare(self, run: Run) -> Step:
        """Makes the change beside what serves; returns how to commit or undo it."""
        raise NotImplementedError


def resize(store: KVStore, cache: CacheSpec) -> None:
    """Sets `store`'s tier budgets and precisions to those of `cache`."""
    store.set_kv_bits(host_kv_bits=cache.host_kv_bits, ssd_kv_bits=cache.ssd_kv_bits)
    store.resize(memory_bytes=cache.memory_bytes, host_bytes=cache.host_bytes, ssd_bytes=cache.ssd_bytes)


@dataclass(frozen=True)
class ResizeCache(Action):
    cache: CacheSpec
    toml_path = "cache"

    def describe(self) -> str:
        c = self.cache
        return f"resize cache tiers: memory {c.memory_gb} GB, host {c.host_gb} GB, ssd {c.ssd_gb} GB"

    async def prepare(self, run: Run) -> Step:
        store, old = run.appliance.store, run.appliance.spec.cache
        if store is None:
            return Step()
        await asyncio.to_thread(resize, store, self.cache)
        return Step(undo=lambda: asyncio.to_thread(resize, store, old))


@dataclass(frozen=True)
class ReopenCache(Action):
    """The cache moved (`dir`), changed its block size or a tier's KV precision: new key
    spaces (and a new store when it moved)."""

    cache: CacheSpec
    toml_path = "cache"

    def describe(self) -> str:
        c = self.cache
        return (f"reopen the cache at {c.dir} with {c.block_tokens}-token blocks, KV at "
                f"{c.host_kv_bits} bits in host and {c.ssd_kv_bits} on the SSD")

    async def prepare(self, run: Run) -> Step:
        app = run.appliance
        old_store, old_cache = app.store, app.spec.cache
        new_dir = self.cache.path(run.desired.base_dir)
        moved = new_dir != app.cache_dir
        store = await asyncio.to_thread(app.open_store, self.cache, new_dir) if moved else old_store
        if not moved and store is not None:  # same store, new block size: budgets may change too
            await asyncio.to_thread(resize, store, self.cache)
        elif store is not None:
            store.probe_ssd()  # its disk's read rate, for the models already loaded
        run.store = store  # models loaded later in this apply use the new store
        caches = {name: await asyncio.to_thread(app.model_cache, e.engine.loaded, store, self.cache, new_dir)
                  for name, e in app.models.items() if e.engine is not None}

        def undo() -> None:
            if moved and store is not None:
                store.close()
            elif store is not None:
                resize(store, old_cache)

        def commit() -> None:
            app.store = store
            for name, cache in caches.items():
                if name in app.models and app.models[name].engine is not None:
                    app.models[name].engine.cache = cache
            if moved and old_store is not None:
                threading.Thread(target=old_store.close, daemon=True).start()

        return Step(undo=undo, commit=commit)


@dataclass(frozen=True)
class SetBatching(Action):
    batching: BatchingSpec
    toml_path = "batching"

    def describe(self) -> str:
        b = self.batching
        return (f"set batching limits: max_running {b.max_running}, max_queued {b.max_queued}, "
                f"prefill_chunk_tokens {b.prefill_chunk_tokens}, prefill_step_ms {b.prefill_step_ms}, "
                f"warm_up_beside_load {b.warm_up_beside_load}, short_attention {b.short_attention}, "
                f"gather_ms {b.gather_ms:g}, idle_shapes {b.idle_shapes}")

    async def prepare(self, run: Run) -> Step:
        engines = [e.engine for e in run.appliance.models.values() if e.engine is not None]
        old = run.appliance.spec.batching

        def set_all(limits: BatchingSpec) -> None:
            for engine in engines:
                engine.set_limits(limits)

        set_all(self.batching)
        return Step(undo=lambda: set_all(old))


@dataclass(frozen=True)
class SelectKernels(Action):
    kernels: KernelsSpec
    toml_path = "kernels"

    def describe(self) -> str:
        return "select kernels: " + ", ".join(f"{k}={v}" for k, v in self.kernels.model_dump().items())

    async def prepare(self, run: Run) -> Step:
        from appliance.kernels.registry import apply, switch

        use, old = functools.partial(switch, run.appliance.store), run.appliance.spec.kernels
        apply(self.kernels.model_dump(), use)
        return Step(undo=lambda: apply(old.model_dump(), use))


@dataclass(frozen=True)
class UnloadModel(Action):
    name: str
    toml_path = "models"

    def describe(self) -> str:
        return f"unload model {self.name}"

    async def prepare(self, run: Run) -> Step:
        app = run.appliance
        entry = app.models.pop(self.name)  # new requests get 404 from here on

        def undo() -> None:
            app.models[self.name] = entry

        return Step(undo=undo, commit=lambda: app.retire(entry, drain_s=RETIRE_DRAIN_S))


@dataclass(frozen=True)
class LoadModel(Action):
    spec: ModelSpec
    replaces: bool = False  # a changed model: load the new one beside the old, then swap

    def describe(self) -> str:
        verb = "reload" if self.replaces else "load"
        return f"{verb} model {self.spec.name} from {self.spec.source}"

    def path_in(self, desired: Spec) -> str:
        index = next(i for i, m in enumerate(desired.models) if m.name == self.spec.name)
        return f"models[{index}].source"

    async def prepare(self, run: Run) -> Step:
        return await (self._replace(run) if self.replaces else self._add(run))

    def _entry(self) -> Any:
        from appliance.runtime import ModelEntry  # imports MLX: `omlx diff` plans without it

        return ModelEntry(self.spec, state="loading")

    async def _add(self, run: Run) -> Step:
        app, name = run.appliance, self.spec.name
        entry = self._entry()
        app.models[name] = entry  # requests wait (bounded) while it loads
        try:
            await asyncio.to_thread(app.load_into, entry, run.desired, store=run.store)
        except BaseException:
            app.models.pop(name, None)
            raise
        if entry.state != "ready":
            app.models.pop(name, None)
            raise RuntimeError(entry.error or "model did not load")
        return Step(undo=lambda: app.retire(app.models.pop(name), drain_s=0))

    async def _replace(self, run: Run) -> Step:
        """The changed model loads beside the old one, which keeps serving until the swap."""
        app, name = run.appliance, self.spec.name
        fresh = self._entry()
        await asyncio.to_thread(app.load_into, fresh, run.desired, store=run.store)
        if fresh.state != "ready":
            raise RuntimeError(fresh.error or "model did not load")
        old = app.models[name]

        def commit() -> None:
            app.models[name] = fresh  # in-flight requests finish on the old engine
            app.retire(old, drain_s=RETIRE_DRAIN_S)

        return Step(undo=lambda: app.retire(fresh, drain_s=0), commit=commit)


@dataclass(frozen=True)
class Rebind(Action):
    host: str
    port: int
    toml_path = "server.port"

    def describe(self) -> str:
        return f"rebind the server to {self.host}:{self.port}"

    async def prepare(self, run: Run) -> Step:
        if run.rebind is None:
            raise RuntimeError("this server cannot rebind")
        close_new, close_old = await run.rebind(self.host, self.port)
        return Step(undo=close_new, commit=close_old)
