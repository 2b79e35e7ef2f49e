"""The API's OpenAPI 3.1 schema, built from the request models the routes validate with.

Served at GET /openapi.json, for clients and for property-based fuzzing
(tests/server/test_fuzz.py). Request bodies come from the same pydantic models that parse
them, so the schema cannot drift from what the server accepts. Every /v1 path is also
served without /v1 (and with it twice); the schema lists the /v1 paths.
"""

from __future__ import annotations

from functools import cache

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.runtime import version
from appliance.server.admin import ArchiveParams, ClearParams
from appliance.server.anthropic import CountParams, MessagesParams
from appliance.server.json import JSONResponse
from appliance.server.params import ChatParams, CompletionParams
from appliance.server.responses import ResponsesParams

# (method, path, request body model or None, summary, security)
OPERATIONS: tuple[tuple[str, str, type[BaseModel] | None, str, str | None], ...] = (
    ("get", "/v1/models", None, "The configured models and their states", "api"),
    ("post", "/v1/chat/completions", ChatParams, "OpenAI chat completion (streaming with stream: true)", "api"),
    ("post", "/v1/completions", CompletionParams, "OpenAI text completion", "api"),
    ("post", "/v1/messages", MessagesParams, "Anthropic Messages (streaming with stream: true)", "api"),
    ("post", "/v1/messages/count_tokens", CountParams, "Anthropic token count of a Messages request", "api"),
    ("post", "/v1/responses", ResponsesParams, "OpenAI Responses (streaming with stream: true)", "api"),
    ("get", "/health", None, "Readiness: 200 once every model is ready, else 503", None),
    ("get", "/admin/api/status", None, "Models, config and recent requests", "admin"),
    ("get", "/admin/api/config", None, "The applied spec (keys masked)", "admin"),
    ("get", "/admin/api/cache", None, "Per-tier and per-model cache figures", "admin"),
    ("post", "/admin/api/cache/clear", ClearParams, "Remove cached blocks", "admin"),
    ("post", "/admin/api/cache/export", ArchiveParams, "Write a tenant's SSD blocks to an archive", "admin"),
    ("post", "/admin/api/cache/import", ArchiveParams, "Verify and add an archive's blocks", "admin"),
)
ERROR = {"type": "object", "properties": {"error": {"type": "object"}}}


@cache
def schema() -> dict:
    """Returns the OpenAPI document (built once: the models do not change at run time)."""
    models = sorted({m for _, _, m, _, _ in OPERATIONS if m is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models],
                                    ref_template="#/components/schemas/{model}")
    paths: dict[str, dict] = {}
    for method, path, model, summary, security in OPERATIONS:
        operation: dict = {
            "summary": summary,
            "operationId": f"{method}_{path.strip('/').replace('/', '_')}",
            "responses": {
                "200": {"description": "success: JSON, or server-sent events when streaming"},
                "4XX": {"description": "a bad request, in the API's error shape",
                        "content": {"application/json": {"schema": ERROR}}},
                "503": {"description": "not ready, shutting down, or cut off"},
            },
        }
        if model is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(model, "validation")]}}}
        if security is not None:
            operation["security"] = [{security: []}]
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "omlx", "version": version(),
                 "description": "OpenAI- and Anthropic-compatible LLM serving with a persistent, tiered KV cache."},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                "api": {"type": "http", "scheme": "bearer",
                        "description": "an API key (or x-api-key), when keys are configured"},
                "admin": {"type": "http", "scheme": "bearer", "description": "the admin key, when one is configured"},
            },
        },
    }


async def openapi_json(request: Request) -> Response:
    return JSONResponse(schema())


ROUTES = [Route("/openapi.json", openapi_json, methods=["GET"])]
