"""What a tool-call format is (`ToolFormat`: a parser and a forcing grammar), and the
pieces its grammars are built from. The formats themselves are in `tool_parsers`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from appliance.chat.streaming import OutputParser
from appliance.chat.turn import Tool

# A tag's single special token id in the model's vocabulary, or None: a grammar must
# name special tokens by id (llguidance's `<[id]>`), their text would not match them.
TokenOf = Callable[[str], "int | None"]

def schema(tool: Tool) -> dict[str, Any]:
    return tool.parameters or {"type": "object", "properties": {}}


def literal(text: str, token_of: TokenOf) -> str:
    token = token_of(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def call_object(tools: tuple[Tool, ...], args_key: str) -> dict[str, Any]:
    """Returns the schema of one call object `{"name": ..., args_key: {...}}` of any tool."""
    return {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.name}, args_key: schema(t)},
        "required": ["name", args_key],
        "additionalProperties": False,
    } for t in tools]}


NEWLINE, SEMICOLON = '"\\n"', '"; "'  # separators between calls, as lark strings


def repeated(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({separator} {item})*" if parallel else item


class ToolFormat:
    name = ""

    def parser(self, tools: tuple[Tool, ...]) -> OutputParser:
        raise NotImplementedError

    def grammar(self, tools: tuple[Tool, ...], *, parallel: bool, token_of: TokenOf) -> str:
        """Returns a lark grammar whose every sentence is one call (or several, if
        `parallel`) of `tools`, in this format."""
        raise NotImplementedError
