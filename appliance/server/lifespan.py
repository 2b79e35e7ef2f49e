"""Startup and shutdown of the appliance behind the server, each one function read top to
bottom: the order lives here and nowhere else."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from appliance.reconcile.apply import Reconciler
from appliance.reconcile.watch import watch
from appliance.runtime import Appliance


@dataclass
class Running:
    """What startup started, for shutdown to stop."""

    appliance: Appliance
    watcher: asyncio.Task | None = None
    stop_watching: asyncio.Event = field(default_factory=asyncio.Event)


def startup(appliance: Appliance, reconciler: Reconciler, *, watch_config: bool) -> Running:
    """Returns what runs once the appliance has started; the API answers at once.

    uvicorn runs this before it binds the port (its `Server.startup`).
    """
    running = Running(appliance)
    # Load the models in the background (requests get 503 "loading" meanwhile) and
    # pre-touch the KV heap beside them.
    appliance.start()
    # Follow the config file: every saved change is reconciled live.
    if watch_config:
        running.watcher = asyncio.create_task(watch(reconciler, running.stop_watching))
    return running


async def shutdown(running: Running) -> None:
    """Stops everything startup started, in order; returns when the cache is on disk.

    By the time this runs, uvicorn (its `Server.shutdown`, on SIGTERM or SIGINT) has
    stopped accepting connections, given open streams `server.drain_timeout_s` to finish
    and cancelled the rest. After it returns, `omlx serve` exits with status 0
    (`runner.Server.handle_exit`).
    """
    appliance = running.appliance
    # 1. Stop following the config: no apply may load a model or open a socket from now on.
    running.stop_watching.set()
    if running.watcher is not None:
        await running.watcher
    # 2. Stop every engine: new requests are refused; what is still running had its drain
    #    above and is cancelled.
    await asyncio.to_thread(appliance.stop_engines, drain_s=0)
    # 3. Drop the SSD prefetches not started yet: nothing will restore them.
    appliance.cancel_prefetches()
    # 4. Write the blocks still queued for the SSD (at most 30 s), then close the store.
    await asyncio.to_thread(appliance.close_store, flush_s=30)


def lifespan(appliance: Appliance, reconciler: Reconciler, *, watch_config: bool):
    """Returns the app's lifespan: `startup` before serving, `shutdown` after."""

    @contextlib.asynccontextmanager
    async def run(app) -> AsyncIterator[None]:
        running = startup(appliance, reconciler, watch_config=watch_config)
        yield
        await shutdown(running)

    return run
