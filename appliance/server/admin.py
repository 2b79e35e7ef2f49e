"""Health and the admin API (status now; config, cache and models follow in later issues)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.server.json import JSONResponse


async def health(request: Request) -> Response:
    """200 once every model serves; 503 while any is loading ("starting") or failed ("degraded")."""
    app = request.app.state.appliance
    states = {e.spec.name: e.state for e in app.models.values()}
    if app.ready:
        return JSONResponse({"status": "ok", "models": states})
    summary = "degraded" if "failed" in states.values() else "starting"
    return JSONResponse({"status": summary, "models": states}, status_code=503)


async def status(request: Request) -> Response:
    return JSONResponse(request.app.state.appliance.status())


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/admin/api/status", status, methods=["GET"]),
]
