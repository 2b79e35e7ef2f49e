"""Grammars on the real model's tokenizer: every tool-call format's forcing grammar
accepts what that format's parser reads, and a constrained row shares a batch with a
plain one without changing it."""

from __future__ import annotations

import json

import pytest
from mlx_lm.generate import StopSequences

from appliance.chat.grammar import compile_constraint, format_grammar, special_token
from appliance.chat.prepare import prepare
from appliance.chat.tool_parsers import DeepSeek, Hermes, Llama3, Mistral, QwenCoder
from appliance.chat.turn import Message, OutputFormat, Tool, ToolCallEnd, Turn
from appliance.engine.sampling import GREEDY
from appliance.engine.scheduler import Scheduler

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})
CLOCK = Tool("get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}})
TOOLS = (WEATHER, CLOCK)

# Each format's output for get_weather(city="Oslo") then get_time(zone="CET"), as the
# grammar writes it (json.dumps' layout).
WRITTEN = {
    "hermes": (Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    "llama3": (Llama3(), '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                         '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    "mistral": (Mistral(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                           '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    "mistral_v11": (Mistral(args_tag=True), '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
                                            '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'),
    "deepseek": (DeepSeek(), '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                             '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                             'get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v31": (DeepSeek(v31=True), '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                                         '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
                                         '<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "qwen3_coder": (QwenCoder(), '<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n'
                                 '</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n'
                                 'CET\n</parameter>\n</function>\n</tool_call>'),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_each_format_grammar_accepts_what_its_parser_reads(loaded_model, name):
    fmt, written = WRITTEN[name]
    grammar = fmt.grammar(TOOLS, parallel=True, token_of=lambda t: special_token(loaded_model, t))
    matcher = compile_constraint(loaded_model, grammar).processor().matcher
    assert matcher.consume_tokens(loaded_model.encode(written)), matcher.get_error()
    assert matcher.is_accepting()
    parser = fmt.parser(TOOLS)
    calls = [e.call for e in parser.feed(written) + parser.close() if isinstance(e, ToolCallEnd)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                  ("get_time", {"zone": "CET"})]


def test_one_call_only_without_parallel_calls(loaded_model):
    grammar = Hermes().grammar(TOOLS, parallel=False, token_of=lambda t: None)
    matcher = compile_constraint(loaded_model, grammar).processor().matcher
    assert matcher.consume_tokens(loaded_model.encode(WRITTEN["hermes"][1].split("\n<tool_call>")[0]))
    assert matcher.is_accepting() and not matcher.consume_tokens(loaded_model.encode("\n<tool_call>"))


def decode(loaded, rows: list[tuple[list[int], list]], max_tokens: int = 24) -> list[list[int]]:
    scheduler = Scheduler(loaded.model, chunk_tokens=1024)
    uids = [scheduler.insert(prompt, max_tokens=max_tokens, cache=None, cached_tokens=[], sampler=GREEDY,
                             processors=processors,
                             stop=StopSequences([[t] for t in sorted(loaded.eos_token_ids)]))
            for prompt, processors in rows]
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while len(scheduler):
        for g in scheduler.step()[1]:
            if g.token not in loaded.eos_token_ids:
                out[g.uid].append(g.token)
            if g.finish_reason is not None:
                scheduler.remove(g.uid, keep_cache=False)
    return [out[uid] for uid in uids]


def test_constrained_and_plain_rows_share_a_batch(loaded_model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    constraint = compile_constraint(loaded_model, format_grammar(OutputFormat("json_schema", schema)))
    prompt = list(prepare(loaded_model, Turn((Message("user", "Which city is the capital of France?"),)))
                  .prompt_tokens)
    [alone] = decode(loaded_model, [(prompt, [])])
    plain, constrained = decode(loaded_model, [(prompt, []), (prompt, [constraint.processor()])], 40)
    assert plain[:len(alone)] == alone  # the plain row is not touched by its neighbour's mask
    assert set(json.loads(loaded_model.tokenizer.decode(constrained))) == {"city"}
