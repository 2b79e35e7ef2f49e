"""appliance/server/responses.py: the Responses API against a real server with the real
model, driven by the official `openai` client and raw HTTP; the input-to-Turn conversion
and the event writer on their own."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import orjson
import pytest

from appliance.chat.turn import Message, ReasoningDelta, TextDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart
from appliance.engine.request import RequestStats
from appliance.server.responses import Functions, ResponsesParams, ResponseWriter, turn_of
from tests.conftest import MODEL_NAME, Server, served

CONTEXT_TOKENS = 8192
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def codex_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with the model's whole trained context, for Codex-sized prompts, sampling
    greedily where a request names no temperature (as Codex does)."""
    with served(tmp_path_factory, "responses", context_tokens=CONTEXT_TOKENS,
                model_extra="default_max_tokens = 4\ndefault_temperature = 0") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(codex_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{codex_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    """Returns the (event name, data) pairs of an SSE body."""
    out = []
    for frame in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], orjson.loads(lines["data"])))
    return out


def keepalives_dropped(events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Returns the events without the response.in_progress repeated to keep a slow stream alive."""
    return events[:2] + [(name, data) for name, data in events[2:] if name != "response.in_progress"]


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.slow
def test_response_answers_with_usage(client: openai.OpenAI):
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.model == MODEL_NAME
    assert r.id.startswith("resp_") and r.error is None and r.incomplete_details is None
    assert [item.type for item in r.output] == ["message"]
    assert "Paris" in r.output_text
    u = r.usage
    assert u.input_tokens > 5 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


@pytest.mark.slow
def test_stream_sends_every_event_numbered_in_order(codex_server: Server, client: openai.OpenAI):
    body = {"model": MODEL_NAME, "input": "What is the capital of Spain?", "instructions": "Answer in one line.",
            "max_output_tokens": 24, "temperature": 0, "stream": True}
    r = httpx.post(f"{codex_server.url}/v1/responses", json=body, timeout=300)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    events = keepalives_dropped(events)
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    added = events[2][1]["item"]
    assert added["type"] == "message" and added["status"] == "in_progress" and added["content"] == []
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert events[-4][1]["text"] == text
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == text
    assert done["usage"]["output_tokens"] > 0
    whole = client.responses.create(model=MODEL_NAME, input=body["input"], instructions=body["instructions"],
                                    max_output_tokens=24, temperature=0)
    assert whole.output_text == text
    assert whole.usage.input_tokens == done["usage"]["input_tokens"]


@pytest.mark.slow
def test_sdk_stream_accumulates_the_same_response(client: openai.OpenAI):
    whole = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=24, temperature=0)
    with client.responses.stream(model=MODEL_NAME, input=QUESTION, max_output_tokens=24, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt, just before


@pytest.mark.slow
def test_max_output_tokens_makes_the_response_incomplete(codex_server: Server, client: openai.OpenAI):
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 3, "temperature": 0, "stream": True}
    events = events_of(httpx.post(f"{codex_server.url}/v1/responses", json=body, timeout=300))
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.slow
def test_without_max_output_tokens_the_answer_may_fill_the_context(client: openai.OpenAI):
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, temperature=0)
    # The model's default_max_tokens (4 here) is not a limit the client set.
    assert r.status == "completed" and r.usage.output_tokens > 4
    assert "Paris" in r.output_text


@pytest.mark.slow
def test_a_request_without_temperature_samples_at_the_model_s_default(codex_server: Server):
    url = f"{codex_server.url}/v1/responses"
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 12}
    unsaid = [httpx.post(url, json=body, timeout=300).json() for _ in range(2)]
    greedy = httpx.post(url, json={**body, "temperature": 0}, timeout=300).json()
    assert [r["temperature"] for r in unsaid] == [0.0, 0.0]  # the model's default_temperature
    assert unsaid[0]["output"][0]["content"] == unsaid[1]["output"][0]["content"] == greedy["output"][0]["content"]
    asked = httpx.post(url, json={**body, "temperature": 0.7}, timeout=300).json()
    assert asked["temperature"] == 0.7  # a request's own wins


@pytest.mark.slow
def test_text_format_json_schema_is_accepted_and_echoed(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=64, temperature=0, text=fmt)
    assert r.status == "completed"
    assert r.text.format.type == "json_schema" and r.text.format.name == "capital"
    jsonschema.validate(orjson.loads(r.output_text), schema)


@pytest.mark.slow
def test_a_forced_function_call_comes_back_as_an_item(codex_server: Server, client: openai.OpenAI):
    tools = [CODEX_TOOLS[0], CODEX_TOOLS[5]]  # shell, and the docs MCP namespace
    ask = "Search the docs for setuptools."
    forced = {"type": "function", "name": "mcp__docs__search"}
    r = client.responses.create(model=MODEL_NAME, input=ask, tools=tools, tool_choice=forced,
                                parallel_tool_calls=False, max_output_tokens=128, temperature=0)
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and (calls[0].name, calls[0].namespace) == ("search", "mcp__docs__")
    assert isinstance(orjson.loads(calls[0].arguments)["query"], str)
    # Streamed: the same call, its arguments in fragments.
    body = {"model": MODEL_NAME, "input": ask, "tools": tools, "tool_choice": forced, "parallel_tool_calls": False,
            "max_output_tokens": 128, "temperature": 0, "stream": True}
    events = events_of(httpx.post(f"{codex_server.url}/v1/responses", json=body, timeout=300))
    added = next(data for name, data in events if name == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    item_id = added["item"]["id"]
    fragments = [data["delta"] for name, data in events
                 if name == "response.function_call_arguments.delta" and data["item_id"] == item_id]
    done = next(data for name, data in events
                if name == "response.function_call_arguments.done" and data["item_id"] == item_id)
    assert "".join(fragments) == done["arguments"] == calls[0].arguments
    # The output goes back; the conversation so far comes from the cache.
    history = [{"role": "user", "content": ask}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "setuptools builds packages."}]
    again = client.responses.create(model=MODEL_NAME, input=history, tools=tools, max_output_tokens=24,
                                    temperature=0)
    assert again.output and again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // 256 * 256


@pytest.mark.slow
def test_errors_come_in_openais_shape(codex_server: Server, client: openai.OpenAI):
    url = f"{codex_server.url}/v1/responses"
    r = httpx.post(url, json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url, json={"input": "hi", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r = httpx.post(url, json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(url, json={"input": [{"type": "message", "role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].role"
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.responses.create(model=MODEL_NAME, input="word " * (CONTEXT_TOKENS + 100))
    err = excinfo.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert err["message"].startswith("Your input exceeds the context window of this model")


@pytest.mark.slow
def test_base_url_without_v1_serves_every_api(codex_server: Server):
    bare = openai.OpenAI(base_url=codex_server.url, api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in bare.models.list().data] == [MODEL_NAME]
    assert bare.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=2).status == "incomplete"
    chat = bare.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                        max_tokens=2)
    assert chat.choices[0].finish_reason == "length"


# Codex-shaped: no instructions, two developer and two user messages, function tools, an
# MCP namespace, web_search and a custom tool, prompt_cache_key, include, store: false.
PERMISSIONS = " ".join(f"Sandbox rule {i}: commands run in a workspace-write sandbox; ask before network "
                       f"access or writes outside the workspace." for i in range(40))
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
     "strict": False, "parameters": {"type": "object", "properties": {
         "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"},
         "timeout_ms": {"type": "number"}}, "required": ["command"], "additionalProperties": False}},
    {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
     "parameters": {"type": "object", "properties": {"plan": {"type": "array", "items": {"type": "object"}}},
                    "required": ["plan"], "additionalProperties": False}},
    {"type": "function", "name": "view_image", "description": "Attaches a local image.", "strict": False,
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"type": "custom", "name": "apply_patch", "description": "Applies a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "web_search"},
    {"type": "namespace", "name": "mcp__docs__", "description": "Tools of the docs MCP server.", "tools": [
        {"type": "function", "name": "search", "description": "Searches the docs.", "strict": False,
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
        {"type": "function", "name": "fetch", "description": "Fetches one doc page.", "strict": False,
         "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}}]},
    {"type": "function", "name": "list_mcp_resources", "description": "Lists MCP resources.", "strict": False,
     "parameters": {"type": "object", "properties": {}}},
    {"type": "function", "name": "read_mcp_resource", "description": "Reads an MCP resource.", "strict": False,
     "parameters": {"type": "object", "properties": {"uri": {"type": "string"}}, "required": ["uri"]}},
]


def codex_body(turns: list[dict]) -> dict:
    return {
        "model": MODEL_NAME,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": PERMISSIONS}]},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<collaboration_mode>default</collaboration_mode>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>cwd: /repo</environment_context>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "What does setup.py do?"}]},
            *turns,
        ],
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-session-uuid",
        "text": {"verbosity": "low"}, "max_output_tokens": 48, "temperature": 0,
    }


TOOL_TURN = [
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
     "arguments": '{"command": ["cat", "setup.py"]}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "from setuptools import setup\nsetup()\n"},
    {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "search", "namespace": "mcp__docs__",
     "arguments": '{"query": "setuptools"}'},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "setuptools builds and installs Python packages."}]},
]


@pytest.mark.slow
def test_codex_shaped_turns_are_answered_and_hit_the_cache(codex_server: Server):
    url = f"{codex_server.url}/v1/responses"
    r = httpx.post(url, json=codex_body(TOOL_TURN), timeout=600)
    assert r.status_code == 200, r.text
    events = events_of(r)
    assert events[-1][0] in ("response.completed", "response.incomplete")
    first = events[-1][1]["response"]
    prompt = first["usage"]["input_tokens"]
    assert prompt > 1024
    answer = [item for item in first["output"] if item["type"] in ("message", "function_call", "reasoning")]
    assert answer
    # The next turn: the answer and one more user message.
    follow = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks, go on."}]}
    r = httpx.post(url, json=codex_body([*TOOL_TURN, *answer, follow]), timeout=600)
    assert r.status_code == 200, r.text
    second = events_of(r)[-1][1]["response"]["usage"]
    assert second["input_tokens"] > prompt
    # Everything of the first turn's prompt, to the last full 256-token block, came from the cache.
    assert second["input_tokens_details"]["cached_tokens"] >= prompt // 256 * 256
    assert second["input_tokens_details"]["cached_tokens"] > second["input_tokens"] / 2


# --- the conversion and the writer on their own -------------------------------------------


def test_codex_input_becomes_one_turn():
    params = ResponsesParams.model_validate(codex_body(TOOL_TURN))
    functions = Functions(params.tools)
    turn = turn_of(params, functions)
    assert [m.role for m in turn.messages] == ["system", "system", "user", "user", "assistant", "tool",
                                               "assistant", "tool"]
    assert turn.messages[0].content == PERMISSIONS
    assert turn.messages[4].tool_calls == (ToolCall(id="call_1", name="shell",
                                                    arguments='{"command": ["cat", "setup.py"]}'),)
    assert turn.messages[4].reasoning is None  # a reasoning item with null content
    assert turn.messages[6].tool_calls[0].name == "mcp__docs__search"
    assert turn.messages[7] == Message(role="tool", content="setuptools builds and installs Python packages.",
                                       tool_call_id="call_2", name="mcp__docs__search")
    # Functions, the namespace's flattened; web_search and the custom tool are not offered.
    assert [t.name for t in turn.tools] == ["shell", "update_plan", "view_image", "mcp__docs__search",
                                            "mcp__docs__fetch", "list_mcp_resources", "read_mcp_resource"]
    assert functions.item_fields("mcp__docs__fetch") == {"name": "fetch", "namespace": "mcp__docs__"}
    assert functions.item_fields("shell") == {"name": "shell"}
    assert not turn.parallel_tool_calls and turn.tool_choice == "auto"


def test_instructions_text_input_and_assistant_items_merge():
    params = ResponsesParams.model_validate({
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": "hi"},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "greet"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "web_search_call", "id": "ws_1", "status": "completed"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
    })
    turn = turn_of(params, Functions(params.tools))
    assert turn.messages == (
        Message(role="system", content="Be brief."), Message(role="user", content="hi"),
        Message(role="assistant", content="Hello.", reasoning="greet",
                tool_calls=(ToolCall(id="c1", name="f", arguments="{}"),)),
        Message(role="tool", content="ok", tool_call_id="c1", name="f"))
    assert turn.tool_choice == "f"
    assert turn.output_format.kind == "json_schema" and turn.output_format.name == "n"
    plain = ResponsesParams.model_validate({"input": "hi"})
    assert turn_of(plain, Functions([])).messages == (Message(role="user", content="hi"),)


def test_writer_streams_reasoning_text_and_function_call_items():
    """The parser's events as they will come once prepare() parses reasoning and tool calls."""
    params = ResponsesParams.model_validate({"input": "x", "tools": CODEX_TOOLS})
    stats = RequestStats(prompt_tokens=100, cached_tokens=60, completion_tokens=20)
    loaded = SimpleNamespace(encode=lambda text: text.split())
    request = SimpleNamespace(sampling=SimpleNamespace(temperature=1.0))
    run = SimpleNamespace(stats=stats, stop_reason="tool_calls", finished=True, loaded=loaded, request=request)
    writer = ResponseWriter(params, MODEL_NAME, run, Functions(params.tools))
    events = [ReasoningDelta("look it "), ReasoningDelta("up"), TextDelta("Searching."),
              ToolCallStart(index=0, id="call_7", name="mcp__docs__search"),
              ToolCallDelta(index=0, arguments='{"query": "x"}'),
              ToolCallEnd(index=0, call=ToolCall(id="call_7", name="mcp__docs__search", arguments='{"query": "x"}'))]
    out = writer.start() + [d for e in events for d in writer.on(e)] + writer.finish()
    assert [d["type"] for d in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for d in out] == list(range(len(out)))
    call = out[-2]["item"]
    assert (call["type"], call["name"], call["namespace"], call["call_id"], call["arguments"]) == (
        "function_call", "search", "mcp__docs__", "call_7", '{"query": "x"}')
    final = out[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "look it up"}]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 60
