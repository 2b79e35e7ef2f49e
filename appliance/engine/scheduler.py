"""Continuous batching on mlx-lm's batch primitives, with our own prefill policy.

Each step runs one decode step for every generating request, then spends a budget of
`chunk_tokens` prompt tokens on prefill, shortest remaining prompt first. A short
prompt therefore never waits behind a long one (nor is it padded to the long one's
chunk), and a long prompt advances one chunk per step between decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
    generation_stream,
)
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler


@dataclass
class _Prefill:
    """One request still prefilling: its own batch of one, and the prompt left to process."""

    uid: int
    batch: PromptProcessingBatch
    remaining: list[int]  # prompt tokens not yet in the cache, the last one included


@dataclass(frozen=True)
class Generated:
    """One decoded token of one request (mirrors mlx-lm's GenerationBatch.Response)."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    cache: list | None  # the request's KV, when it finished here
    tokens: list[int] | None  # the tokens that KV holds


class Scheduler:
    def __init__(self, model: nn.Module, *, chunk_tokens: int):
        self.model = model
        self.chunk_tokens = chunk_tokens
        self._prefills: list[_Prefill] = []
        self._generation = GenerationBatch.empty(model, greedy_sampler)
        self._next_uid = 0

    def __len__(self) -> int:
        return len(self._prefills) + len(self._generation)

    def insert(self, prompt: list[int], *, max_tokens: int, cache: list | None, cached_tokens: list[int],
               sampler: Any, processors: list, stop: StopSequences) -> int:
        """Returns the uid of a new request; `cache` holds the KV of `cached_tokens` (restored)."""
        if not prompt:
            raise ValueError("the prompt must keep at least one token to process")
        uid = self._next_uid
        self._next_uid += 1
        batch = PromptProcessingBatch(
            self.model, [uid], [cache if cache is not None else make_prompt_cache(self.model)],
            tokens=[list(cached_tokens)], prefill_step_size=self.chunk_tokens, samplers=[sampler],
            logits_processors=[processors], stop_sequences=[stop], max_tokens=[max_tokens],
        )
        self._prefills.append(_Prefill(uid, batch, list(prompt)))
        return uid

    def step(self) -> tuple[list[int], list[Generated]]:
        """Runs one step; returns the uids whose prefill finished and the decoded tokens."""
        with mx.stream(generation_stream):
            generated = self._decode()
            prefilled = self._prefill()
        return prefilled, generated

    def _decode(self) -> list[Generated]:
        if not len(self._generation):
            return []
        return [Generated(r.uid, r.token, r.logprobs, r.finish_reason, r.prompt_cache, r.all_tokens)
                for r in self._generation.next()]

    def _prefill(self) -> list[int]:
        """Spends this step's prefill budget, shortest remaining prompt first."""
        budget = self.chunk_tokens
        done = []
        for p in sorted(self._prefills, key=lambda p: len(p.remaining)):
            if budget <= 0:
                break
            todo = len(p.remaining) - 1  # the last token is the first decode step's input
            n = min(todo, budget)
            if n > 0:
                p.batch.prompt([p.remaining[:n]])
                p.remaining = p.remaining[n:]
                budget -= n
            if len(p.remaining) == 1:
                self._prefills.remove(p)
                self._generation.extend(p.batch.generate([p.remaining]))
                done.append(p.uid)
        return done

    def extract(self, uid: int) -> tuple[list | None, list[int] | None]:
        """Returns a copy of the request's KV and the tokens it holds."""
        for p in self._prefills:
            if p.uid == uid:
                if not p.batch.tokens[0]:  # nothing computed yet: no KV to hand back
                    return None, None
                return p.batch.extract_cache(0), list(p.batch.tokens[0])
        if uid in self._generation.uids:
            i = self._generation.uids.index(uid)
            return self._generation.extract_cache(i), list(self._generation.tokens[i])
        return None, None

    def remove(self, uid: int, *, keep_cache: bool) -> tuple[list | None, list[int] | None]:
        """Takes the request out; returns its KV and tokens when `keep_cache`."""
        kept = self.extract(uid) if keep_cache else (None, None)
        for p in self._prefills:
            if p.uid == uid:
                self._prefills.remove(p)
                return kept
        if uid in self._generation.uids:
            i = self._generation.uids.index(uid)
            self._generation.filter([j for j in range(len(self._generation)) if j != i])
        return kept
