"""The running appliance: the applied config and one engine per model, with their states."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from appliance import platform
from appliance.cache.keys import DEFAULT_TENANT, tenant_dir
from appliance.cache.kv import KVLayout, probe_layout
from appliance.cache.model_cache import ModelCache, block_payloads, kv_tenant
from appliance.cache.store import KVStore
from appliance.config import LoadedConfig
from appliance.engine.engine import Engine
from appliance.engine.request import RequestStats
from appliance.engine.stand_in import warm_up_stand_in
from appliance.engine.thread import EngineThread
from appliance.kernels import ahead
from appliance.kernels.registry import apply as select_kernels
from appliance.kernels.registry import report as kernel_report
from appliance.kernels.registry import switch as switch_kernels
from appliance.models import kinds, preload
from appliance.models.fingerprint import start_fingerprint, weights_fingerprint
from appliance.models.loaded import LoadedModel, load_model
from appliance.models.memory import check_memory
from appliance.spec import CacheSpec, ModelSpec

PROBE = object()  # model_cache: probe the layout
FINGERPRINT_WAIT_S = 1.0  # past this, the KV cache attaches after readiness
KERNEL_WARM_WAIT_S = 30.0  # readiness waits this long at most for the native KV kernels to compile
PIN_START_WAIT_S = 5.0  # and for the start's pinned slots (2 GiB: 0.9-1.6 s on an H100 machine)

log = logging.getLogger("omlx.runtime")

RECENT_SHOWN = 20  # per-request figures shown in the status


class UnknownModel(Exception):
    """No model of that name is configured."""


class ModelUnavailable(Exception):
    """The model is configured but not serving (loading, failed or stopping)."""

    def __init__(self, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: str = "pending"  # pending | loading | ready | failed | stopping | stopped
    engine: Engine | None = None
    error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def to_data(self, *, default: bool) -> dict:
        loaded = self.engine.loaded if self.engine else None
        return {
            "name": self.spec.name,
            "state": self.state,
            "default": default,
            "source": self.spec.source,
            "error": self.error,
            "dtype": loaded.dtype if loaded else None,
            "context_tokens": loaded.context_tokens if loaded else None,
            "load_s": round(loaded.load_s, 3) if loaded else None,
            "warm_up_s": round(self.engine.warm_up_s, 3) if self.engine and self.engine.warm_up_s else None,
            "shapes_to_warm": self.engine.shapes_to_warm if self.engine else 0,
            # per count of rows, what `[kernels] small_matmul = "auto"` chose (CUDA)
            "small_matmul": {str(rows): choice for rows, choice in self.engine.matmul_choices.items()}
            if self.engine else {},
            "loaded_at": loaded.loaded_at if loaded else None,
            "limits": self.engine.limits.model_dump() if self.engine else None,
            "live_requests": self.engine.num_live if self.engine else 0,
            "recent_requests": [r.to_data() for r in list(self.engine.recent)[-RECENT_SHOWN:]]
            if self.engine else [],
        }


class Appliance:
    """Holds what is applied; loads models in the background so the API answers at once."""

    def __init__(self, config: LoadedConfig):
        self.config = config
        self.started_at = time.time()
        self.last_error: dict | None = None
        self.models = {m.name: ModelEntry(m) for m in config.spec.models}
        self._loader: threading.Thread | None = None
        self.store: KVStore | None = None
        self.loaded = threading.Event()  # the first load of every model is over
        self._prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-prefetch")
        self.on_request_finished: Callable[[str, RequestStats], None] | None = None  # /metrics
        self.device_lost: str | None = None  # why this process must restart (Engine.on_device_lost)
        # How the process stops itself then: as a SIGTERM would, draining what it can.
        self.stop_process: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)

    @property
    def spec(self):
        return self.config.spec

    def start(self) -> None:
        self._loader = threading.Thread(target=self._load_all, name="model-loader", daemon=True)
        self._loader.start()

    @property
    def cache_dir(self):
        return self.spec.cache.path(self.config.base_dir)

    def _load_all(self) -> None:
        """Opens the KV store, then loads and warms up every model; the heap pre-touch runs
        beside them, so readiness never waits for it."""
        self.store = self.open_store(self.spec.cache, self.cache_dir)
        threading.Thread(target=self._prefault, name="heap-pretouch", daemon=True).start()
        for entry in self.models.values():
            self.load_into(entry, self.config)
        self.loaded.set()

    def _prefault(self) -> None:
        started = time.perf_counter()
        touched = platform.prefault_heap(self.spec.cache.memory_bytes)
        if touched:
            log.info("pre-touched %.0f MiB of heap for KV buffers in %.2f s", touched / 2**20,
                     time.perf_counter() - started)

    def open_store(self, cache: CacheSpec, cache_dir: Path) -> KVStore:
        """Returns the KV store on `cache_dir`/kv (its SSD tier creates the directory, for
        this user only)."""
        store = KVStore(root=cache_dir / "kv", memory_bytes=cache.memory_bytes,
                        host_bytes=cache.host_bytes, ssd_bytes=cache.ssd_bytes,
                        host_kv_bits=cache.host_kv_bits, ssd_kv_bits=cache.ssd_kv_bits)
        select_kernels(self.spec.kernels.model_dump(), functools.partial(switch_kernels, store))
        return store

    def load_into(self, entry: ModelEntry, config: LoadedConfig, *, store: KVStore | None = None) -> None:
        """Loads `entry`'s model and starts its engine on `store` (default: the current one);
        a failure is recorded, not raised."""
        store = store or self.store
        entry.state = "loading"
        spec = config.spec
        cache_dir = spec.cache.path(config.base_dir)
        thread = EngineThread(f"engine-{entry.spec.name}")

        layouts: list[KVLayout] = []

        def expect(layout: KVLayout | None) -> None:  # its native KV kernels compile beside the warm-up
            if store is not None and layout is not None:
                store.expect_layout(dtype=layout.dtype, k_dim=layout.k_head_dim, v_dim=layout.v_head_dim)
                layouts.append(layout)

        def pin_ahead() -> None:  # after the stand-in's warm-up or the load (the first starts it)
            if store is not None and layouts:
                try:
                    store.expect_blocks(*block_payloads(layouts[-1], spec.cache.block_tokens, store))
                except Exception:  # a job that raises would end the engine's thread
                    log.exception("model %s: pinning host memory ahead failed", entry.spec.name)

        def beside(path: Path, dtype: str | None) -> None:
            if platform.wanted_here(spec.batching.warm_up_beside_load):
                thread.submit(functools.partial(warm_up_stand_in, entry.spec, path, dtype, spec.batching,
                                                on_layout=expect))
                thread.submit(pin_ahead)

        try:
            if not preload.memory_checked(entry.spec.name):  # a preload checked it before it read
                check_memory(entry.spec, base_dir=config.base_dir, cache_dir=cache_dir)
            loaded = load_model(entry.spec, base_dir=config.base_dir, cache_dir=cache_dir, beside=beside)
            if store is not None:
                store.probe_ssd()  # the disk, now that the load no longer reads it
            ahead.wait(kinds.of_model(loaded.model))  # the first forward pass: MLX's kernels compiled ahead are there
            layout = probe_layout(loaded.model)  # MLX work: before the engine's own work starts
            expect(layout)
            pin_ahead()  # unless the stand-in's layout started it: beside the warm-up, not the first request
            engine = Engine(loaded, spec.batching, cache=None, prefetcher=self._prefetcher, thread=thread)
            entry.engine = engine.start_warm()  # ready only once a first request's work has run
            engine.on_finished = functools.partial(self._request_finished, entry.spec.name)
            engine.on_device_lost = functools.partial(self._device_lost, entry)
            self._attach_cache(engine, store, spec.cache, cache_dir, layout)
            if store is not None and not store.wait_warm(KERNEL_WARM_WAIT_S):
                log.warning("model %s: its native KV kernels are still compiling", entry.spec.name)
            if store is not None:
                store.wait_start_pinning(PIN_START_WAIT_S)
            entry.state = "ready"
        except Exception as e:  # a model that cannot load must not take the others down
            thread.close()  # a warm-up beside the load ends with its job
            log.error("model %s failed to load: %s", entry.spec.name, e)
            entry.state, entry.error = "failed", str(e)
        entry.ready.set()

    def _attach_cache(self, engine: Engine, store: KVStore | None, cache: CacheSpec, cache_dir: Path,
                      layout) -> None:
        """Gives `engine` its KV cache once the weights' fingerprint (the cache key) is known:
        at once when it is (memoized, or small weights hashed during the load), else from a
        background thread when the hash finishes, so that first sight of a large model
        (16 GB: ~7 s on an H200 machine) does not hold up readiness; requests before that
        run without the cache."""
        future = start_fingerprint(engine.loaded.path, memo_dir=cache_dir)

        def attach(_=None) -> None:
            try:
                model_cache = self.model_cache(engine.loaded, store, cache, cache_dir, layout=layout)
            except Exception:
                log.exception("model %s: its KV cache could not be opened; serving without it", engine.loaded.name)
                return
            if model_cache is not None and engine.cache is None:
                engine.attach(model_cache)  # unless a reconcile reopened the cache meanwhile

        try:
            future.result(timeout=FINGERPRINT_WAIT_S)
        except TimeoutError:
            log.info("model %s: hashing its weights for the KV cache key; the cache attaches when done",
                     engine.loaded.name)
            future.add_done_callback(attach)
            return
        except Exception:
            pass  # attach() reports it
        attach()

    def _request_finished(self, model: str, stats: RequestStats) -> None:
        if self.on_request_finished is None:
            return
        try:
            self.on_request_finished(model, stats)
        except Exception:  # runs on the engine thread: a metrics bug must not fail requests
            log.exception("recording a finished request of %s failed", model)

    def _device_lost(self, entry: ModelEntry, reason: str) -> None:
        """The GPU's context is lost (a CUDA sticky error): nothing on it works again in this
        process. The model reports failed (/health: 503) and the process stops, with a
        status that makes its service manager start it again (`omlx serve` exits
        EXIT_DEVICE_LOST); the KV cache on the SSD outlives it."""
        entry.state, entry.error = "failed", f"the GPU was lost ({reason}); omlx is restarting"
        if self.device_lost is None:
            self.device_lost = reason
            log.critical("model %s: the GPU context is lost (%s); stopping so that the service restarts",
                         entry.spec.name, reason)
            self.stop_process()

    def retire(self, entry: ModelEntry, *, drain_s: float) -> None:
        """Stops an entry's engine in the background, letting its requests finish first."""
        entry.state = "stopping"
        if entry.engine is not None:
            threading.Thread(target=entry.engine.stop, kwargs={"drain_s": drain_s},
                             name=f"retire-{entry.spec.name}", daemon=True).start()

    def model_cache(self, loaded: LoadedModel, store: KVStore | None, cache: CacheSpec,
                    cache_dir: Path, *, layout=PROBE) -> ModelCache | None:
        """Returns the model's view of the KV store; None when its caches can't be blocked.
        `layout`: the model's KV layout when known (probing it runs the model)."""
        layout = probe_layout(loaded.model) if layout is PROBE else layout
        if layout is None or store is None:
            log.warning("model %s: its KV cache type cannot be stored in blocks; prefix caching is off "
                        "for it (output is unaffected)", loaded.name)
            return None
        weights = weights_fingerprint(loaded.path, memo_dir=cache_dir)
        return ModelCache(store, weights=weights, compute_dtype=loaded.dtype, layout=layout,
                          block_tokens=cache.block_tokens)

    @property
    def ready(self) -> bool:
        return all(e.state == "ready" for e in self.models.values())

    def resolve(self, name: str | None) -> ModelEntry:
        """Returns the entry for `name` (the default model when None); raises UnknownModel."""
        if not name:
            return self.models[self.spec.default_model.name]
        entry = self.models.get(name)
        if entry is None:
            raise UnknownModel(f"The model '{name}' does not exist. Available: {', '.join(self.models)}")
        return entry

    async def engine(self, name: str | None, *, wait_s: float = 30.0) -> Engine:
        """Returns the ready engine of `name`, waiting up to `wait_s` while it loads."""
        entry = self.resolve(name)
        if not entry.ready.is_set():
            await asyncio.to_thread(entry.ready.wait, wait_s)
        if entry.state == "ready" and entry.engine is not None:
            return entry.engine
        if entry.state in ("pending", "loading"):
            raise ModelUnavailable(f"model {entry.spec.name} is still loading", retry_after_s=5)
        raise ModelUnavailable(f"model {entry.spec.name} is not available: {entry.error or entry.state}")

    # --- shutdown: the order is server/lifespan.py's `shutdown` ---------------------------

    def stop_engines(self, *, drain_s: float) -> None:
        """Stops every engine; running requests get `drain_s` to finish."""
        for entry in self.models.values():
            if entry.engine is not None:
                entry.engine.stop(drain_s=drain_s)
                entry.state = "stopped"

    def cancel_prefetches(self) -> None:
        """Drops the SSD prefetches not started yet."""
        self._prefetcher.shutdown(wait=False, cancel_futures=True)

    def close_store(self, *, flush_s: float) -> None:
        """Writes the blocks queued for the SSD (waiting at most `flush_s`), then closes the store."""
        if self.store is not None:
            self.store.flush(timeout_s=flush_s)
            self.store.close()

    def cache_stats(self) -> dict:
        """Returns per-tier and per-model cache figures."""
        tiers = self.store.stats() if self.store is not None else {}
        models = {name: e.engine.cache.stats() for name, e in self.models.items()
                  if e.engine is not None and e.engine.cache is not None}
        return {"block_tokens": self.spec.cache.block_tokens, "tiers": tiers, "models": models}

    def _ssd(self):
        if self.store is None or self.store.ssd is None:
            raise ModelUnavailable(f"the SSD cache tier is not available: {self.store and self.store.ssd_error}")
        self.store.flush(timeout_s=60)
        return self.store.ssd

    def export_cache(self, model: str | None, path: Path, *, tenant: str = DEFAULT_TENANT) -> int:
        """Writes one tenant's SSD blocks of the model (none of its salted KV) to an archive;
        returns how many."""
        entry = self.resolve(model)
        if entry.engine is None or entry.engine.cache is None:
            raise ModelUnavailable(f"model {entry.spec.name} has no cache to export (state {entry.state})")
        return self._ssd().export(tenant_dir(entry.engine.cache.weights, kv_tenant(tenant)), path)

    def import_cache(self, path: Path) -> int:
        """Verifies and stores the blocks of an archive; returns how many were imported."""
        return self._ssd().import_archive(path)

    def clear_cache(self, model: str | None = None) -> int:
        """Removes cached blocks of one model (all tenants) or of everything; returns how many."""
        if self.store is None:
            return 0
        if model is None:
            return self.store.clear()
        entry = self.resolve(model)
        if entry.engine is None or entry.engine.cache is None:
            return 0
        return self.store.clear(entry.engine.cache.dir)

    def status(self) -> dict:
        return {
            "version": version(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "ready": self.ready,
            "config": {
                "path": str(self.config.path),
                "hash": self.spec.hash,
                "files": [str(f) for f in self.config.files],
                "last_error": self.last_error,
            },
            "server": {"host": self.spec.server.host, "port": self.spec.server.port},
            "kernels": kernel_report(self.spec.kernels.model_dump()),
            "models": [e.to_data(default=name == self.spec.default_model.name)
                       for name, e in self.models.items()],
        }


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("omlx")
    except PackageNotFoundError:
        return "0+unknown"
