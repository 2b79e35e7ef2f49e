"""appliance/server/anthropic.py: the Messages API against a real server with the real
model, driven by the official `anthropic` client and raw HTTP; the body-to-Turn
conversion and the event writer on their own."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import orjson
import pytest

from appliance.chat.turn import Message, ReasoningDelta, TextDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart
from appliance.engine.request import RequestStats
from appliance.server.anthropic import CountParams, MessageWriter
from tests.conftest import MODEL_NAME, Server, served

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK no longer names temperature; the API still takes it
CONTEXT_TOKENS = 12288  # past the model's trained 8,192, by explicit choice


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an agent-sized context: past the trained length, by explicit choice."""
    with served(tmp_path_factory, "anthropic", context_tokens=CONTEXT_TOKENS,
                model_extra="allow_beyond_trained_context = true") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(agent_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.url, api_key="unused", max_retries=0, timeout=300)


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    """Returns the (event name, data) pairs of an SSE body."""
    out = []
    for frame in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], orjson.loads(lines["data"])))
    return out


def keepalives_dropped(events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Returns the events without the pings sent after the first to keep a slow stream alive."""
    return events[:2] + [(name, data) for name, data in events[2:] if name != "ping"]


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.slow
def test_message_answers_with_usage(client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=CAPITAL, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_NAME
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens > 0 and u.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model=MODEL_NAME, messages=CAPITAL).input_tokens
    assert u.input_tokens + u.cache_read_input_tokens == count


@pytest.mark.slow
def test_stream_sends_the_exact_event_sequence(agent_server: Server, client: anthropic.Anthropic):
    body = {"model": MODEL_NAME, "max_tokens": 24, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of Italy?"}]}
    r = httpx.post(f"{agent_server.url}/v1/messages", json=body, timeout=300)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = keepalives_dropped(events_of(r))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    prompt = client.messages.count_tokens(model=MODEL_NAME, messages=body["messages"]).input_tokens
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == prompt
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for _, data in events[3:-3]]
    assert all(d["type"] == "text_delta" for d in deltas)
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    # The same answer, whole: the stream carries the same text and counts.
    whole = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=body["messages"], extra_body=GREEDY)
    assert "".join(d["text"] for d in deltas) == whole.content[0].text
    assert end["usage"]["output_tokens"] == whole.usage.output_tokens


@pytest.mark.slow
def test_sdk_stream_accumulates_the_same_message(client: anthropic.Anthropic):
    whole = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=CAPITAL, extra_body=GREEDY)
    with client.messages.stream(model=MODEL_NAME, max_tokens=24, messages=CAPITAL, extra_body=GREEDY) as s:
        texts = [e.text for e in s if e.type == "text"]
        final = s.get_final_message()
    assert "".join(texts) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the same prompt, just before


@pytest.mark.slow
def test_max_tokens_and_stop_sequences_name_the_stop(client: anthropic.Anthropic):
    short = client.messages.create(model=MODEL_NAME, max_tokens=3, messages=CAPITAL, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    free = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=CAPITAL, extra_body=GREEDY)
    text = free.content[0].text
    stopped = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=CAPITAL, extra_body=GREEDY,
                                     stop_sequences=["Pari"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Pari"
    assert stopped.content[0].text == text[: text.index("Pari")]


@pytest.mark.slow
def test_max_tokens_above_the_room_left_is_clamped(client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL_NAME, max_tokens=32000, messages=CAPITAL, extra_body=GREEDY)
    assert m.stop_reason == "end_turn" and "Paris" in m.content[0].text


@pytest.mark.slow
def test_count_tokens_counts_every_block(client: anthropic.Anthropic):
    def count(**body) -> int:
        return client.messages.count_tokens(model=MODEL_NAME, **body).input_tokens

    call = [{"role": "user", "content": "List the files."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]}]
    as_string = call + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "README.md setup.py"}]}]
    as_blocks = call + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "README.md setup.py"}]}]}]
    longer = call + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "README.md setup.py tests/ appliance/ bench/"}]}]
    plain = count(messages=as_string)
    assert count(messages=as_blocks) == plain
    assert count(messages=longer) > plain
    short = count(messages=as_string, system="You are a careful assistant.")
    assert count(messages=as_string, system="You are a careful assistant. Read before you edit.") > short
    assert count(messages=as_string, system=[{"type": "text", "text": "You are a careful assistant.",
                                              "cache_control": {"type": "ephemeral"}}]) == short
    tools = [{"name": "ls", "description": "Lists files.", "input_schema": {"type": "object", "properties": {}}}]
    with_tools = count(messages=as_string, tools=tools)
    assert with_tools > plain
    # What count_tokens says is the prompt the Messages API then runs.
    m = client.messages.create(model=MODEL_NAME, max_tokens=1, messages=as_string, tools=tools, extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == with_tools


@pytest.mark.slow
def test_agent_headers_query_and_base_urls_are_accepted(agent_server: Server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": CAPITAL, "metadata": {"user_id": "u1"}}
    headers = {"x-api-key": "sk-ant-unused", "Authorization": "Bearer unused", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}
    for path in ("/v1/messages?beta=true", "/messages", "/v1/v1/messages"):
        r = httpx.post(agent_server.url + path, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, (path, r.text)
        assert r.json()["type"] == "message"
    r = httpx.post(agent_server.url + "/v1/messages/count_tokens?beta=true", json=body, headers=headers)
    assert r.status_code == 200 and r.json()["input_tokens"] > 5


@pytest.mark.slow
def test_errors_come_in_anthropics_shape(agent_server: Server, client: anthropic.Anthropic):
    url = agent_server.url

    def error(r: httpx.Response) -> dict:
        data = r.json()
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
        return data["error"]

    r = httpx.post(f"{url}/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": CAPITAL})
    assert r.status_code == 404 and error(r)["type"] == "not_found_error" and "nope" in error(r)["message"]
    r = httpx.post(f"{url}/v1/messages", content=b"{not json")
    assert r.status_code == 400 and error(r)["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/messages", json={"max_tokens": 2, "messages": CAPITAL, "temperature": 3})
    assert r.status_code == 400 and "temperature" in error(r)["message"]
    r = httpx.post(f"{url}/v1/messages", json={"max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "messages[0].role" in error(r)["message"]
    r = httpx.get(f"{url}/v1/messages")
    assert r.status_code == 405 and error(r)["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "nope", "messages": CAPITAL})
    assert r.status_code == 404 and error(r)["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=2, messages=CAPITAL)


@pytest.mark.slow
def test_a_prompt_over_the_context_is_too_long(client: anthropic.Anthropic):
    huge = [{"role": "user", "content": "word " * (CONTEXT_TOKENS + 100)}]
    with pytest.raises(anthropic.BadRequestError) as excinfo:
        client.messages.create(model=MODEL_NAME, max_tokens=16, messages=huge)
    err = excinfo.value.body["error"]
    assert err["type"] == "invalid_request_error"
    # Claude Code compacts on this wording, and reads both numbers.
    assert err["message"].startswith("prompt is too long: ")
    assert err["message"].endswith(f" tokens > {CONTEXT_TOKENS - 1} maximum")
    assert int(err["message"].split()[4]) > CONTEXT_TOKENS


@pytest.mark.slow
def test_context_runs_beyond_the_trained_length_by_choice(agent_server: Server):
    status = httpx.get(f"{agent_server.url}/admin/api/status").json()
    assert status["models"][0]["context_tokens"] == CONTEXT_TOKENS
    assert "beyond its trained 8192 tokens" in agent_server.output()


WEATHER = [{"name": "get_weather", "description": "Gets the current weather of a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE_WEATHER = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


@pytest.mark.slow
def test_a_forced_tool_call_comes_back_as_tool_use(agent_server: Server, client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL_NAME, max_tokens=128, messages=ASK_WEATHER, tools=WEATHER,
                               tool_choice=FORCE_WEATHER, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    # Streamed: the same call, its input in input_json_delta fragments.
    body = {"model": MODEL_NAME, "max_tokens": 128, "messages": ASK_WEATHER, "tools": WEATHER,
            "tool_choice": FORCE_WEATHER, "temperature": 0, "stream": True}
    events = events_of(httpx.post(f"{agent_server.url}/v1/messages", json=body, timeout=300))
    starts = [data for name, data in events if name == "content_block_start"]
    assert starts[0]["content_block"]["type"] == "tool_use" and starts[0]["content_block"]["input"] == {}
    fragments = [data["delta"]["partial_json"] for name, data in events
                 if name == "content_block_delta" and data["index"] == starts[0]["index"]]
    assert orjson.loads("".join(fragments)) == uses[0].input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # The result goes back; the conversation so far comes from the cache.
    again = client.messages.create(model=MODEL_NAME, max_tokens=24, tools=WEATHER, extra_body=GREEDY, messages=[
        *ASK_WEATHER, m.to_param(),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}])
    assert again.content and again.usage.cache_read_input_tokens >= m.usage.cache_read_input_tokens


@pytest.mark.slow
def test_output_config_json_schema_is_followed(client: anthropic.Anthropic):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
              "required": ["capital", "country"], "additionalProperties": False}
    m = client.messages.create(model=MODEL_NAME, max_tokens=64, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Describe the capital of France as JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(orjson.loads(m.content[0].text), schema)


# A Claude-Code-shaped conversation: billing header, cached system blocks, a dozen tools,
# tool use with results as strings and as blocks, echoed thinking, a trailing system message.
TOOL_NAMES = ["Bash", "Read", "Write", "Edit", "Glob", "Grep", "LS", "WebFetch", "TodoWrite", "Task",
              "NotebookEdit", "ExitPlanMode"]
TOOLS = [{"name": name, "description": f"The {name} tool. Use it when the task needs {name.lower()}.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string", "description": "a path"},
                                                            "arg": {"type": "string"}},
                           "required": ["path"], "additionalProperties": False}}
         for name in TOOL_NAMES]
GUIDE = " ".join(f"Rule {i}: keep answers short, prefer reading files before editing them, and never "
                 f"guess a path." for i in range(80))


def claude_code_body(billing: str) -> dict:
    return {
        "model": MODEL_NAME, "max_tokens": 64, "stream": False,
        "system": [
            {"type": "text",
             "text": f"x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli; cch={billing};"},
            {"type": "text", "text": "You are Claude Code, a coding agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": GUIDE, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                                         {"type": "text", "text": "What is in setup.py?",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read the file.", "signature": ""},
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"path": "setup.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                          "content": "from setuptools import setup\nsetup(name='demo')\n"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_02", "name": "LS", "input": {"path": "."}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02",
                                          "content": [{"type": "text", "text": "setup.py\nREADME.md\n"}]},
                                         {"type": "text", "text": "Now summarize."}]},
            {"role": "system", "content": "The user's working directory is /repo."},
        ],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc_account_def_session_ghi"},
        "temperature": 0,
    }


CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                    "context-management-2025-06-27,mid-conversation-tool-changes-2026-07",
                  "anthropic-version": "2023-06-01", "x-api-key": "unused"}


@pytest.mark.slow
def test_claude_code_shaped_turns_are_answered_and_hit_the_cache(agent_server: Server):
    url = f"{agent_server.url}/v1/messages?beta=true"
    first_body = claude_code_body("a1b2c")
    r = httpx.post(url, json=first_body, headers=CLAUDE_HEADERS, timeout=600)
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["content"] and first["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    assert prompt > 1024
    # The next turn: the answer and one more user message; the billing header changed.
    second_body = claude_code_body("zz9y8")
    second_body["messages"] += [{"role": "assistant", "content": first["content"]},
                                {"role": "user", "content": "Thanks. Anything else?"}]
    second_body["stream"] = True
    r = httpx.post(url, json=second_body, headers=CLAUDE_HEADERS, timeout=600)
    assert r.status_code == 200, r.text
    events = events_of(r)
    assert events[-1][1] == {"type": "message_stop"}
    usage = events[0][1]["message"]["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert total > prompt
    # Everything of the first turn's prompt, to the last full 256-token block, came from the cache.
    assert usage["cache_read_input_tokens"] >= prompt // 256 * 256
    assert usage["cache_read_input_tokens"] > total / 2


# --- the conversion and the writer on their own -------------------------------------------


def test_billing_header_is_dropped_and_tool_results_become_tool_messages():
    body = claude_code_body("abc")
    turn = CountParams.model_validate(body).turn()
    system = turn.messages[0]
    assert system.role == "system" and "billing" not in system.content
    assert system.content.startswith("You are Claude Code")
    roles = [m.role for m in turn.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "user", "system"]
    assistant = turn.messages[2]
    assert assistant.reasoning == "I should read the file." and assistant.content == "Reading it."
    assert assistant.tool_calls == (ToolCall(id="toolu_01", name="Read", arguments='{"path":"setup.py"}'),)
    assert turn.messages[3] == Message(role="tool", content="from setuptools import setup\nsetup(name='demo')\n",
                                       tool_call_id="toolu_01", name="Read")
    assert turn.messages[5].content == "setup.py\nREADME.md\n" and turn.messages[5].name == "LS"
    assert turn.messages[6].content == "Now summarize."
    assert [t.name for t in turn.tools] == TOOL_NAMES
    assert turn.thinking is None  # adaptive: the template's default
    other = copy.deepcopy(body)
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.328; cch=other;"
    assert CountParams.model_validate(other).turn() == turn


def test_tool_choice_thinking_and_output_format_are_carried():
    body = {"messages": CAPITAL, "tool_choice": {"type": "tool", "name": "Read", "disable_parallel_tool_use": True},
            "tools": [*TOOLS[:2], {"type": "web_search_20250305", "name": "web_search"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    turn = CountParams.model_validate(body).turn()
    assert turn.tool_choice == "Read" and not turn.parallel_tool_calls
    assert [t.name for t in turn.tools] == ["Bash", "Read"]  # the server tool is not offered
    assert turn.thinking is True
    assert turn.output_format.kind == "json_schema" and turn.output_format.schema == {"type": "object"}
    assert CountParams.model_validate({**body, "tool_choice": {"type": "any"}}).turn().tool_choice == "required"
    assert CountParams.model_validate({**body, "thinking": {"type": "disabled"}}).turn().thinking is False


def finished_run(reason: str) -> SimpleNamespace:
    """What MessageWriter reads of a TurnRun: its stats and how it ended."""
    stats = RequestStats(prompt_tokens=100, cached_tokens=60, completion_tokens=9)
    return SimpleNamespace(stats=stats, stop_reason=reason, stop_sequence=None)


def test_writer_streams_thinking_text_and_tool_use_blocks():
    """The parser's events as they will come once prepare() parses reasoning and tool calls."""
    writer = MessageWriter(MODEL_NAME, finished_run("tool_calls"))
    events = [ReasoningDelta("Need "), ReasoningDelta("a file."), TextDelta("Reading."),
              ToolCallStart(index=0, id="toolu_9", name="Read"), ToolCallDelta(index=0, arguments='{"path": '),
              ToolCallDelta(index=0, arguments='"a.py"}'),
              ToolCallEnd(index=0, call=ToolCall(id="toolu_9", name="Read", arguments='{"path": "a.py"}'))]
    out = writer.start() + [d for e in events for d in writer.on(e)] + writer.finish()
    assert [d["type"] for d in out] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert out[0]["message"]["usage"] == {"input_tokens": 40, "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 60, "output_tokens": 9}
    assert out[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert out[3]["delta"] == {"type": "thinking_delta", "thinking": "Need "}
    assert out[7]["delta"] == {"type": "text_delta", "text": "Reading."}
    assert out[9] == {"type": "content_block_start", "index": 2,
                      "content_block": {"type": "tool_use", "id": "toolu_9", "name": "Read", "input": {}}}
    assert out[10]["delta"] == {"type": "input_json_delta", "partial_json": '{"path": '}
    assert out[13]["delta"]["stop_reason"] == "tool_use"
    whole = writer.message(stop_reason="tool_use")
    assert whole["content"] == [{"type": "thinking", "thinking": "Need a file.", "signature": ""},
                                {"type": "text", "text": "Reading."},
                                {"type": "tool_use", "id": "toolu_9", "name": "Read", "input": {"path": "a.py"}}]
