"""Reasoning blocks split from the answer, over streamed text."""

from __future__ import annotations

import pytest

from appliance.chat.reasoning import ReasoningParser, opens_thinking, template_thinks
from appliance.chat.streaming import OutputParser
from appliance.chat.tool_parsers import Hermes
from appliance.chat.turn import ReasoningDelta, TextDelta, ToolCallEnd


def run(parser, text: str, size: int) -> list:
    events = []
    for i in range(0, len(text), size or len(text)):
        events += parser.feed(text[i:i + (size or len(text))])
    return events + parser.close()


def split(events) -> tuple[str, str]:
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, TextDelta)))


# Qwen3-8B with thinking on.
QWEN3 = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("size", [0, 1, 2, 5])
def test_think_block_becomes_reasoning(size):
    assert split(run(ReasoningParser(OutputParser()), QWEN3, size)) == (
        "The user wants 2+2. That is 4.\n", "The answer is 4.")


@pytest.mark.parametrize("size", [0, 1, 4])
def test_prompt_that_opened_think_starts_in_reasoning(size):
    # DeepSeek-R1's template ends the prompt with "<think>\n": the answer has only the close tag.
    out = "Let me count: 3 r's.\n</think>\n\nThere are three r's in strawberry."
    assert split(run(ReasoningParser(OutputParser(), started=True), out, size)) == (
        "Let me count: 3 r's.\n", "There are three r's in strawberry.")


def test_no_think_block_is_plain_text_from_the_first_characters():
    parser = ReasoningParser(OutputParser())
    assert parser.feed("<th") == []  # may still become <think>
    assert parser.feed("e answer") == [TextDelta("<the answer")]
    assert parser.close() == []


def test_reasoning_streams_before_the_close_tag():
    parser = ReasoningParser(OutputParser())
    assert parser.feed("<think>abc") == [ReasoningDelta("abc")]
    assert parser.feed("de</thi") == [ReasoningDelta("de")]
    assert parser.feed("nk>ok") == [TextDelta("ok")]


def test_reasoning_then_a_tool_call():
    out = '<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>'
    events = run(ReasoningParser(Hermes().parser(())), out, 3)
    assert split(events) == ("I need the weather.", "")
    assert [e.call.name for e in events if isinstance(e, ToolCallEnd)] == ["w"]


def test_cut_off_while_thinking_keeps_the_reasoning():
    assert split(run(ReasoningParser(OutputParser()), "<think>still going</th", 3)) == ("still going</th", "")


def test_template_detection():
    assert template_thinks("{% if enable_thinking %}<think>\n\n</think>{% endif %}")
    assert not template_thinks("<|im_start|>{{ m.content }}<|im_end|>")
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
