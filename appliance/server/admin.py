"""Health and the admin API (status now; config, cache and models follow in later issues)."""

from __future__ import annotations

import asyncio

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.server.errors import ApiError
from appliance.server.json import JSONResponse
from appliance.server.params import parse_body


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


async def cache(request: Request) -> Response:
    """Per tier: bytes, budget, blocks, hits, misses by reason, evictions, restore GB/s."""
    return JSONResponse(request.app.state.appliance.cache_stats())


async def clear_cache(request: Request) -> Response:
    """Clears one model's blocks (`{"model": name}`) or all (empty body)."""
    body = await request.body()
    params = parse_body(body, ClearParams) if body.strip() else ClearParams()
    app = request.app.state.appliance
    removed = await asyncio.to_thread(app.clear_cache, params.model)
    return JSONResponse({"removed_blocks": removed, "model": params.model})


class ClearParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class ArchiveParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    model: str | None = None


async def export_cache(request: Request) -> Response:
    """Writes a model's SSD blocks to an archive at `path` on this machine."""
    params = parse_body(await request.body(), ArchiveParams)
    app = request.app.state.appliance
    count = await archive_call(app.export_cache, params.model, Path(params.path))
    return JSONResponse({"exported_blocks": count, "path": params.path})


async def import_cache(request: Request) -> Response:
    """Verifies and adds the blocks of the archive at `path`."""
    params = parse_body(await request.body(), ArchiveParams)
    app = request.app.state.appliance
    count = await archive_call(app.import_cache, Path(params.path))
    return JSONResponse({"imported_blocks": count, "path": params.path})


async def archive_call(fn, *args):
    try:
        return await asyncio.to_thread(fn, *args)
    except (OSError, ValueError) as e:  # a bad path or a file that is no archive
        raise ApiError(400, f"cache archive: {e}", param="path") from None


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/admin/api/status", status, methods=["GET"]),
    Route("/admin/api/cache", cache, methods=["GET"]),
    Route("/admin/api/cache/clear", clear_cache, methods=["POST"]),
    Route("/admin/api/cache/export", export_cache, methods=["POST"]),
    Route("/admin/api/cache/import", import_cache, methods=["POST"]),
]
