"""Who is calling: the API key or admin key a request presents, compared in constant time.

With `[[server.api_keys]]` configured every API request needs a key, and the key decides
its tenant (whose KV it reads and writes); with `admin_key` set the admin API, the
metrics and the dashboard's data need that key. Keys are never logged, never shown.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Literal

from starlette.datastructures import Headers

from appliance.cache.keys import DEFAULT_TENANT
from appliance.spec import ServerSpec

RouteKind = Literal["public", "api", "admin"]
PUBLIC_PATHS = ("/health", "/openapi.json")
ADMIN_PREFIXES = ("/admin/", "/metrics")


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: `name` is for limits and logs (never the key itself)."""

    name: str
    tenant: str
    admin: bool


ANONYMOUS = Caller("anonymous", DEFAULT_TENANT, admin=False)
# The API's paths without the /v1 prefix (clients given a base URL without /v1 use them).
API_ROOTS = {"models", "chat", "completions", "messages", "responses", "embeddings"}


def route_kind(path: str) -> RouteKind:
    """Returns what guards a path: the admin key, an API key, or nothing (health, the
    OpenAPI schema, the dashboard's page and assets, unknown paths that end in 404)."""
    if path.startswith(ADMIN_PREFIXES):
        return "admin"
    if path.startswith("/v1/") or path.lstrip("/").split("/")[0] in API_ROOTS:
        return "api"
    return "public"


def presented_key(headers: Headers) -> str | None:
    """Returns the key a request presents: `Authorization: Bearer` (OpenAI) or `x-api-key`
    (Anthropic)."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


def identify(server: ServerSpec, key: str | None) -> Caller | None:
    """Returns who presents `key`: an API key's holder (with its tenant), the admin,
    anonymous (no key), or None for a key that matches none configured.

    Every configured key is compared, in constant time, whatever matched before.
    """
    if key is None:
        return ANONYMOUS
    given = key.encode()
    found: Caller | None = None
    for i, api_key in enumerate(server.api_keys):
        if hmac.compare_digest(given, api_key.secret.encode()):
            found = Caller(f"key-{i}", api_key.tenant, admin=False)
    admin_secret = server.admin_secret
    if admin_secret is not None and hmac.compare_digest(given, admin_secret.encode()):
        found = Caller("admin", DEFAULT_TENANT, admin=True)
    return found


def refusal(kind: RouteKind, caller: Caller | None, server: ServerSpec) -> str | None:
    """Returns why `caller` may not use a route of `kind`, or None when it may."""
    if kind == "admin" and server.admin_secret is not None and not (caller and caller.admin):
        return "this endpoint needs the admin key (Authorization: Bearer <admin_key>)"
    if kind == "api" and server.api_keys:
        if caller is None:
            return "invalid API key"
        if caller is ANONYMOUS:
            return "an API key is required (Authorization: Bearer <key>, or x-api-key: <key>)"
    return None


def tenant_of(caller: Caller | None) -> str:
    """Returns whose KV a request reads and writes (the default tenant without a valid key,
    which only an open API lets through)."""
    return caller.tenant if caller is not None else DEFAULT_TENANT
