"""The two OpenAI response shapes (chat and text completions), whole and as stream chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

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
    id_prefix: str = "chatcmpl"
    object: str = "chat.completion"
    chunk_object: str = "chat.completion.chunk"

    def start_choices(self) -> list:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def delta_choice(self, delta: Delta) -> dict:
        return {"index": 0, "delta": {"content": delta.text}, "logprobs": self.logprobs(delta.logprobs),
                "finish_reason": None}

    def finish_choice(self, reason: str) -> dict:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}

    def final_choice(self, text: str, logprobs: list[TokenLogprob], reason: str) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": self.logprobs(logprobs), "finish_reason": reason}

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
