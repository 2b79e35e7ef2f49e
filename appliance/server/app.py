"""The ASGI application: route tables from each API module, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette

from appliance.reconcile.apply import Reconciler
from appliance.reconcile.watch import watch
from appliance.runtime import Appliance
from appliance.server import admin, openai
from appliance.server.errors import EXCEPTION_HANDLERS


def build_app(appliance: Appliance, *, rebind: Callable[[str, int], Awaitable[Any]] | None = None,
              watch_config: bool = True) -> Starlette:
    """Returns the Starlette app serving `appliance`.

    At startup models load in the background and the config watcher starts; every saved
    change of the config is then reconciled live.
    """
    reconciler = Reconciler(appliance, rebind=rebind)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        appliance.start()
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(reconciler, stop)) if watch_config else None
        yield
        stop.set()
        if watcher is not None:
            await watcher
        # uvicorn has already let open streams drain for drain_timeout_s.
        await asyncio.to_thread(appliance.stop, drain_s=0)

    app = Starlette(
        routes=[*openai.ROUTES, *admin.ROUTES],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.appliance = appliance
    app.state.reconciler = reconciler
    return app
