"""OpenAI's Responses API (what Codex speaks): POST /v1/responses, whole or streamed.

The body (`instructions` and `input` items) becomes one `Turn`; the turn's events become
output items (`reasoning`, `message`, `function_call`), whole or streamed as typed events
with a `sequence_number`. Nothing is stored (`store` is accepted, and no response can be
fetched or continued later); tool types this server cannot run (`web_search`, `custom`,
...) are accepted and not offered to the model, and functions inside a `namespace` tool
(Codex's MCP servers) are offered under one flat name.
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
from appliance.engine.request import SamplingParams
from appliance.server.errors import ApiError, bad_request
from appliance.server.json import JSONResponse, sse_typed
from appliance.server.openai import appliance_of
from appliance.server.params import Lenient, parse_body, temperature
from appliance.server.turns import KEEPALIVE_S, PromptTooLong, TurnRun, submit_turn, with_heartbeat
from appliance.spec import ModelSpec


class ResponsesParams(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: the model's default_temperature
    top_p: float = Field(1.0, gt=0, le=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None  # a routing hint upstream; omlx's cache needs none
    metadata: dict[str, Any] | None = None
    stream: bool = False

    def sampling(self, model: ModelSpec) -> SamplingParams:
        return SamplingParams(temperature=temperature(self.temperature, model), top_p=self.top_p)

    def output_format(self) -> OutputFormat:
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type") == "json_schema":
            return OutputFormat(kind="json_schema", schema=fmt.get("schema") or {}, name=fmt.get("name"))
        if fmt.get("type") == "json_object":
            return OutputFormat(kind="json_object")
        return TEXT


class Functions:
    """The functions offered to the model, by the flat name the model sees: a function
    inside a namespace is `<namespace><name>` (Codex's namespaces end in `__`)."""

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools: list[Tool] = []
        self.origin: dict[str, tuple[str | None, str]] = {}  # flat name -> (namespace, name)
        for tool in tools:
            if tool.get("type") == "function":
                self._add(None, tool)
            elif tool.get("type") == "namespace":
                for inner in tool.get("tools") or ():
                    if inner.get("type", "function") == "function":
                        self._add(tool.get("name") or "", inner)

    def _add(self, namespace: str | None, tool: dict[str, Any]) -> None:
        name = flat_name(namespace, tool.get("name") or "")
        self.origin[name] = (namespace, tool.get("name") or "")
        self.tools.append(Tool(name=name, description=tool.get("description") or "",
                               parameters=tool.get("parameters") or {"type": "object", "properties": {}}))

    def item_fields(self, flat: str) -> dict:
        """Returns a function_call item's `name` (and `namespace`) for the name the model used."""
        namespace, name = self.origin.get(flat, (None, flat))
        return {"name": name, **({"namespace": namespace} if namespace else {})}


def flat_name(namespace: str | None, name: str) -> str:
    if not namespace:
        return name
    return namespace + name if namespace.endswith("_") else f"{namespace}__{name}"


def tool_choice(choice: str | dict[str, Any]) -> str:
    if isinstance(choice, str):
        return choice if choice in ("auto", "none", "required") else "auto"
    if choice.get("type") == "function" and choice.get("name"):
        return choice["name"]
    return "auto"


def content_text(content: Any) -> str:
    """Returns the text of a string or of content parts (input_text, output_text, ...)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if isinstance(part, str):
            parts.append(part)
        elif part.get("type") in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(part.get("text") or "")
        elif part.get("type") in ("input_image", "input_file"):
            parts.append(f"[{part['type'].removeprefix('input_')} omitted]")
        elif part.get("type") == "refusal":
            parts.append(part.get("refusal") or "")
    return "\n\n".join(p for p in parts if p)


class Conversation:
    """Builds chat messages from input items; consecutive assistant items (reasoning, text,
    function calls) make one assistant message."""

    def __init__(self):
        self.messages: list[Message] = []
        self._text = ""
        self._reasoning = ""
        self._calls: list[ToolCall] = []
        self.names: dict[str, str] = {}  # call id -> function name

    def add(self, item: dict[str, Any], where: str) -> None:
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                if self._calls:
                    self._flush()
                self._text += content_text(item.get("content"))
                return
            if role not in ("user", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer (got {role!r})",
                                  param=f"{where}.role")
            self._flush()
            self.messages.append(Message(role="user" if role == "user" else "system",
                                         content=content_text(item.get("content"))))
        elif kind == "reasoning":
            if self._text or self._calls:
                self._flush()
            self._reasoning += content_text(item.get("content")) or content_text(item.get("summary"))
        elif kind in ("function_call", "custom_tool_call"):
            name = flat_name(item.get("namespace"), item.get("name") or "")
            arguments = item.get("arguments") if kind == "function_call" else orjson.dumps(
                {"input": item.get("input") or ""}).decode()
            call_id = item.get("call_id") or item.get("id") or ""
            self.names[call_id] = name
            self._calls.append(ToolCall(id=call_id, name=name, arguments=arguments or "{}"))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._flush()
            call_id = item.get("call_id") or ""
            self.messages.append(Message(role="tool", content=content_text(item.get("output")),
                                         tool_call_id=call_id, name=self.names.get(call_id)))
        # Other items (web_search_call, item_reference, ...) carry nothing to render.

    def done(self) -> tuple[Message, ...]:
        self._flush()
        return tuple(self.messages)

    def _flush(self) -> None:
        if self._text or self._reasoning or self._calls:
            self.messages.append(Message(role="assistant", content=self._text, tool_calls=tuple(self._calls),
                                         reasoning=self._reasoning or None))
        self._text, self._reasoning, self._calls = "", "", []


def turn_of(params: ResponsesParams, functions: Functions) -> Turn:
    """Returns the request as an API-neutral turn; a malformed item is a 400 naming it."""
    conversation = Conversation()
    if params.instructions:
        conversation.messages.append(Message(role="system", content=params.instructions))
    if isinstance(params.input, str):
        conversation.add({"type": "message", "role": "user", "content": params.input}, "input")
    else:
        for i, item in enumerate(params.input):
            conversation.add(item, f"input[{i}]")
    effort = (params.reasoning or {}).get("effort")
    return Turn(messages=conversation.done(), tools=tuple(functions.tools),
                tool_choice=tool_choice(params.tool_choice), parallel_tool_calls=params.parallel_tool_calls,
                output_format=params.output_format(), thinking=False if effort == "none" else None)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Folds a turn's events into output items, and returns the stream events that carry
    them, numbered; one writer serves both the streamed and the whole response."""

    def __init__(self, params: ResponsesParams, model: str, run: TurnRun, functions: Functions):
        self.params = params
        self.model = model
        self.run = run
        self.functions = functions
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self._open: int | None = None  # index of the item still receiving deltas
        self._calls: dict[int, int] = {}  # tool call index -> output index
        self._sequence = 0

    def response(self, status: str, *, error: dict | None = None) -> dict:
        p = self.params
        done = status in ("completed", "incomplete")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if done else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": p.instructions, "max_output_tokens": p.max_output_tokens, "model": self.model,
            "output": self.output, "parallel_tool_calls": p.parallel_tool_calls, "previous_response_id": None,
            "prompt_cache_key": p.prompt_cache_key, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": self.run.request.sampling.temperature,
            "text": p.text or {"format": {"type": "text"}},
            "tool_choice": p.tool_choice, "tools": p.tools, "top_p": p.top_p, "truncation": "disabled",
            "usage": self.usage() if done else None, "metadata": p.metadata or {},
        }

    def usage(self) -> dict:
        stats = self.run.stats
        thought = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")
        reasoning = min(len(self.run.loaded.encode(thought)), stats.completion_tokens) if thought else 0
        return {"input_tokens": stats.prompt_tokens,
                "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": stats.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": stats.prompt_tokens + stats.completion_tokens}

    def event(self, type: str, **fields: Any) -> dict:
        data = {"type": type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return data

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def on(self, event: Event) -> list[dict]:
        if isinstance(event, TextDelta):
            return self._text("message", "output_text", event.text)
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", "reasoning_text", event.text)
        if isinstance(event, ToolCallStart):
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                    "call_id": event.id, **self.functions.item_fields(event.name)}
            out = self._close() + self._begin(item)
            self._calls[event.index] = self._open
            return out
        if isinstance(event, ToolCallDelta) and event.index in self._calls:
            at = self._calls[event.index]
            self.output[at]["arguments"] += event.arguments
            return [self.event("response.function_call_arguments.delta", item_id=self.output[at]["id"],
                               output_index=at, delta=event.arguments)]
        if isinstance(event, ToolCallEnd) and event.index in self._calls:
            self.output[self._calls[event.index]]["arguments"] = event.call.arguments
            return self._close() if self._open == self._calls[event.index] else []
        return []

    def finish(self) -> list[dict]:
        out = self._close()
        status = self.status()
        return [*out, self.event(f"response.{status}", response=self.response(status))]

    def failed(self, error: ApiError) -> list[dict]:
        self._close()
        failure = {"code": "server_error", "message": error.message}
        return [self.event("response.failed", response=self.response("failed", error=failure))]

    def whole(self) -> dict:
        self._close()
        return self.response(self.status())

    def status(self) -> str:
        return "incomplete" if self.run.stop_reason == "length" else "completed"

    def _text(self, kind: str, part_type: str, text: str) -> list[dict]:
        if not text:
            return []
        out = []
        if self._open is None or self.output[self._open]["type"] != kind:
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": [], "encrypted_content": None}
            out = self._close() + self._begin(item)
            part = {"type": part_type, "text": ""}
            if kind == "message":
                part.update(annotations=[], logprobs=[])
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                  content_index=0, part=dict(part)))
        item = self.output[self._open]
        item["content"][0]["text"] += text
        delta = {"logprobs": []} if kind == "message" else {}
        return [*out, self.event(f"response.{part_type}.delta", item_id=item["id"], output_index=self._open,
                                 content_index=0, delta=text, **delta)]

    def _begin(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = len(self.output) - 1
        snapshot = {**item, "content": []} if "content" in item else dict(item)  # parts come next
        return [self.event("response.output_item.added", output_index=self._open, item=snapshot)]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        at, self._open = self._open, None
        item = self.output[at]
        truncated = self.run.finished is not None and self.run.stop_reason == "length"
        item["status"] = "incomplete" if truncated else "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = part["type"]
            done = {"logprobs": []} if kind == "output_text" else {}
            out.append(self.event(f"response.{kind}.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=part["text"], **done))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=dict(part)))
        out.append(self.event("response.output_item.done", output_index=at, item=dict(item)))
        return out


def too_long(e: PromptTooLong) -> ApiError:
    return bad_request(
        f"Your input exceeds the context window of this model: {e.prompt_tokens} tokens > "
        f"{e.max_prompt_tokens} maximum. Please adjust your input and try again.",
        param="input", code="context_length_exceeded")


async def create_response(request: Request) -> Response:
    params: ResponsesParams = parse_body(await request.body(), ResponsesParams)
    if params.previous_response_id:
        raise bad_request("previous_response_id is not supported: omlx stores no responses, "
                          "send the whole conversation in `input`", param="previous_response_id")
    engine = await appliance_of(request).engine(params.model)
    functions = Functions(params.tools)
    try:
        # No max_output_tokens: as upstream, the answer may fill the context. Codex sends none,
        # and it takes an answer cut off by a limit it never set (`incomplete`) for a failure.
        run = submit_turn(engine, turn_of(params, functions), max_tokens=params.max_output_tokens,
                          sampling=params.sampling(engine.loaded.spec), fill_context=True)
    except PromptTooLong as e:
        raise too_long(e) from None
    writer = ResponseWriter(params, engine.loaded.name, run, functions)
    if params.stream:
        return StreamingResponse(stream(writer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    for event in await run.collect(request):
        writer.on(event)
    if run.failed is not None:
        raise run.failed
    return JSONResponse(writer.whole())


async def stream(writer: ResponseWriter) -> AsyncIterator[bytes]:
    """Yields the numbered SSE events of one response, ending with response.completed,
    response.incomplete (max_output_tokens reached) or response.failed."""
    for data in writer.start():
        yield sse_typed(data)
    run = writer.run
    async for event in with_heartbeat(run.events(), KEEPALIVE_S):
        if event is None:  # a long prefill: say the response is still in progress
            out = [writer.event("response.in_progress", response=writer.response("in_progress"))]
        else:
            out = writer.on(event)
        for data in out:
            yield sse_typed(data)
    closing = writer.failed(run.failed) if run.failed is not None else writer.finish()
    for data in closing:
        yield sse_typed(data)


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
]
