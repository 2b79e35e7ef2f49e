"""The tool-call parsers on outputs written the way real models write them, fed whole,
in token-sized chunks and one character at a time."""

from __future__ import annotations

import json

import pytest

from appliance.chat.tool_parsers import DeepSeek, Hermes, Llama3, Mistral, QwenCoder, tool_format
from appliance.chat.turn import TextDelta, Tool, ToolCallDelta, ToolCallEnd, ToolCallStart

WEATHER = Tool("get_weather", "Current weather", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                   "days": {"type": "integer"}},
    "required": ["city"]})
SEARCH = Tool("search", "Web search", {"type": "object", "properties": {"query": {"type": "string"}}})
TOOLS = (WEATHER, SEARCH)


def chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] if size else [text]


def run(fmt, text: str, size: int = 0) -> list:
    parser = fmt.parser(TOOLS)
    events = []
    for piece in chunks(text, size):
        events += parser.feed(piece)
    return events + parser.close()


def summary(events: list) -> tuple[str, list[tuple[str, dict]]]:
    """Returns the text and the calls (name, arguments) the events add up to, checking
    that each call's deltas add up to its final arguments and that ids match."""
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = []
    starts = {e.index: e for e in events if isinstance(e, ToolCallStart)}
    for end in (e for e in events if isinstance(e, ToolCallEnd)):
        start = starts[end.index]
        assert start.id == end.call.id and start.id.startswith("call_")
        assert start.name == end.call.name
        streamed = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == end.index)
        assert streamed == end.call.arguments
        calls.append((end.call.name, json.loads(end.call.arguments)))
    assert sorted(starts) == list(range(len(calls)))
    return text, calls


SIZES = [0, 1, 3, 7]

# Qwen2.5-7B-Instruct, one call with text before it.
QWEN25 = ('I\'ll check the weather for you.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "unit": "c"}}\n</tool_call>')
# Hermes-2-Pro-Llama-3-8B, two parallel calls.
HERMES_PARALLEL = ('<tool_call>\n{"arguments": {"city": "Tokyo"}, "name": "get_weather"}\n</tool_call>\n'
                   '<tool_call>\n{"name": "search", "arguments": {"query": "tokyo \\"events\\" {today}"}}\n'
                   '</tool_call>')


@pytest.mark.parametrize("size", SIZES)
def test_hermes_text_then_a_call(size):
    text, calls = summary(run(Hermes(), QWEN25, size))
    assert text == "I'll check the weather for you.\n"
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"})]


@pytest.mark.parametrize("size", SIZES)
def test_hermes_parallel_calls_with_arguments_first_and_braces_in_strings(size):
    text, calls = summary(run(Hermes(), HERMES_PARALLEL, size))
    assert text == ""
    assert calls == [("get_weather", {"city": "Tokyo"}), ("search", {"query": 'tokyo "events" {today}'})]


def test_hermes_streams_text_at_once_and_arguments_in_fragments():
    parser = Hermes().parser(TOOLS)
    assert parser.feed("Sure") == [TextDelta("Sure")]
    assert parser.feed("! <tool") == [TextDelta("! ")]  # only the possible tag start is held
    [start] = parser.feed('_call>\n{"name": "get_weather", ')  # the start, as soon as the name is known
    assert isinstance(start, ToolCallStart) and start.name == "get_weather" and start.index == 0
    assert parser.feed('"arguments": {"city": "Par') == [ToolCallDelta(0, '{"city": "Par')]
    delta, end = parser.feed('is"}}\n</tool')
    assert delta == ToolCallDelta(0, 'is"}')
    assert end.call.id == start.id and end.call.arguments == '{"city": "Paris"}'
    assert parser.feed("_call>") == [] and parser.close() == []


def test_hermes_arguments_as_a_json_string_are_decoded():
    out = '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"mlx\\"}"}\n</tool_call>'
    assert summary(run(Hermes(), out, 2))[1] == [("search", {"query": "mlx"})]


def test_hermes_plain_text_with_a_lone_angle_bracket_passes_through():
    out = "Use a < b and <b>bold</b> here."
    assert summary(run(Hermes(), out, 1)) == (out, [])


@pytest.mark.parametrize("size", SIZES)
def test_hermes_tag_without_json_stays_text(size):
    out = 'Call it like <tool_call>get_weather(city="Paris")</tool_call>, then <tool_call>'
    assert summary(run(Hermes(), out, size)) == (out, [])


def test_hermes_call_cut_off_by_max_tokens_still_ends():
    events = run(Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', 4)
    assert isinstance(events[-1], ToolCallEnd) and events[-1].call.name == "get_weather"


# Llama-3.1-8B-Instruct (JSON tool calling) and Llama-3.2-3B with <|python_tag|>.
LLAMA31 = '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "f"}}'
LLAMA_TAG = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
             '{"name": "search", "parameters": {"query": "oslo museums"}}')


@pytest.mark.parametrize("size", SIZES)
def test_llama3_json_call(size):
    assert summary(run(Llama3(), LLAMA31, size)) == ("", [("get_weather", {"city": "San Francisco", "unit": "f"})])


@pytest.mark.parametrize("size", SIZES)
def test_llama3_python_tag_and_two_calls(size):
    assert summary(run(Llama3(), LLAMA_TAG, size))[1] == [("get_weather", {"city": "Oslo"}),
                                                          ("search", {"query": "oslo museums"})]


@pytest.mark.parametrize("size", SIZES)
def test_llama3_plain_answer_and_json_that_is_no_call_stay_text(size):
    for out in ("The weather in Paris is mild.", '{"answer": 42}'):
        assert summary(run(Llama3(), out, size)) == (out, [])


# Mistral-7B-Instruct-v0.3 and Mistral-Small-3.2 (v11 tokenizer: NAME[ARGS]{...}).
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
              '{"name": "search", "arguments": {"query": "lyon food"}}]')
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "days": 3}[TOOL_CALLS]search[ARGS]{"query": "nice"}'


@pytest.mark.parametrize("size", SIZES)
def test_mistral_list_of_calls(size):
    assert summary(run(Mistral(), MISTRAL_V3, size))[1] == [("get_weather", {"city": "Lyon"}),
                                                            ("search", {"query": "lyon food"})]


@pytest.mark.parametrize("size", SIZES)
def test_mistral_v11_name_and_args(size):
    text, calls = summary(run(Mistral(args_tag=True), "Let me look.\n" + MISTRAL_V11, size))
    assert text == "Let me look.\n"
    assert calls == [("get_weather", {"city": "Nice", "days": 3}), ("search", {"query": "nice"})]


# DeepSeek-V3-0324 and DeepSeek-V3.1.
DEEPSEEK_V3 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
               '{"city": "Berlin"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
                '<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "rome"}<｜tool▁call▁end｜>'
                '<｜tool▁calls▁end｜>')


@pytest.mark.parametrize("size", SIZES)
def test_deepseek_v3_fenced_arguments(size):
    assert summary(run(DeepSeek(), DEEPSEEK_V3, size)) == ("", [("get_weather", {"city": "Berlin"})])


@pytest.mark.parametrize("size", SIZES)
def test_deepseek_v31_two_calls(size):
    assert summary(run(DeepSeek(v31=True), DEEPSEEK_V31, size)) == (
        "Checking.", [("get_weather", {"city": "Rome"}), ("search", {"query": "rome"})])


# Qwen3-Coder-30B-A3B-Instruct.
QWEN_CODER = ('I will look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n'
              '</parameter>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>')


@pytest.mark.parametrize("size", SIZES)
def test_qwen3_coder_parameters_typed_by_schema(size):
    text, calls = summary(run(QwenCoder(), QWEN_CODER, size))
    assert text == "I will look that up.\n"
    assert calls == [("get_weather", {"city": "New York", "days": 5})]


def test_formats_are_chosen_from_the_template():
    assert tool_format(None).name == "hermes"  # no template, no tools: the fallback prompt's format
    assert tool_format("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}").name == "hermes"
    assert tool_format("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>").name == "qwen3_coder"
    assert tool_format("{{ '[AVAILABLE_TOOLS]' }}[TOOL_CALLS]").name == "mistral"
    assert tool_format("[TOOL_CALLS]{{ name }}[ARGS]").args_tag
    assert tool_format("<|start_header_id|>ipython ... <|python_tag|>").name == "llama3"
    assert tool_format("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>").v31 is False
    assert tool_format("<｜tool▁calls▁begin｜>{{ name }}<｜tool▁sep｜>").v31 is True
