"""orjson for every JSON body and SSE event the server writes."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse as _StarletteJSONResponse


class JSONResponse(_StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def sse(data: Any) -> bytes:
    """Returns one server-sent event carrying `data` as JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def sse_typed(data: dict) -> bytes:
    """Returns one server-sent event named after its data's `type`, as the Anthropic and
    Responses APIs frame them."""
    return b"event: " + data["type"].encode() + b"\n" + sse(data)


SSE_DONE = b"data: [DONE]\n\n"
