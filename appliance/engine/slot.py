"""A request's state on the engine thread: detokenizer, stop strings, logprobs, counts."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences

from appliance.engine.request import Delta, GenerationRequest, RequestStats, TokenLogprob
from appliance.engine.sampling import make_processors, make_sampler
from appliance.engine.stops import StopMatcher
from appliance.models.loaded import LoadedModel


class Slot:
    def __init__(self, request: GenerationRequest, loaded: LoadedModel):
        self.request = request
        self.stats = RequestStats(prompt_tokens=len(request.prompt_tokens))
        self.uid: int | None = None
        self.done = False
        self.handle: Any = None
        self.prefetch: Future | None = None  # SSD reads started at submit
        self.reading = False  # the prefetch's reads are under way (set on its thread)
        self.saved_tokens = 0  # the prompt's full KV blocks up to here are saved (or were cached)
        self._stop_ids = frozenset(loaded.eos_token_ids) | frozenset(request.stop_token_ids)
        self._detokenizer = loaded.tokenizer.detokenizer
        if not request.trim_leading_space:
            # mlx-lm's detokenizers trim a leading space only while their text is empty:
            # seed one hidden character so the completion's text stays exact.
            self._detokenizer.text, self._detokenizer.offset = "\0", 1
        self._stops = StopMatcher(request.stop)

    def insert_args(self, restored: Any = None) -> dict:
        """Returns the keyword arguments of Scheduler.insert, after a restored prefix."""
        r = self.request
        n = restored.num_tokens if restored is not None and restored.cache is not None else 0
        return {
            "prompt": list(r.prompt_tokens[n:]),
            "cache": restored.cache if n else None,
            "cached_tokens": list(r.prompt_tokens[:n]),
            "max_tokens": r.max_tokens,
            "sampler": make_sampler(r.sampling, logprobs=r.top_logprobs is not None),
            "processors": make_processors(r.sampling)
            + ([r.constraint.processor()] if r.constraint is not None else []),
            "stop": StopSequences([[t] for t in sorted(self._stop_ids)]),
        }

    def on_token(self, token: int, logprobs: mx.array, finish_reason: str | None
                 ) -> tuple[list, str | None]:
        """Returns the events for one generated token and the finish reason, if it ends here."""
        stats = self.stats
        stats.completion_tokens += 1
        if stats.first_token_at is None:
            stats.first_token_at = time.perf_counter()
        stopped_by_token = finish_reason == "stop" and token in self._stop_ids
        if not stopped_by_token:
            self._detokenizer.add_token(token)
        if finish_reason is not None:
            self._detokenizer.finalize()
        text = self._stops.feed(self._detokenizer.last_segment)
        if self._stops.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self._stops.flush()
        logs = () if self.request.top_logprobs is None else (self._logprob(token, logprobs),)
        return [Delta(text=text, token_ids=(token,), logprobs=logs)], finish_reason

    def _logprob(self, token: int, logprobs: mx.array) -> TokenLogprob:
        k = self.request.top_logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if k:
            ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            values = logprobs[ids]
            order = mx.argsort(-values)
            top = tuple(zip(ids[order].tolist(), values[order].tolist()))
        return TokenLogprob(token_id=token, logprob=logprobs[token].item(), top=top)
