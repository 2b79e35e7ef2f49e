"""Pieces the output parsers share: tag search over streamed text, call ids, and one
tool call's JSON object read as it streams."""

from __future__ import annotations

import json
import uuid

from appliance.chat.turn import Event, TextDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart


class OutputParser:
    """Turns the model's streamed text into events; one parser per request. This one
    passes text through: the parser of an answer with no tools and no reasoning."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def close(self) -> list[Event]:
        """Returns what is left once the model has stopped."""
        return []


def call_id() -> str:
    """Returns a fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, tag: str) -> int:
    """Returns the length of the longest suffix of `text` that is a proper prefix of
    `tag`: the characters to hold back, since the next chunk may complete the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_at(text: str, tag: str) -> tuple[str, str | None]:
    """Returns (text safe to emit, what follows `tag`, or None if it is not there yet).
    Without the tag, the emitted part stops before a possible start of it."""
    at = text.find(tag)
    if at >= 0:
        return text[:at], text[at + len(tag):]
    return text[:len(text) - held_prefix(text, tag)], None


def normalized_arguments(value: str) -> str:
    """Returns a call's arguments as JSON object text: an object as written, a
    JSON-encoded string decoded, nothing as `{}`."""
    value = value.strip()
    if not value:
        return "{}"
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if isinstance(parsed, str):
        return parsed
    return value


class ObjectEnd:
    """Finds where one JSON value that starts with a bracket ends, over streamed text."""

    def __init__(self):
        self.depth = 0
        self.started = False
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int | None:
        """Returns the index just past the value's closing bracket in `text`, or None."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self.depth += 1
                self.started = True
            elif c in "}]":
                self.depth -= 1
                if self.started and self.depth <= 0:
                    return i + 1
        return None


class JsonCall:
    """One tool call written as a JSON object, `{"name": ..., <args key>: {...}}`, read
    as it streams: the start is announced once the name is known, and the arguments
    object is passed on fragment by fragment. Stops at the object's closing brace."""

    def __init__(self, index: int, *, args_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.index = index
        self.args_keys = args_keys
        self.done = False
        self.started = False
        self.name: str | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._member = "key"  # key | colon | value, at depth 1
        self._key_chars: list[str] = []
        self._key = ""
        self._value: list[str] = []
        self._args: list[str] = []
        self._args_string = False  # arguments written as a JSON-encoded string
        self._streamed = 0  # characters of _args already sent

    def feed(self, text: str) -> tuple[list[Event], int]:
        """Returns the events `text` completes and how many of its characters belong to
        the call (all of them, or up to its closing brace)."""
        events: list[Event] = []
        for i, c in enumerate(text):
            self._char(c, events)
            if self.done:
                return events + self._flush(), i + 1
        return events + self._flush(), len(text)

    def finish(self) -> list[Event]:
        """Returns the events that end the call, complete or cut off."""
        if self.done:
            return []
        if self.name is None:
            self.name = ""
        events = self._start() + self._flush()
        written = "".join(self._args).rstrip()
        if self._args_string or not written:
            arguments = normalized_arguments(written)
            events.append(ToolCallDelta(self.index, arguments))
        else:
            arguments = written
        events.append(ToolCallEnd(self.index, ToolCall(self._id, self.name, arguments)))
        self.done = True
        return events

    # --- the scanner ----------------------------------------------------------------------

    def _char(self, c: str, events: list[Event]) -> None:
        depth = self._depth
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
            if depth == 1 and self._member == "key":
                if self._in_string:
                    self._key_chars.append(c)
                else:
                    self._key, self._key_chars, self._member = "".join(self._key_chars), [], "colon"
                return
            self._value_char(c)
            return
        if depth == 0:
            if c == "{":
                self._depth = 1
            return
        if depth == 1 and c in ",}":
            if self._member == "value":
                self._end_value(events)
            self._member = "key"
            if c == "}":
                self._depth = 0
                self._finish_object(events)
            return
        if depth == 1 and self._member == "colon":
            if c == ":":
                self._member = "value"
            return
        if c == '"':
            self._in_string = True
            if depth == 1 and self._member == "key":
                return
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
        self._value_char(c)

    def _value_char(self, c: str) -> None:
        if self._member != "value":
            return
        if self._key in self.args_keys:
            if not self._args and c.isspace():
                return
            if not self._args and c == '"':
                self._args_string = True
            self._args.append(c)
        else:
            self._value.append(c)

    def _end_value(self, events: list[Event]) -> None:
        if self._key == "name" and self.name is None:
            try:
                name = json.loads("".join(self._value))
            except ValueError:
                name = "".join(self._value).strip().strip('"')
            self.name = str(name)
            events += self._start()
        self._value = []

    def _start(self) -> list[Event]:
        if self.started or self.name is None:
            return []
        self._id = call_id()
        self.started = True
        return [ToolCallStart(self.index, self._id, self.name)]

    def _finish_object(self, events: list[Event]) -> None:
        events += self.finish()

    def _flush(self) -> list[Event]:
        """Returns the arguments written since the last flush, but for trailing spaces."""
        if not self.started or self._args_string or self.done:
            return []
        text = "".join(self._args).rstrip()[self._streamed:]
        if not text:
            return []
        self._streamed += len(text)
        return [ToolCallDelta(self.index, text)]
