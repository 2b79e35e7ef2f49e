"""Tool calling on /v1/chat/completions, end to end with the official openai client.

The tiny model seldom calls a tool on its own, so the calls here are forced with
`tool_choice` (required or named): the grammar makes them deterministic.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
ASK = [{"role": "system", "content": "You are a helpful assistant with tools."},
       {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def create(client: openai.OpenAI, **kwargs):
    args = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80}
    return client.chat.completions.create(**{**args, **kwargs})


def test_required_tool_choice_answers_with_tool_calls(client):
    r = create(client, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER_PARAMS)
    assert choice.message.content is None


def test_named_tool_choice_streams_openai_tool_call_deltas(client):
    whole = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False)
    chunks = list(create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         parallel_tool_calls=False, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, rest = deltas[0][0], [d[0] for d in deltas[1:]]
    # OpenAI's shape: the first delta of a call has index, id, type, name and empty arguments
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function",
                                                                                        "get_weather", "")
    assert first.id.startswith("call_")
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
    [call] = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_tool_choice_none_answers_in_text(client):
    r = create(client, tool_choice="none", max_tokens=16)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_tool_result_round_trip_reads_the_first_turn_from_the_cache(client):
    salt = {"cache_salt": "tool-round-trip"}
    first = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False, extra_body=salt)
    [call] = first.choices[0].message.tool_calls
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    second = create(client, messages=messages, max_tokens=24, extra_body=salt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    third = create(client, messages=messages + [
        {"role": "assistant", "content": second.choices[0].message.content or ""},
        {"role": "developer", "content": "Answer briefly."},  # a system message in the middle
        {"role": "user", "content": "And in Lyon?"}], max_tokens=8, extra_body=salt)
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": "get_weather"}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages.0.tool_calls.0.function"),
])
def test_bad_tool_parameters_are_a_400_naming_the_param(server: Server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
