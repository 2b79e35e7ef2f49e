"""The chat shape maps parser events to OpenAI's message and delta shapes."""

from __future__ import annotations

import json

from appliance.chat.reasoning import ReasoningParser
from appliance.chat.tool_parsers import Hermes
from appliance.engine.request import Delta, RequestStats
from appliance.server.shapes import ChatShape

# A reasoning model's answer that thinks, says a word and calls a tool, in three deltas.
PIECES = ["<think>Need the weather.</think>\n\nChecking. <tool_", 'call>\n{"name": "get_weather", "arguments": ',
          '{"city": "Paris"}}\n</tool_call>']


def shape() -> ChatShape:
    return ChatShape(model="m", decode=str, parser=ReasoningParser(Hermes().parser(())))


def deltas() -> list[Delta]:
    return [Delta(text=p, token_ids=(i,)) for i, p in enumerate(PIECES)]


def test_stream_deltas_carry_reasoning_text_and_tool_calls_in_openai_shapes():
    s = shape()
    choices = [c for d in deltas() for c in s.delta_choices(d)] + s.finish_choices("stop")
    parts = [c["delta"] for c in choices]
    assert parts[0] == {"reasoning_content": "Need the weather."}
    assert parts[1] == {"content": "Checking. "}
    call = parts[2]["tool_calls"][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [p["tool_calls"][0] for p in parts[3:-1]]
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    assert json.loads("".join(f["function"]["arguments"] for f in fragments)) == {"city": "Paris"}
    assert choices[-1]["finish_reason"] == "tool_calls" and parts[-1] == {}


def test_whole_message_has_reasoning_content_and_tool_calls():
    body = shape().whole(deltas(), "stop", RequestStats(prompt_tokens=5, completion_tokens=3))
    choice = body["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "Need the weather."
    assert message["content"] == "Checking. "
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


def test_a_call_cut_by_the_budget_keeps_length():
    s = shape()
    body = s.whole(deltas()[:2], "length", RequestStats(prompt_tokens=5, completion_tokens=2))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
