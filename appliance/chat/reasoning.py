"""Reasoning: `<think>...</think>` at the start of an answer, streamed as ReasoningDelta;
what follows goes to the answer's own parser (text, tool calls)."""

from __future__ import annotations

from appliance.chat.streaming import OutputParser, split_at
from appliance.chat.turn import Event, ReasoningDelta

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    """Returns whether a chat template's model writes `<think>` blocks."""
    return CLOSE in (template or "")


def opens_thinking(prompt_text: str) -> bool:
    """Returns whether a rendered prompt ends inside an open `<think>` (templates that
    start the answer's reasoning themselves, such as DeepSeek-R1's and QwQ's)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ReasoningParser(OutputParser):
    """Splits reasoning from the answer. The block is recognised only at the start
    (after spaces), or from the first token when the prompt opened it; text after
    `</think>` (its leading newlines dropped) is passed to `inner`."""

    def __init__(self, inner: OutputParser, *, started: bool = False):
        self.inner = inner
        self._state = "reasoning" if started else "start"  # start | reasoning | answer
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        if self._state == "answer":
            return self._answer(text)
        self._buf += text
        if self._state == "start":
            rest = self._buf.lstrip()
            if rest.startswith(OPEN):
                self._buf, self._state = rest[len(OPEN):], "reasoning"
            elif OPEN.startswith(rest):
                return []  # may still become <think>
            else:
                self._state, rest = "answer", self._buf
                self._buf = ""
                return self.inner.feed(rest)
        before, after = split_at(self._buf, CLOSE)
        events: list[Event] = [ReasoningDelta(before.lstrip() if self._at_start else before)] if before else []
        if events and not events[0].text:
            events = []
        self._at_start = self._at_start and not events
        if after is None:
            self._buf = self._buf[len(before):]
            return events
        self._buf, self._state = "", "answer"
        self._leading = True
        return events + self._answer(after)

    _at_start = True  # nothing of the reasoning sent yet: its leading newline is dropped
    _leading = False  # right after </think>: the answer's leading newlines are dropped

    def _answer(self, text: str) -> list[Event]:
        if self._leading:
            text = text.lstrip("\n")
            if not text:
                return []
            self._leading = False
        return self.inner.feed(text)

    def close(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":  # cut off while thinking: the held tail is reasoning
            return [ReasoningDelta(rest)] if rest else []
        if self._state == "start" and rest:
            return self.inner.feed(rest) + self.inner.close()
        return self.inner.close()
