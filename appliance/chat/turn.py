"""A chat turn in API-neutral form, and the typed events its output is parsed into.

The three chat APIs (OpenAI chat, Anthropic Messages, OpenAI Responses) each convert
their request body into one `Turn`, let `appliance.chat.prepare` render it into prompt
tokens (with tools, the output format and thinking), and turn the engine's text into
`Event`s with the `OutputParser` that `prepare` chose for the model's template. Each API
then only maps events to its own wire shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments as JSON object text


@dataclass(frozen=True)
class OutputFormat:
    """What the answer's text must be: free text, any JSON object, or JSON matching `schema`."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None


TEXT = OutputFormat()

# "auto" | "none" | "required", or the name of the one function that must be called.
ToolChoice = str


@dataclass(frozen=True)
class Message:
    """One message in OpenAI chat roles: system, user, assistant or tool."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this is the result of
    name: str | None = None  # tool: the function's name
    reasoning: str | None = None  # assistant: its thinking, when echoed back


@dataclass(frozen=True)
class Turn:
    """Everything a chat request asks of the model, whatever API it came through."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    output_format: OutputFormat = TEXT
    thinking: bool | None = None  # None: the template's default


# Events, in the order the model produced them.
@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... within this answer
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # the next fragment of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall  # the whole call, arguments complete


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd
