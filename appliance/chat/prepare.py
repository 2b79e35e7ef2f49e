"""Renders a Turn into prompt tokens and picks the parser for the model's output.

First version: plain text only (no tools, no output format, no thinking). The tool,
structured-output and reasoning work replaces the insides; the signatures stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.chat.turn import Event, TextDelta, Turn
from appliance.models.loaded import LoadedModel


class OutputParser:
    """Turns the model's streamed text into events; one parser per request."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def close(self) -> list[Event]:
        """Returns what is left once the model has stopped."""
        return []


@dataclass(frozen=True)
class Prepared:
    prompt_tokens: tuple[int, ...]
    constraint: Any = None  # a logits constraint for the engine (structured output), or None

    def parser(self) -> OutputParser:
        return OutputParser()


def prepare(loaded: LoadedModel, turn: Turn) -> Prepared:
    """Returns the turn's prompt tokens, rendered by the model's chat template, and how to
    read its answer. Raises ValueError when the template rejects the conversation."""
    messages = [{"role": m.role, "content": m.content} for m in turn.messages]
    return Prepared(prompt_tokens=tuple(loaded.encode_chat(messages)))
