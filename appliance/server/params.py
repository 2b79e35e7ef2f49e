"""OpenAI request bodies: parsed, validated, and turned into a GenerationRequest.

Unknown fields are ignored (clients send many); known fields with bad values are a 400
that names the parameter.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from appliance.cache.model_cache import tenant_group
from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.models.loaded import LoadedModel
from appliance.server.errors import bad_request

MAX_STOPS = 16


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Lenient):
    include_usage: bool = False


class CommonParams(Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
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

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
        )


class ContentPart(Lenient):
    type: str
    text: str | None = None


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        unsupported = sorted({p.type for p in self.content if p.type != "text"})
        if unsupported:
            raise ValueError(f"content parts of type {', '.join(unsupported)} are not supported")
        return "".join(p.text or "" for p in self.content)


class ChatParams(CommonParams):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def chat(self) -> list[dict[str, str]]:
        out = []
        for i, m in enumerate(self.messages):
            try:
                text = m.text()
            except ValueError as e:
                raise bad_request(str(e), param=f"messages[{i}].content") from None
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": text})
        return out


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
                       prompt_param: str = "messages", trim_leading_space: bool = True) -> GenerationRequest:
    """Returns the engine request; raises 400 for an empty or over-long prompt."""
    if not prompt:
        raise bad_request("the prompt is empty", param=prompt_param)
    context = loaded.context_tokens
    if len(prompt) >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your "
            f"prompt has {len(prompt)} tokens. Please reduce the length of the prompt.",
            param=prompt_param, code="context_length_exceeded",
        )
    wanted = max_tokens or loaded.spec.default_max_tokens
    return GenerationRequest(
        prompt_tokens=tuple(prompt),
        max_tokens=min(wanted, context - len(prompt)),
        sampling=params.sampling(),
        stop=tuple(params.stop or ()),
        stop_token_ids=tuple(params.stop_token_ids),
        top_logprobs=top_logprobs,
        cache_group=tenant_group(params.cache_salt),
        trim_leading_space=trim_leading_space,
    )


def completion_prompt(params: CompletionParams, loaded: LoadedModel) -> list[int]:
    """Returns the prompt's token ids (a string, a token list, or a one-string list)."""
    prompt = params.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return loaded.encode(prompt)
    vocab = len(loaded.tokenizer)
    if any(not 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)

