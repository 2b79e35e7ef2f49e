"""The ASGI application: route tables from each API module, errors in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from appliance.reconcile.apply import Reconciler
from appliance.runtime import Appliance
from appliance.server import admin, anthropic, config_edits, dashboard, metrics, openai, openapi, responses
from appliance.server.errors import EXCEPTION_HANDLERS
from appliance.server.guard import Guard
from appliance.server.lifespan import lifespan


def build_app(appliance: Appliance, *, rebind: Callable[[str, int], Awaitable[Any]] | None = None,
              watch_config: bool = True) -> Starlette:
    """Returns the Starlette app serving `appliance`.

    Its lifespan is `lifespan.startup` (models load in the background, the config watcher
    starts) and `lifespan.shutdown`.
    """
    reconciler = Reconciler(appliance, rebind=rebind)
    counters = metrics.Metrics(appliance, reconciler)
    appliance.on_request_finished = counters.observe

    api = [*openai.ROUTES, *anthropic.ROUTES, *responses.ROUTES]
    app = Starlette(
        routes=[*api, *aliases(api), *admin.ROUTES, *openapi.ROUTES, *config_edits.ROUTES,
                *metrics.ROUTES, *dashboard.ROUTES],
        exception_handlers=EXCEPTION_HANDLERS,
        # Counted first, so refused requests count too; then keys, tenants, limits.
        middleware=[Middleware(metrics.CountRequests), Middleware(Guard)],
        lifespan=lifespan(appliance, reconciler, watch_config=watch_config),
    )
    app.state.appliance = appliance
    app.state.reconciler = reconciler
    app.state.metrics = counters
    return app


def aliases(routes: list[Route]) -> list[Route]:
    """Returns each /v1 route also without /v1 and with it twice. Users give base URLs with
    and without /v1, and SDKs differ on adding it: OpenAI's appends `/chat/completions` to
    the base URL, Anthropic's `/v1/messages`."""
    return [Route(path, r.endpoint, methods=sorted(r.methods - {"HEAD"}))
            for r in routes if r.path.startswith("/v1/")
            for path in (r.path.removeprefix("/v1"), "/v1" + r.path)]
