"""The two OpenAI response shapes (chat and text completions), whole and as stream chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from appliance.chat.streaming import OutputParser
from appliance.chat.turn import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from appliance.engine.request import Delta, RequestStats, TokenLogprob


def usage(stats: RequestStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


@dataclass
class Shape:
    """What differs between /v1/chat/completions and /v1/completions."""

    model: str
    decode: Any  # token id -> text, for logprobs
    id_prefix: str = "cmpl"
    object: str = "text_completion"
    chunk_object: str = "text_completion"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"

    def envelope(self, object: str, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": "omlx", "choices": choices, **extra}

    def chunk(self, choices: list, **extra: Any) -> dict:
        return self.envelope(self.chunk_object, choices, **extra)

    def whole(self, deltas: list[Delta], reason: str, stats: RequestStats, *, prefix: str = "") -> dict:
        text = prefix + "".join(d.text for d in deltas)
        logprobs = [lp for d in deltas for lp in d.logprobs]
        return self.envelope(self.object, [self.final_choice(text, logprobs, reason)], usage=usage(stats))

    # --- text completions ---------------------------------------------------------------

    def start_choices(self) -> list:
        return []

    def delta_choices(self, delta: Delta) -> list[dict]:
        """Returns the stream choices one engine delta makes (none if it holds nothing to send)."""
        return [self.delta_choice(delta)] if delta.text or delta.logprobs else []

    def finish_choices(self, reason: str) -> list[dict]:
        return [self.finish_choice(reason)]

    def delta_choice(self, delta: Delta) -> dict:
        return {"index": 0, "text": delta.text, "logprobs": self.logprobs(delta.logprobs),
                "finish_reason": None}

    def finish_choice(self, reason: str) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

    def final_choice(self, text: str, logprobs: list[TokenLogprob], reason: str) -> dict:
        return {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": reason}

    def logprobs(self, items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict | None:
        if not items:
            return None
        tokens = [self.decode(lp.token_id) for lp in items]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self.decode(t): v for t, v in lp.top} for lp in items],
            "text_offset": offsets,
        }


@dataclass
class ChatShape(Shape):
    """Chat answers: the model's text goes through the request's parser, whose events
    become `content`, `reasoning_content` and `tool_calls`."""

    id_prefix: str = "chatcmpl"
    object: str = "chat.completion"
    chunk_object: str = "chat.completion.chunk"
    parser: OutputParser = field(default_factory=OutputParser)
    num_tool_calls: int = 0

    def start_choices(self) -> list:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def delta_choices(self, delta: Delta) -> list[dict]:
        events = self.parser.feed(delta.text) if delta.text else []
        choices = [self.event_choice(e) for e in events]
        choices = [c for c in choices if c is not None]
        if delta.logprobs:
            if not choices:
                choices = [{"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}]
            choices[0]["logprobs"] = self.logprobs(delta.logprobs)
        return choices

    def finish_choices(self, reason: str) -> list[dict]:
        choices = [c for c in map(self.event_choice, self.parser.close()) if c is not None]
        return choices + [self.finish_choice(reason)]

    def event_choice(self, event: Event) -> dict | None:
        """Returns the stream choice of one parser event, in OpenAI's delta shapes."""
        if isinstance(event, TextDelta):
            delta: dict = {"content": event.text}
        elif isinstance(event, ReasoningDelta):
            delta = {"reasoning_content": event.text}
        elif isinstance(event, ToolCallStart):
            self.num_tool_calls += 1
            delta = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                     "function": {"name": event.name, "arguments": ""}}]}
        elif isinstance(event, ToolCallDelta):
            delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
        else:
            return None
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.num_tool_calls else reason

    def finish_choice(self, reason: str) -> dict:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason(reason)}

    def whole(self, deltas: list[Delta], reason: str, stats: RequestStats, *, prefix: str = "") -> dict:
        events = [e for d in deltas if d.text for e in self.parser.feed(d.text)] + self.parser.close()
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls = [e.call for e in events if isinstance(e, ToolCallEnd)]
        self.num_tool_calls = len(calls)
        message: dict = {"role": "assistant", "content": text if text.strip() or not calls else None,
                         "refusal": None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        logprobs = [lp for d in deltas for lp in d.logprobs]
        choice = {"index": 0, "message": message, "logprobs": self.logprobs(logprobs),
                  "finish_reason": self.finish_reason(reason)}
        return self.envelope(self.object, [choice], usage=usage(stats))

    def logprobs(self, items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict | None:
        if not items:
            return None
        return {"content": [self._entry(lp.token_id, lp.logprob, lp.top) for lp in items],
                "refusal": None}

    def _entry(self, token_id: int, logprob: float, top: tuple = ()) -> dict:
        text = self.decode(token_id)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        entry["top_logprobs"] = [
            {"token": (t := self.decode(i)), "logprob": v, "bytes": list(t.encode())} for i, v in top
        ]
        return entry
