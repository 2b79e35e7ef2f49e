"""OpenAI request bodies: parsed, validated, and turned into a GenerationRequest.

Unknown fields are ignored (clients send many); known fields with bad values are a 400
that names the parameter (`tools`, `tool_choice` and `response_format` included).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from appliance.cache.model_cache import request_tenant
from appliance.chat.turn import TEXT, OutputFormat, Tool, ToolCall, Turn
from appliance.chat.turn import Message as ChatMessage
from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.models.loaded import LoadedModel
from appliance.server.errors import bad_request
from appliance.server.limits import check_tokens, default_tokens
from appliance.spec import ModelSpec

MAX_STOPS = 16


API_TEMPERATURE = 1.0  # OpenAI's and Anthropic's default


def temperature(asked: float | None, model: ModelSpec) -> float:
    """Returns the temperature a request samples at: its own, else its model's
    `default_temperature`, else the APIs' default."""
    if asked is not None:
        return asked
    return API_TEMPERATURE if model.default_temperature is None else model.default_temperature


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Lenient):
    include_usage: bool = False


class CommonParams(Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: the model's default_temperature
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    logit_bias: dict[int, float] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's name: requests with different salts never share cached KV (tenant isolation).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, model: ModelSpec) -> SamplingParams:
        return SamplingParams(
            temperature=temperature(self.temperature, model), top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
        )


class ContentPart(Lenient):
    type: str
    text: str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str = "{}"


class ToolCallParam(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant, echoed back

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        unsupported = sorted({p.type for p in self.content if p.type != "text"})
        if unsupported:
            raise ValueError(f"content parts of type {', '.join(unsupported)} are not supported")
        return "".join(p.text or "" for p in self.content)


class FunctionDef(Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaParam(Lenient):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaParam | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self

    def output_format(self) -> OutputFormat:
        if self.type == "json_schema" and self.json_schema is not None:
            return OutputFormat("json_schema", schema=self.json_schema.schema_, name=self.json_schema.name)
        return OutputFormat(self.type)


class ChatParams(CommonParams):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolParam] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None  # "none": thinking off; other values keep the template's default

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_value(cls, v: Any) -> Any:
        # Checked here so that an error names `tool_choice`, not a branch of the union.
        if v is None or v in ("auto", "none", "required"):
            return v
        try:
            return NamedToolChoice.model_validate(v)
        except ValidationError:
            raise ValueError('must be "auto", "none", "required" or '
                             '{"type": "function", "function": {"name": ...}}') from None

    def turn(self) -> Turn:
        """Returns the request as an API-neutral Turn; raises a 400 naming a bad message
        part or a tool_choice that does not fit the tools."""
        return Turn(messages=tuple(self._message(i, m) for i, m in enumerate(self.messages)),
                    tools=tuple(Tool(t.function.name, t.function.description,
                                     t.function.parameters or {"type": "object", "properties": {}})
                                for t in self.tools or ()),
                    tool_choice=self._tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
                    output_format=self.response_format.output_format() if self.response_format else TEXT,
                    thinking=False if self.reasoning_effort == "none" else None)

    def _tool_choice(self) -> str:
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return choice or "auto"
        if not self.tools:
            raise bad_request("tool_choice requires tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                                  param="tool_choice")
            return choice.function.name
        return choice

    @staticmethod
    def _message(i: int, m: Message) -> ChatMessage:
        try:
            text = m.text()
        except ValueError as e:
            raise bad_request(str(e), param=f"messages[{i}].content") from None
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
        role = "system" if m.role == "developer" else m.role
        return ChatMessage(role, text, tool_calls=calls, tool_call_id=m.tool_call_id,
                           name=m.name if m.role == "tool" else None, reasoning=m.reasoning_content)


class CompletionParams(CommonParams):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Returns the validated body; raises a 400 ApiError naming the bad parameter."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "missing":
            message = f"missing required parameter: {param}"
        else:
            message = f"invalid value for {param}: {err['msg']}"
        raise bad_request(message, param=param, code="invalid_value") from None


def generation_request(params: CommonParams, prompt: list[int], loaded: LoadedModel, *,
                       max_tokens: int | None, top_logprobs: int | None,
                       prompt_param: str = "messages", trim_leading_space: bool = True,
                       constraint: Any = None) -> GenerationRequest:
    """Returns the engine request; raises 400 for an empty or over-long prompt, or one over
    the server's [limits]."""
    if not prompt:
        raise bad_request("the prompt is empty", param=prompt_param)
    check_tokens(prompt_tokens=len(prompt), max_tokens=max_tokens, param=prompt_param)
    context = loaded.context_tokens
    if len(prompt) >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your "
            f"prompt has {len(prompt)} tokens. Please reduce the length of the prompt.",
            param=prompt_param, code="context_length_exceeded",
        )
    wanted = max_tokens or default_tokens(loaded.spec.default_max_tokens)
    return GenerationRequest(
        prompt_tokens=tuple(prompt),
        max_tokens=min(wanted, context - len(prompt)),
        sampling=params.sampling(loaded.spec),
        stop=tuple(params.stop or ()),
        stop_token_ids=tuple(params.stop_token_ids),
        top_logprobs=top_logprobs,
        tenant=request_tenant(params.cache_salt),
        trim_leading_space=trim_leading_space,
        constraint=constraint,
    )


def completion_prompt(params: CompletionParams, loaded: LoadedModel) -> list[int]:
    """Returns the prompt's token ids (a string, a token list, or a one-string list)."""
    prompt = params.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return loaded.encode(prompt, tenant=request_tenant(params.cache_salt))
    vocab = len(loaded.tokenizer)
    if any(not 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)

