"""The ASGI application: route tables from each API module, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from appliance.runtime import Appliance
from appliance.server import admin, openai
from appliance.server.errors import EXCEPTION_HANDLERS


def build_app(appliance: Appliance) -> Starlette:
    """Returns the Starlette app serving `appliance`: models load in the background at startup."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        appliance.start()
        yield
        # uvicorn has already let open streams drain for drain_timeout_s.
        await asyncio.to_thread(appliance.stop, drain_s=0)

    app = Starlette(
        routes=[*openai.ROUTES, *admin.ROUTES],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.appliance = appliance
    return app
