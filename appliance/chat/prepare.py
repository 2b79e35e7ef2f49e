"""Renders a Turn into prompt tokens and picks the parser for the model's output.

Tools go through the chat template when it takes a `tools` variable; otherwise they are
described in the system message by `FALLBACK_TOOL_PROMPT` (Hermes-style `<tool_call>`
output), and earlier calls and results are written the same way. Either way the tools
sit at the start of the prompt and a conversation resent with one more turn renders to
a prefix of what it was, so its KV comes from the cache.

A forced call (`tool_choice` "required" or a function's name) or an output format other
than text is enforced by a grammar (`Prepared.constraint`); such an answer is asked for
without thinking, since the grammar applies from its first token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta

from appliance.cache.keys import DEFAULT_TENANT
from appliance.chat.grammar import Constraint, compile_constraint, format_grammar, special_token
from appliance.chat.reasoning import ReasoningParser, opens_thinking, template_thinks
from appliance.chat.streaming import OutputParser
from appliance.chat.tool_parsers import ToolFormat, tool_format
from appliance.chat.turn import Event, Message, Tool, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart, Turn
from appliance.models.loaded import LoadedModel

__all__ = ["FALLBACK_TOOL_PROMPT", "OutputParser", "PrepareError", "Prepared", "prepare"]

FALLBACK_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class PrepareError(ValueError):
    """A turn the model cannot take; `param` names the request field at fault."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Prepared:
    prompt_tokens: tuple[int, ...]
    constraint: Constraint | None = None  # the grammar the answer must follow, or None
    tool_format: ToolFormat | None = None  # how calls are read; None: the answer is text
    tools: tuple[Tool, ...] = ()
    reasoning: bool = False  # the answer may start with <think>...</think>
    reasoning_open: bool = False  # the prompt itself opened <think>
    parallel_tool_calls: bool = True  # False: calls after the first are dropped

    def parser(self) -> OutputParser:
        inner = self.tool_format.parser(self.tools) if self.tool_format else OutputParser()
        if not self.parallel_tool_calls:
            inner = FirstCallOnly(inner)
        return ReasoningParser(inner, started=self.reasoning_open) if self.reasoning else inner


class FirstCallOnly(OutputParser):
    """Passes on everything but the calls after the first (`parallel_tool_calls` false)."""

    def __init__(self, inner: OutputParser):
        self.inner = inner

    def feed(self, text: str) -> list[Event]:
        return self._first(self.inner.feed(text))

    def close(self) -> list[Event]:
        return self._first(self.inner.close())

    @staticmethod
    def _first(events: list[Event]) -> list[Event]:
        return [e for e in events if not (isinstance(e, CALL_EVENTS) and e.index > 0)]


CALL_EVENTS = (ToolCallStart, ToolCallDelta, ToolCallEnd)


def prepare(loaded: LoadedModel, turn: Turn, *, tenant: str = DEFAULT_TENANT) -> Prepared:
    """Returns the turn's prompt tokens, rendered by the model's chat template, and how to
    read its answer. Raises PrepareError (a ValueError) when the template rejects the
    conversation or a schema cannot be compiled. `tenant`: the request's KV tenant, whose
    recent prompts' pieces the encoding may reuse (models/pieces.py)."""
    template = chat_template(loaded, tools=bool(turn.tools))
    variables = template_variables(template)
    fmt = tool_format(template)
    native = "tools" in variables
    forced = bool(turn.tools) and turn.tool_choice not in ("auto", "none")
    grammar = call_grammar(loaded, fmt, turn) if forced else format_grammar(turn.output_format)
    kwargs: dict[str, Any] = {}
    if turn.tools and native:
        kwargs["tools"] = [tool_dict(t) for t in turn.tools]
    thinking = False if grammar else turn.thinking
    if thinking is not None:
        kwargs.update({k: thinking for k in ("enable_thinking", "thinking") if k in variables})
    messages = [message_dict(m, native=native) for m in turn.messages]
    if not native:
        messages = fallback_messages(messages, turn.tools)
    if isinstance(loaded.tokenizer.chat_template, dict):  # name the variant chosen above
        kwargs["chat_template"] = template
    text = render(loaded, messages, kwargs)
    constraint = None
    if grammar:
        try:
            constraint = compile_constraint(loaded, grammar)
        except ValueError as e:
            raise PrepareError(f"cannot enforce this schema: {e}",
                               param="tools" if forced else "response_format") from None
    calls = bool(turn.tools) and turn.tool_choice != "none"
    reasoning = template_thinks(template) and grammar is None
    return Prepared(prompt_tokens=tuple(loaded.encode(text, tenant=tenant)), constraint=constraint,
                    tool_format=fmt if calls else None, tools=turn.tools,
                    reasoning=reasoning, reasoning_open=reasoning and opens_thinking(text),
                    parallel_tool_calls=turn.parallel_tool_calls)


def chat_template(loaded: LoadedModel, *, tools: bool) -> str:
    """Returns the template's source (its `tool_use` variant for a turn with tools)."""
    source = loaded.tokenizer.chat_template
    if isinstance(source, dict):
        return source.get("tool_use" if tools else "default") or source.get("default") or ""
    return source or ""


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """Returns the variables a template reads from its context (`tools`, `enable_thinking`)."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:  # a tag of HF's own ({% generation %}): look for the names
        return frozenset(name for name in ("tools", "enable_thinking", "thinking")
                         if re.search(rf"\b{name}\b", template))


def render(loaded: LoadedModel, messages: list[dict], kwargs: dict) -> str:
    """Returns the prompt text. A template that rejects `system` messages after the first
    gets them as user messages instead."""
    apply = loaded.tokenizer.apply_chat_template
    try:
        try:
            return apply(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:
            if not any(m["role"] == "system" for m in messages[1:]):
                raise
            moved = messages[:1] + [{**m, "role": "user"} if m["role"] == "system" else m for m in messages[1:]]
            return apply(moved, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:
        raise PrepareError(f"the chat template rejected these messages: {e}", param="messages") from None


def call_grammar(loaded: LoadedModel, fmt: ToolFormat, turn: Turn) -> str:
    """Returns the grammar of a forced call: of any tool ("required"), or the named one."""
    tools = turn.tools
    if turn.tool_choice != "required":
        tools = tuple(t for t in tools if t.name == turn.tool_choice)
        if not tools:
            raise PrepareError(f"tool_choice names {turn.tool_choice!r}, which is not in tools",
                               param="tool_choice")
    return fmt.grammar(tools, parallel=turn.parallel_tool_calls,
                       token_of=lambda text: special_token(loaded, text))


# --- messages ----------------------------------------------------------------------------------


def tool_dict(tool: Tool) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def arguments_value(call: ToolCall) -> Any:
    """Returns a call's arguments as an object, as templates expect (text if not JSON)."""
    try:
        return json.loads(call.arguments or "{}")
    except ValueError:
        return call.arguments


def message_dict(m: Message, *, native: bool) -> dict[str, Any]:
    """Returns a message as chat templates take it (HF's conventions)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls and native:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": arguments_value(c)}}
                             for c in m.tool_calls]
    elif m.tool_calls:
        written = "\n".join(fallback_call(c) for c in m.tool_calls)
        out["content"] = f"{m.content}\n{written}" if m.content else written
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    if m.reasoning and native:
        out["reasoning_content"] = m.reasoning
    return out


def fallback_call(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": arguments_value(call)})
    return f"<tool_call>\n{body}\n</tool_call>"


def fallback_messages(messages: list[dict], tools: tuple[Tool, ...]) -> list[dict]:
    """Returns the messages for a template without tools: the tool prompt in the (first)
    system message, and each run of tool results as one user message of
    `<tool_response>` blocks."""
    out: list[dict] = []
    for m in messages:
        if m["role"] != "tool":
            out.append(m)
            continue
        block = f"<tool_response>\n{m['content']}\n</tool_response>"
        if out and out[-1].get("tool_results"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "tool_results": True})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        prompt = FALLBACK_TOOL_PROMPT.format(tools="\n".join(json.dumps(tool_dict(t)) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
