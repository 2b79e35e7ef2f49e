"""The ASGI middleware in front of every route: who is calling, whether they may, and the
limits on what they send; the request's tenant for the cache.

The applied spec is read on every request, so key and limit changes apply live.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.cache.model_cache import REQUEST_TENANT
from appliance.server.auth import identify, presented_key, refusal, route_kind, tenant_of
from appliance.server.errors import ApiError, render
from appliance.server.limits import REQUEST_LIMITS, KeyGate, Refused, body_too_large

log = logging.getLogger("omlx.server")


class Guard:
    def __init__(self, app: ASGIApp):
        self.app = app
        self.gate = KeyGate()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        spec = scope["app"].state.appliance.spec
        request = Request(scope)
        kind = route_kind(scope["path"])
        caller = identify(spec.server, presented_key(request.headers))
        why = refusal(kind, caller, spec.server)
        if why is not None:
            headers = {"WWW-Authenticate": "Bearer"}
            error = ApiError(401, why, type="authentication_error", code="invalid_api_key", headers=headers)
            return await render(request, error)(scope, receive, send)
        limit = spec.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return await render(request, body_too_large(limit))(scope, receive, send)
        tenant, limits = REQUEST_TENANT.set(tenant_of(caller)), REQUEST_LIMITS.set(spec.limits)
        try:
            if kind != "api":
                return await self.app(scope, capped(receive, limit), send)
            name = caller.name if caller is not None else "anonymous"
            try:
                await self.gate.acquire(name, spec.limits)
            except Refused as e:
                error = ApiError(429, str(e), type="rate_limit_error", code="too_many_requests",
                                 headers={"Retry-After": "1"})
                return await render(request, error)(scope, receive, send)
            try:
                await self.app(scope, capped(receive, limit), send)
            finally:
                self.gate.release(name)
        finally:
            REQUEST_TENANT.reset(tenant)
            REQUEST_LIMITS.reset(limits)


def capped(receive: Receive, limit: int) -> Receive:
    """Returns `receive`, raising a 413 ApiError once the body passes `limit` bytes (a
    chunked body announces no length)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise body_too_large(limit)
        return message

    return wrapped
