"""Anthropic's Messages API (what Claude Code speaks): /v1/messages and its token count.

The body becomes one `Turn`; the turn's events become content blocks (`text`,
`thinking`, `tool_use`), whole or streamed as Anthropic's SSE events. Fields this server
has no use for (`metadata`, `cache_control`, `context_management`, betas) are accepted
and ignored, never refused: agents send them on every request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from appliance.cache.model_cache import request_tenant
from appliance.chat.turn import (
    TEXT,
    Event,
    Message,
    OutputFormat,
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Turn,
)
from appliance.engine.request import RequestStats, SamplingParams
from appliance.server.errors import ApiError, bad_request
from appliance.server.json import JSONResponse, sse_typed
from appliance.server.openai import appliance_of
from appliance.server.params import Lenient, parse_body, temperature
from appliance.server.turns import (
    HEARTBEAT_S,
    KEEPALIVE_S,
    PromptTooLong,
    TurnRun,
    prepare_turn,
    submit_turn,
    with_heartbeat,
)
from appliance.spec import ModelSpec

# Claude Code's first system block: it changes on every request (cch=...), so rendered
# into the prompt it would end every cached prefix a few tokens in.
BILLING_HEADER = "x-anthropic-billing-header:"

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence",
                "tool_calls": "tool_use"}


class CountParams(Lenient):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None

    def turn(self) -> Turn:
        """Returns the request as an API-neutral turn; a malformed message is a 400 naming it."""
        messages = [Message(role="system", content=system)] if (system := system_text(self.system)) else []
        names: dict[str, str] = {}  # tool_use id -> tool name, for the results
        for i, m in enumerate(self.messages):
            messages.extend(convert(m, names, f"messages[{i}]"))
        choice = self.tool_choice or {}
        return Turn(
            messages=tuple(messages),
            tools=tuple(tool_of(t) for t in self.tools if is_function_tool(t)),
            tool_choice=tool_choice(choice),
            parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
            output_format=self.output(),
            thinking={"enabled": True, "disabled": False}.get((self.thinking or {}).get("type")),
        )

    def output(self) -> OutputFormat:
        fmt = (self.output_config or {}).get("format") or self.output_format
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            return OutputFormat(kind="json_schema", schema=fmt["schema"])
        return TEXT


class MessagesParams(CountParams):
    max_tokens: int | None = Field(None, ge=1)  # required by Anthropic; here the model's default
    stop_sequences: list[str] = Field([], max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)  # None: the model's default_temperature
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stream: bool = False

    def sampling(self, model: ModelSpec) -> SamplingParams:
        return SamplingParams(temperature=temperature(self.temperature, model), top_p=self.top_p, top_k=self.top_k)


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """Returns the system prompt's text, without Claude Code's per-request billing header."""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    texts = [b.get("text") or "" for b in system or () if b.get("type") == "text"]
    return "\n\n".join(t for t in texts if t and not t.startswith(BILLING_HEADER))


def convert(m: dict[str, Any], names: dict[str, str], where: str) -> list[Message]:
    """Returns the chat messages of one Anthropic message: tool results become `tool` messages."""
    role, content = m.get("role"), m.get("content", "")
    if role not in ("user", "assistant", "system"):
        raise bad_request(f"{where}.role must be user or assistant (got {role!r})", param=f"{where}.role")
    if role == "system":
        return [Message(role="system", content=system_text(content))]
    if isinstance(content, str):
        return [Message(role=role, content=content)]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", param=f"{where}.content")
    if role == "assistant":
        return [assistant_message(content, names)]
    results, texts = [], []
    for block in content:
        if block.get("type") == "tool_result":
            call_id = block.get("tool_use_id", "")
            text = block_text(block.get("content", ""))
            results.append(Message(role="tool", content=("Error: " + text) if block.get("is_error") else text,
                                   tool_call_id=call_id, name=names.get(call_id)))
        else:
            texts.append(block_text([block]))
    user = [Message(role="user", content="\n\n".join(t for t in texts if t))] if any(texts) else []
    return results + user


def assistant_message(content: list[dict[str, Any]], names: dict[str, str]) -> Message:
    texts, thoughts, calls = [], [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "thinking":  # echoed back, often with an empty signature: kept as reasoning
            thoughts.append(block.get("thinking") or "")
        elif kind == "tool_use":
            call = ToolCall(id=block.get("id", ""), name=block.get("name", ""),
                            arguments=orjson.dumps(block.get("input") or {}).decode())
            names[call.id] = call.name
            calls.append(call)
    return Message(role="assistant", content="".join(texts), tool_calls=tuple(calls),
                   reasoning="".join(thoughts) or None)


def block_text(content: str | list[dict[str, Any]]) -> str:
    """Returns the text of a string or of content blocks; images and documents leave a marker."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text") or "")
        elif kind in ("image", "document"):
            parts.append(f"[{kind} omitted]")
    return "\n\n".join(p for p in parts if p)


def is_function_tool(tool: dict[str, Any]) -> bool:
    """Client tools with a schema; Anthropic's own server tools (web search, ...) have none."""
    return tool.get("type") in (None, "custom") and "name" in tool


def tool_of(tool: dict[str, Any]) -> Tool:
    schema = tool.get("input_schema") or {"type": "object", "properties": {}}
    return Tool(name=tool["name"], description=tool.get("description") or "", parameters=schema)


def tool_choice(choice: dict[str, Any]) -> str:
    """Returns the neutral tool choice: `any` is OpenAI's `required`, `tool` names the function."""
    kind = choice.get("type", "auto")
    if kind == "any":
        return "required"
    if kind == "tool":
        return choice.get("name") or "required"
    return kind if kind in ("auto", "none") else "auto"


def usage(stats: RequestStats) -> dict:
    """Anthropic's meaning: `input_tokens` excludes what was read from the cache."""
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": stats.cached_tokens,
            "output_tokens": stats.completion_tokens}


class MessageWriter:
    """Folds a turn's events into content blocks, and returns the stream events that carry
    them; one writer serves both the streamed and the whole answer."""

    def __init__(self, model: str, run: TurnRun):
        self.model = model
        self.run = run
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.content: list[dict] = []
        self._open: int | None = None  # index of the block still receiving deltas
        self._tool_blocks: dict[int, int] = {}  # tool call index -> block index
        self._json: dict[int, str] = {}  # block index -> input JSON so far

    def message(self, *, stop_reason: str | None = None, stop_sequence: str | None = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage(self.run.stats)}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {**self.message(), "content": []}}, {"type": "ping"}]

    def on(self, event: Event) -> list[dict]:
        if isinstance(event, TextDelta):
            return self._text("text", "text", "text_delta", event.text)
        if isinstance(event, ReasoningDelta):
            return self._text("thinking", "thinking", "thinking_delta", event.text)
        if isinstance(event, ToolCallStart):
            out = self._close()
            out += self._begin({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
            self._tool_blocks[event.index] = self._open
            self._json[self._open] = ""
            return out
        if isinstance(event, ToolCallDelta) and event.index in self._tool_blocks:
            at = self._tool_blocks[event.index]
            self._json[at] += event.arguments
            return [{"type": "content_block_delta", "index": at,
                     "delta": {"type": "input_json_delta", "partial_json": event.arguments}}]
        if isinstance(event, ToolCallEnd) and event.index in self._tool_blocks:
            at = self._tool_blocks[event.index]
            self.content[at]["input"] = arguments(event.call.arguments)
            return self._close() if self._open == at else []
        return []

    def finish(self) -> list[dict]:
        out = self._close()
        run = self.run
        delta = {"stop_reason": STOP_REASONS[run.stop_reason], "stop_sequence": run.stop_sequence}
        return [*out, {"type": "message_delta", "delta": delta, "usage": usage(run.stats)},
                {"type": "message_stop"}]

    def whole(self) -> dict:
        self._close()
        return self.message(stop_reason=STOP_REASONS[self.run.stop_reason], stop_sequence=self.run.stop_sequence)

    def _text(self, kind: str, field: str, delta_type: str, text: str) -> list[dict]:
        if not text:
            return []
        out = []
        if self._open is None or self.content[self._open]["type"] != kind:
            # Thinking blocks carry a signature; this server signs nothing.
            signature = {"signature": ""} if kind == "thinking" else {}
            out = self._close() + self._begin({"type": kind, field: "", **signature})
        self.content[self._open][field] += text
        delta = {"type": delta_type, field: text}
        return [*out, {"type": "content_block_delta", "index": self._open, "delta": delta}]

    def _begin(self, block: dict) -> list[dict]:
        self.content.append(block)
        self._open = len(self.content) - 1
        return [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        at, self._open = self._open, None
        block = self.content[at]
        if block["type"] == "tool_use" and not block["input"] and self._json.get(at):
            block["input"] = arguments(self._json[at])  # the call never ended: keep what came
        return [{"type": "content_block_stop", "index": at}]


def arguments(text: str) -> dict:
    """Returns a tool call's arguments as an object; text that is no JSON object is kept whole."""
    try:
        value = orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


def too_long(e: PromptTooLong) -> ApiError:
    # Claude Code compacts the conversation on this exact wording.
    return bad_request(f"prompt is too long: {e.prompt_tokens} tokens > {e.max_prompt_tokens} maximum")


async def messages(request: Request) -> Response:
    params: MessagesParams = parse_body(await request.body(), MessagesParams)
    engine = await appliance_of(request).engine(params.model)
    try:
        run = submit_turn(engine, params.turn(), max_tokens=params.max_tokens,
                          sampling=params.sampling(engine.loaded.spec), stop=tuple(params.stop_sequences))
    except PromptTooLong as e:
        raise too_long(e) from None
    writer = MessageWriter(engine.loaded.name, run)
    if params.stream:
        return StreamingResponse(stream(writer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    for event in await run.collect(request):
        writer.on(event)
    if run.failed is not None:
        raise run.failed
    return JSONResponse(writer.whole())


async def stream(writer: MessageWriter) -> AsyncIterator[bytes]:
    """Yields the SSE events of one answer. message_start waits for the request's admission,
    when the cache lookup is done and `input_tokens` is known; pings keep a long prefill's
    stream alive."""
    run, started, said_at = writer.run, False, time.monotonic()
    async for event in with_heartbeat(run.events(), HEARTBEAT_S):
        out = []
        if not started and (event is not None or run.stats.admitted_at is not None):
            started = True
            out += writer.start()
        if event is not None:
            out += writer.on(event)
        elif started and time.monotonic() - said_at >= KEEPALIVE_S:
            out.append({"type": "ping"})
        if out:
            said_at = time.monotonic()
        for data in out:
            yield sse_typed(data)
    if run.failed is not None:
        yield sse_typed(run.failed.to_anthropic_data())
        return
    if not started:
        for data in writer.start():
            yield sse_typed(data)
    for data in writer.finish():
        yield sse_typed(data)


async def count_tokens(request: Request) -> Response:
    params: CountParams = parse_body(await request.body(), CountParams)
    engine = await appliance_of(request).engine(params.model)
    prepared = prepare_turn(engine.loaded, params.turn(), tenant=request_tenant(None))
    return JSONResponse({"input_tokens": len(prepared.prompt_tokens)})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
