"""Tool-call formats: how a model writes its calls, read incrementally from its streamed
text into events, and the grammar that forces a call (`tool_choice` required or named).

One class per format, chosen from the model's chat template by `tool_format`:

| format        | the model writes                                                          |
|---------------|---------------------------------------------------------------------------|
| `hermes`      | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3; the fallback) |
| `qwen3_coder` | `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>` |
| `llama3`      | `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`, `;` between calls |
| `mistral`     | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]NAME[ARGS]{...}` |
| `deepseek`    | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments |

Text outside the calls comes out as TextDelta at once, held back only while it may be
the start of a tag.
"""

from __future__ import annotations

import json
import re
from typing import Any

from appliance.chat.call_format import NEWLINE, SEMICOLON, TokenOf, ToolFormat, call_object, literal, repeated, schema
from appliance.chat.grammar import json_rule
from appliance.chat.streaming import JsonCall, ObjectEnd, OutputParser, call_id, split_at
from appliance.chat.turn import Event, TextDelta, Tool, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart

# --- Hermes / Qwen -------------------------------------------------------------------------


class TaggedJsonCalls(OutputParser):
    """Calls as JSON objects between a start and an end tag, text around them."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>"):
        self.start, self.end = start, end
        self._buf = ""
        self._call: JsonCall | None = None
        self._index = 0
        self._opened = False  # after a start tag, before the object's brace
        self._closing = False  # after a call's object, before its end tag

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if self._opened:
                rest = self._buf.lstrip()
                if not rest:
                    break
                self._opened = False
                if rest.startswith("{"):
                    self._buf, self._call = rest, JsonCall(self._index)
                else:  # no JSON after the tag: it was text after all
                    events.append(TextDelta(self.start))
            elif self._call is not None:
                got, n = self._call.feed(self._buf)
                events += got
                self._buf = self._buf[n:]
                if not self._call.done:
                    break
                self._call, self._index, self._closing = None, self._index + 1, True
            elif self._closing:
                rest = self._buf.lstrip()
                if rest.startswith(self.end):
                    self._buf, self._closing = rest[len(self.end):], False
                elif self.end.startswith(rest):
                    break  # the end tag may still come
                else:
                    self._closing = False  # no end tag: read on as text
            else:
                before, after = split_at(self._buf, self.start)
                if after is None and self._index and not before.strip():
                    break  # spaces after a call: held until something else follows
                if before.strip() or not self._index:
                    events += [TextDelta(before)] if before else []
                if after is None:
                    self._buf = self._buf[len(before):]
                    break
                self._buf, self._opened = after, True
        return events

    def close(self) -> list[Event]:
        if self._call is not None:
            return self._call.finish()
        rest, self._buf = self._buf, ""
        if self._opened:
            return [TextDelta(self.start + rest)]
        if self._closing or (self._index and not rest.strip()):
            return []
        return [TextDelta(rest)] if rest else []


class Hermes(ToolFormat):
    name = "hermes"

    def parser(self, tools: tuple[Tool, ...]) -> OutputParser:
        return TaggedJsonCalls()

    def grammar(self, tools: tuple[Tool, ...], *, parallel: bool, token_of: TokenOf) -> str:
        call = f'{literal("<tool_call>", token_of)} "\\n" {json_rule(call_object(tools, "arguments"))} ' \
               f'"\\n" {literal("</tool_call>", token_of)}'
        return f'start: {repeated("call", NEWLINE, parallel)}\ncall: {call}\n'


# --- Llama 3 ---------------------------------------------------------------------------------

LLAMA_CALL_START = re.compile(r'\s*(<\|python_tag\|>)?\s*\{\s*"name"')


class Llama3Calls(OutputParser):
    """Llama 3.x JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`
    objects (after an optional `<|python_tag|>`, `;` between them), or plain text."""

    def __init__(self):
        self._buf = ""
        self._mode = "undecided"  # undecided | calls | text
        self._call: JsonCall | None = None
        self._index = 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._mode == "undecided":
            if LLAMA_CALL_START.match(self._buf):
                self._mode = "calls"
                self._buf = self._buf.replace("<|python_tag|>", "", 1)
            elif not self._may_start(self._buf):
                self._mode = "text"
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return [TextDelta(out)] if out else []
        return self._calls() if self._mode == "calls" else []

    @staticmethod
    def _may_start(text: str) -> bool:
        probe = re.sub(r"\s+", "", text.lstrip().replace("<|python_tag|>", "", 1))
        return '{"name"'.startswith(probe) or "<|python_tag|>".startswith(text.lstrip())

    def _calls(self) -> list[Event]:
        events: list[Event] = []
        while self._buf:
            if self._call is None:
                rest = self._buf.lstrip().lstrip(";").lstrip()
                if not rest:
                    self._buf = ""
                    break
                if not rest.startswith("{"):
                    self._mode, self._buf = "text", ""
                    return events + [TextDelta(rest)]
                self._buf, self._call = rest, JsonCall(self._index, args_keys=("parameters", "arguments"))
            got, n = self._call.feed(self._buf)
            events += got
            self._buf = self._buf[n:]
            if not self._call.done:
                break
            self._call, self._index = None, self._index + 1
        return events

    def close(self) -> list[Event]:
        if self._call is not None:
            return self._call.finish()
        rest, self._buf = self._buf, ""
        return [TextDelta(rest)] if rest and self._mode != "calls" else []


class Llama3(ToolFormat):
    name = "llama3"

    def parser(self, tools: tuple[Tool, ...]) -> OutputParser:
        return Llama3Calls()

    def grammar(self, tools: tuple[Tool, ...], *, parallel: bool, token_of: TokenOf) -> str:
        call = json_rule(call_object(tools, "parameters"))
        return f'start: {repeated("call", SEMICOLON, parallel)}\ncall: {call}\n'


# --- Mistral ---------------------------------------------------------------------------------


class MistralCalls(OutputParser):
    """`[TOOL_CALLS]` then a JSON list of calls (v0.3), or `NAME[ARGS]{...}` (v11 and
    later, one marker per call)."""

    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self):
        self._buf = ""
        self._state = "text"  # text | open | list | name | args
        self._call: JsonCall | None = None
        self._args: ObjectEnd | None = None
        self._index = 0
        self._id = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf and not self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """Advances one state; returns True when it needs more text."""
        if self._state == "text":
            before, after = split_at(self._buf, self.MARK)
            events += [TextDelta(before)] if before else []
            self._buf = self._buf[len(before):] if after is None else after
            self._state = "text" if after is None else "open"
            return after is None
        if self._state == "open":
            rest = self._buf.lstrip()
            if not rest:
                return True
            self._buf, self._state = rest, ("list" if rest.startswith("[") else "name")
            if self._state == "list":
                self._buf = rest[1:]
            return False
        if self._state == "list":
            if self._call is None:
                rest = self._buf.lstrip().lstrip(",").lstrip()
                if rest.startswith("]"):
                    self._buf, self._state = rest[1:], "text"
                    return False
                if not rest.startswith("{"):
                    self._buf = rest
                    return True
                self._buf, self._call = rest, JsonCall(self._index)
            got, n = self._call.feed(self._buf)
            events += got
            self._buf = self._buf[n:]
            if self._call.done:
                self._call, self._index = None, self._index + 1
                return False
            return True
        if self._state == "name":
            name, after = split_at(self._buf, self.ARGS)
            if after is None:
                return True
            self._id = call_id()
            events.append(ToolCallStart(self._index, self._id, name.strip()))
            self._name, self._buf, self._state, self._args = name.strip(), after, "args", ObjectEnd()
            self._written = ""
            return False
        end = self._args.feed(self._buf)  # state "args"
        part = self._buf if end is None else self._buf[:end]
        part = part if self._written else part.lstrip()
        if part:
            events.append(ToolCallDelta(self._index, part))
            self._written += part
        if end is None:
            self._buf = ""
            return True
        events.append(ToolCallEnd(self._index, ToolCall(self._id, self._name, self._written.strip() or "{}")))
        self._buf, self._state, self._index = self._buf[end:], "text", self._index + 1
        return False

    def close(self) -> list[Event]:
        if self._call is not None:
            return self._call.finish()
        if self._state == "args":
            self._buf = ""
            return [ToolCallEnd(self._index, ToolCall(self._id, self._name, self._written.strip() or "{}"))]
        rest, self._buf = self._buf, ""
        return [TextDelta(rest)] if rest and self._state == "text" else []


class Mistral(ToolFormat):
    name = "mistral"

    def __init__(self, *, args_tag: bool = False):
        self.args_tag = args_tag  # v11+: NAME[ARGS]{...}

    def parser(self, tools: tuple[Tool, ...]) -> OutputParser:
        return MistralCalls()

    def grammar(self, tools: tuple[Tool, ...], *, parallel: bool, token_of: TokenOf) -> str:
        mark = literal("[TOOL_CALLS]", token_of)
        if self.args_tag:
            alts = " | ".join(f'{json.dumps(t.name)} {literal("[ARGS]", token_of)} {json_rule(schema(t))}'
                              for t in tools)
            return f"start: {repeated('call', '', parallel)}\ncall: {mark} ({alts})\n"
        items: dict[str, Any] = {"type": "array", "items": call_object(tools, "arguments"), "minItems": 1}
        if not parallel:
            items["maxItems"] = 1
        return f"start: {mark} {json_rule(items)}\n"


# --- DeepSeek V3 / V3.1 ----------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_V3_CALL = re.compile(r"\s*function\s*" + DS_SEP + r"(?P<name>[^\n]+)\n```(?:json)?\s*(?P<args>.*?)\s*```\s*$", re.S)


class DeepSeekCalls(OutputParser):
    """DeepSeek's calls: each read whole between its begin and end tokens. V3 writes
    `function<sep>NAME` and the arguments in a json fence, V3.1 `NAME<sep>ARGS`."""

    def __init__(self):
        self._buf = ""
        self._inside = False  # between calls-begin and calls-end
        self._index = 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._inside:
                before, after = split_at(self._buf, DS_CALLS_BEGIN)
                events += [TextDelta(before)] if before else []
                if after is None:
                    self._buf = self._buf[len(before):]
                    return events
                self._buf, self._inside = after, True
            rest = self._buf.lstrip()
            if rest.startswith(DS_CALLS_END):
                self._buf, self._inside = rest[len(DS_CALLS_END):], False
                continue
            start, end = rest.find(DS_CALL_BEGIN), rest.find(DS_CALL_END)
            if start < 0 or end < 0:
                return events
            events += self._call(rest[start + len(DS_CALL_BEGIN):end])
            self._buf = rest[end + len(DS_CALL_END):]

    def _call(self, body: str) -> list[Event]:
        m = DS_V3_CALL.match(body)
        if m:
            name, args = m["name"].strip(), m["args"]
        else:
            name, _, args = body.partition(DS_SEP)
        events = call_events(self._index, name.strip(), args.strip() or "{}")
        self._index += 1
        return events

    def close(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        return [TextDelta(rest)] if rest and not self._inside else []


def call_events(index: int, name: str, arguments: str) -> list[Event]:
    """Returns the three events of a call read whole."""
    cid = call_id()
    return [ToolCallStart(index, cid, name), ToolCallDelta(index, arguments),
            ToolCallEnd(index, ToolCall(cid, name, arguments))]


class DeepSeek(ToolFormat):
    name = "deepseek"

    def __init__(self, *, v31: bool = False):
        self.v31 = v31

    def parser(self, tools: tuple[Tool, ...]) -> OutputParser:
        return DeepSeekCalls()

    def grammar(self, tools: tuple[Tool, ...], *, parallel: bool, token_of: TokenOf) -> str:
        lit = lambda s: literal(s, token_of)  # noqa: E731
        if self.v31:
            alts = [f"{json.dumps(t.name)} {lit(DS_SEP)} {json_rule(schema(t))}" for t in tools]
        else:
            alts = [f'"function" {lit(DS_SEP)} {json.dumps(t.name + chr(10) + "```json" + chr(10))} '
                    f'{json_rule(schema(t))} "\\n```"' for t in tools]
        return (f"start: {lit(DS_CALLS_BEGIN)} {repeated('call', '', parallel)} {lit(DS_CALLS_END)}\n"
                f"call: {lit(DS_CALL_BEGIN)} ({' | '.join(alts)}) {lit(DS_CALL_END)}\n")


# --- Qwen3-Coder -----------------------------------------------------------------------------

QC_FUNCTION = re.compile(r"<function=([^>\n]+)>")
QC_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class QwenCoderCalls(OutputParser):
    """Qwen3-Coder's XML-like calls; each parameter is sent once complete, converted to
    JSON by its type in the tool's schema (a string stays text)."""

    def __init__(self, tools: tuple[Tool, ...]):
        self._schemas = {t.name: schema(t).get("properties", {}) for t in tools}
        self._buf = ""
        self._inside = False
        self._index = 0
        self._name: str | None = None
        self._id = ""
        self._args: list[str] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._inside:
                before, after = split_at(self._buf, "<tool_call>")
                if before.strip() or not self._index:
                    events += [TextDelta(before)] if before else []
                if after is None:
                    self._buf = self._buf[len(before):]
                    return events
                self._buf, self._inside = after, True
            if self._name is None:
                m = QC_FUNCTION.search(self._buf)
                if not m:
                    return events
                self._name, self._id, self._args = m[1].strip(), call_id(), []
                events.append(ToolCallStart(self._index, self._id, self._name))
                self._buf = self._buf[m.end():]
            m = QC_PARAMETER.search(self._buf)
            end = self._buf.find("</function>")
            if m and (end < 0 or m.start() < end):
                events.append(self._parameter(m[1].strip(), m[2]))
                self._buf = self._buf[m.end():]
                continue
            if end < 0:
                return events
            events += self._end()
            _, after = split_at(self._buf[end:], "</tool_call>")
            if after is None:
                self._buf = ""
                return events
            self._buf, self._inside = after, False

    def _parameter(self, key: str, raw: str) -> ToolCallDelta:
        kind = self._schemas.get(self._name or "", {}).get(key, {}).get("type", "string")
        value: Any = raw
        if kind != "string":
            try:
                value = json.loads(raw)
            except ValueError:
                pass
        fragment = ("{" if not self._args else ", ") + json.dumps(key) + ": " + json.dumps(value)
        self._args.append(fragment)
        return ToolCallDelta(self._index, fragment)

    def _end(self) -> list[Event]:
        closing = "}" if self._args else "{}"
        arguments = "".join(self._args) + closing
        events = [ToolCallDelta(self._index, closing),
                  ToolCallEnd(self._index, ToolCall(self._id, self._name or "", arguments))]
        self._name, self._index = None, self._index + 1
        return events

    def close(self) -> list[Event]:
        if self._name is not None:
            return self._end()
        rest, self._buf = self._buf, ""
        return [TextDelta(rest)] if rest and not self._inside and (rest.strip() or not self._index) else []


class QwenCoder(ToolFormat):
    name = "qwen3_coder"

    def parser(self, tools: tuple[Tool, ...]) -> OutputParser:
        return QwenCoderCalls(tools)

    def grammar(self, tools: tuple[Tool, ...], *, parallel: bool, token_of: TokenOf) -> str:
        alts = []
        for t in tools:  # each parameter at most once, in the schema's order
            items = [f'"<function={t.name}>\\n"']
            items += [f'("<parameter={k}>\\n" VALUE "</parameter>\\n")?' for k in schema(t).get("properties", {})]
            alts.append(" ".join(items + ['"</function>"']))
        start, end = literal("<tool_call>", token_of), literal("</tool_call>", token_of)
        call = f'{start} "\\n" ({" | ".join(alts)}) "\\n" {end}'
        return (f'start: {repeated("call", NEWLINE, parallel)}\ncall: {call}\n'
                "VALUE: /[^<]+/\n")  # its last newline is the one before </parameter>


def tool_format(template: str | None) -> ToolFormat:
    """Returns the tool-call format a chat template's model writes; Hermes when the
    template shows none (the format the fallback tool prompt asks for)."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return QwenCoder()
    if "<tool_call>" in t:
        return Hermes()
    if "[TOOL_CALLS]" in t:
        return Mistral(args_tag="[ARGS]" in t)
    if "tool▁calls▁begin" in t:
        return DeepSeek(v31="function<｜tool▁sep｜>" not in t)
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t):
        return Llama3()
    return Hermes()
