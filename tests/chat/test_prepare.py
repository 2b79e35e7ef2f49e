"""prepare() with the real model's tokenizer: the fallback tool prompt, templates that
take tools and thinking, prefixes that stay prefixes, and the constraint it compiles."""

from __future__ import annotations

import dataclasses
import json

import pytest

from appliance.chat.prepare import FALLBACK_TOOL_PROMPT, PrepareError, prepare
from appliance.chat.streaming import OutputParser
from appliance.chat.turn import Message, OutputFormat, ReasoningDelta, TextDelta, Tool, ToolCall, ToolCallEnd, Turn

WEATHER = Tool("get_weather", "Current weather in a city",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
CONVERSATION = (
    Message("system", "You are terse."),
    Message("user", "Weather in Paris?"),
    Message("assistant", "", tool_calls=(CALL,)),
    Message("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather"),
)

# The shape of Qwen3's template, cut down: tools, tool calls, tool results, thinking.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else '' }}
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' and loop.first and tools %}{% continue %}{% endif %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# A template that allows a system message only first, as Gemma's and some Llama's do.
STRICT = """{% for m in messages %}{% if m.role == 'system' and not loop.first %}
{{ raise_exception('System role only at the start') }}{% endif %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
"""


class Templated:
    """The real tokenizer with another chat template."""

    def __init__(self, tokenizer, template: str):
        self._tokenizer, self.chat_template = tokenizer, template

    def apply_chat_template(self, *args, **kwargs):
        kwargs["chat_template"] = self.chat_template
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def with_template(loaded, template: str):
    return dataclasses.replace(loaded, tokenizer=Templated(loaded.tokenizer, template))


def text_of(loaded, prepared) -> str:
    return loaded.tokenizer.decode(list(prepared.prompt_tokens))


def test_template_without_tools_gets_the_fallback_prompt(loaded_model):
    prepared = prepare(loaded_model, Turn(CONVERSATION, tools=(WEATHER,)))
    text = text_of(loaded_model, prepared)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert json.dumps({"type": "function", "function": {
        "name": "get_weather", "description": WEATHER.description, "parameters": WEATHER.parameters}}) in text
    assert FALLBACK_TOOL_PROMPT.splitlines()[-3] in text  # "For each function call, return ..."
    # the earlier call and its result, written the way the model is asked to write them
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert prepared.tool_format.name == "hermes" and prepared.constraint is None
    events = prepared.parser().feed('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert [e.call.name for e in events if isinstance(e, ToolCallEnd)] == ["get_weather"]


def test_a_long_prompt_is_kept_for_its_tenant(loaded_model):
    loaded = dataclasses.replace(loaded_model)  # its own encoder, with nothing kept yet
    long = Turn((Message("user", "word " * 5000),))
    first = prepare(loaded, long, tenant="tenant-a")
    assert prepare(loaded, long, tenant="tenant-b").prompt_tokens == first.prompt_tokens
    assert [owner for owner, _ in loaded._pieces.memo] == ["tenant-b", "tenant-a"]
    assert prepare(loaded, long).prompt_tokens == first.prompt_tokens  # the default tenant's own


@pytest.mark.parametrize("template", [None, QWEN_LIKE])
def test_resent_with_one_more_turn_is_a_token_prefix(loaded_model, template):
    # (thinking on: with it off, Qwen3's template puts an empty think block in the
    # generation prompt that earlier answers don't have, which no server can keep a prefix)
    loaded = with_template(loaded_model, template) if template else loaded_model
    first = prepare(loaded, Turn(CONVERSATION, tools=(WEATHER,), thinking=True))
    longer = CONVERSATION + (Message("assistant", "It is 18 C and sunny."), Message("user", "And tomorrow?"))
    second = prepare(loaded, Turn(longer, tools=(WEATHER,), thinking=True))
    assert second.prompt_tokens[:len(first.prompt_tokens)] == first.prompt_tokens


def test_template_with_tools_renders_them_itself(loaded_model):
    loaded = with_template(loaded_model, QWEN_LIKE)
    prepared = prepare(loaded, Turn(CONVERSATION, tools=(WEATHER,), thinking=False))
    text = text_of(loaded, prepared)
    assert "# Tools\n<tools>" in text and "You may call" not in text  # its own words, not the fallback's
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False reached it
    assert prepared.reasoning and not prepared.reasoning_open
    events = prepared.parser().feed("<think>hm</think>Sunny.") + prepared.parser().close()
    assert ReasoningDelta("hm") in events and TextDelta("Sunny.") in events


def test_no_tools_no_reasoning_is_plain_text(loaded_model):
    prepared = prepare(loaded_model, Turn((Message("user", "hi"),)))
    assert type(prepared.parser()) is OutputParser
    assert prepared.prompt_tokens == tuple(loaded_model.encode_chat([{"role": "user", "content": "hi"}]))


def test_system_in_the_middle_goes_in_as_user_where_the_template_refuses_it(loaded_model):
    loaded = with_template(loaded_model, STRICT)
    turn = Turn((Message("system", "a"), Message("user", "b"), Message("system", "c"), Message("user", "d")))
    assert "<|im_start|>user\nc<|im_end|>" in text_of(loaded, prepare(loaded, turn))
    # the default template takes it as it is
    assert "<|im_start|>system\nc<|im_end|>" in text_of(loaded_model, prepare(loaded_model, turn))


def test_forced_call_and_output_formats_compile_a_constraint(loaded_model):
    user = (Message("user", "hi"),)
    assert prepare(loaded_model, Turn(user, tools=(WEATHER,), tool_choice="required")).constraint is not None
    assert prepare(loaded_model, Turn(user, tools=(WEATHER,), tool_choice="get_weather")).constraint is not None
    assert prepare(loaded_model, Turn(user, tools=(WEATHER,), tool_choice="auto")).constraint is None
    assert prepare(loaded_model, Turn(user, output_format=OutputFormat("json_object"))).constraint is not None
    schema = OutputFormat("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert prepare(loaded_model, Turn(user, output_format=schema)).constraint is not None


def test_bad_tool_choice_and_bad_schema_name_their_param(loaded_model):
    user = (Message("user", "hi"),)
    with pytest.raises(PrepareError) as e:
        prepare(loaded_model, Turn(user, tools=(WEATHER,), tool_choice="nope"))
    assert e.value.param == "tool_choice"
    with pytest.raises(PrepareError) as e:
        prepare(loaded_model, Turn(user, output_format=OutputFormat("json_schema", {"type": "objectx"})))
    assert e.value.param == "response_format"


def test_without_parallel_calls_only_the_first_call_is_read(loaded_model):
    user = (Message("user", "hi"),)
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call>')
    for parallel, cities in ((True, ["A", "B"]), (False, ["A"])):
        parser = prepare(loaded_model, Turn(user, tools=(WEATHER,), parallel_tool_calls=parallel)).parser()
        calls = [e.call for e in parser.feed(two) + parser.close() if isinstance(e, ToolCallEnd)]
        assert [json.loads(c.arguments)["city"] for c in calls] == cities
