"""Health and the admin API (status now; config, cache and models follow in later issues)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.cache.keys import DEFAULT_TENANT
from appliance.config import ConfigError, restore_secrets, write_config
from appliance.reconcile.watch import reconcile_now
from appliance.server.errors import ApiError
from appliance.server.json import JSONResponse
from appliance.server.params import parse_body
from appliance.spec import TENANT_PATTERN


async def health(request: Request) -> Response:
    """200 once every model serves; 503 while any is loading ("starting") or failed ("degraded")."""
    app = request.app.state.appliance
    states = {e.spec.name: e.state for e in app.models.values()}
    if app.ready:
        return JSONResponse({"status": "ok", "models": states})
    values = set(states.values())
    summary = "degraded" if "failed" in values else "stopping" if values & {"stopping", "stopped"} else "starting"
    return JSONResponse({"status": summary, "models": states}, status_code=503)


async def status(request: Request) -> Response:
    """The appliance's status, plus whether the SSD tier stores and why not (full, unwritable)."""
    app = request.app.state.appliance
    ssd = app.store.stats()["ssd"] if app.store is not None else {}
    cache = {"ssd": {"disabled": bool(ssd.get("disabled")), "disabled_reason": ssd.get("disabled_reason")}}
    return JSONResponse({**app.status(), "cache": cache})


async def get_config(request: Request) -> Response:
    """The applied spec (resolved, as JSON) and its hash."""
    app = request.app.state.appliance
    return JSONResponse({"hash": app.spec.hash, "path": str(app.config.path), "spec": app.spec.to_data(),
                         "last_error": app.last_error})


async def put_config(request: Request) -> Response:
    """Validates a new spec, writes it to the config file atomically, and applies it.

    The file stays the single source of truth: what is written is what the watcher
    would apply; the answer says whether it was applied.
    """
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object: the spec's tables", code="invalid_json")
    app = request.app.state.appliance
    try:
        await asyncio.to_thread(write_config, app.config.path, restore_secrets(data, app.spec))
    except ConfigError as e:
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                       "code": "invalid_config", "issues": e.to_data()["issues"]}},
                            status_code=400)
    outcome = await reconcile_now(request.app.state.reconciler)
    status = 200 if outcome is not None and outcome.applied else 409
    body = {"applied": bool(outcome and outcome.applied), "hash": app.spec.hash,
            "actions": list(outcome.actions) if outcome else [], "last_error": app.last_error}
    return JSONResponse(body, status_code=status)


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
    tenant: str = Field(DEFAULT_TENANT, pattern=TENANT_PATTERN)  # export: whose blocks


async def export_cache(request: Request) -> Response:
    """Writes a model's SSD blocks to an archive at `path` on this machine."""
    params = parse_body(await request.body(), ArchiveParams)
    app = request.app.state.appliance
    count = await archive_call(lambda: app.export_cache(params.model, Path(params.path), tenant=params.tenant))
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
    Route("/admin/api/config", get_config, methods=["GET"]),
    Route("/admin/api/config", put_config, methods=["PUT"]),
    Route("/admin/api/cache", cache, methods=["GET"]),
    Route("/admin/api/cache/clear", clear_cache, methods=["POST"]),
    Route("/admin/api/cache/export", export_cache, methods=["POST"]),
    Route("/admin/api/cache/import", import_cache, methods=["POST"]),
]
