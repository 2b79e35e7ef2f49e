"""One request's record: what to generate, what came out, and how long it took."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings: never emitted, may span tokens
    stop_token_ids: tuple[int, ...] = ()  # ends the request like EOS
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    tenant: str = "default"  # whose KV it reads and writes (model_cache.kv_tenant): tenants never share blocks
    # Chat answers drop the first token's leading space (as mlx-lm does); completions
    # continue the prompt's text exactly.
    trim_leading_space: bool = True
    # A grammar the output must follow (structured output, forced tool calls): anything
    # with a `processor()` that returns a fresh mlx-lm logits processor for this request.
    constraint: Any = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class Delta:
    """What one engine step produced for a request: text to emit and the tokens behind it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class RequestStats:
    """Per-request figures for the admin API and metrics (perf_counter seconds)."""

    prompt_tokens: int
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    prefilled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.submitted_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def prefill_tok_s(self) -> float | None:
        if self.prefilled_at is None or self.admitted_at is None:
            return None
        return rate(self.prompt_tokens - self.cached_tokens, self.prefilled_at - self.admitted_at)

    @property
    def decode_tok_s(self) -> float | None:
        if self.finished_at is None or self.first_token_at is None or self.completion_tokens < 2:
            return None
        return rate(self.completion_tokens - 1, self.finished_at - self.first_token_at)

    def to_data(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_by_tier": self.cached_by_tier,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
        }


@dataclass(frozen=True)
class Finished:
    """The last event of a request."""

    reason: str  # "stop" | "length" | "cancelled" | "error"
    stats: RequestStats
    error: str | None = None


def rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None
