"""Continuous batching on mlx-lm's batch primitives, with our own prefill policy.

A step has two halves, and the tokens reach clients between them:

- `step()` starts the shortest waiting prompts while their padded size fits the step's
  budget (`chunk_tokens`; four times that while nothing is decoding, since then no
  stream can stall). A batched call pads every prompt to the longest one's length, so
  they are split into the sub-batches that cost least: padding tokens against one more
  pass over the weights, both measured (`split_by_length`). On GPUs each sub-batch is cut
  again into calls of a power-of-two count of prompts, each padded to a bucketed length
  (`row_groups`, `padded_length`): MLX CUDA builds an attention graph per shape (~0.1 s),
  so a call of a shape not yet seen delays every first token of its step. It then runs
  one decode step for every generating request, the started ones included, whose first
  token comes from that pass: on CPUs it is handed out in this same step. On GPUs
  decoding is pipelined (mlx-lm's GenerationBatch hands out the token its previous
  pass computed while the next is computed), so a started request's first token goes
  out at the next step, without the pass of its own that mlx-lm would run to have it
  ready sooner (`LeanGeneration`); on CPUs it is not pipelined (`EagerGeneration`).
  A generation batch holds every row padded to its longest, so on GPUs rows of unlike
  KV lengths (a 25K-token context beside short chats) decode in batches of their own,
  a pass each (`generation_for`); on CPUs all share one. Prompts start only while the
  batch they join fits in memory (`call_budget.batch_fits`). A prompt that does not fit
  waits, and the prompts behind it with it, until rows finish.
- `advance()` spends what is left of the budget on one chunk of the shortest prompt
  that is too long to start at once. With `step_s` set, the chunk is sized from that
  prompt's measured speed (which falls as its context grows) to take about `step_s`,
  so streams decoding beside a long prompt wait at most about that long. A prompt
  prefilled alone gets `ALONE_STEPS` times longer slices, of up to `ALONE_STEPS` chunks,
  each queued on the device behind the last: tiny chunks cost it throughput, and only a
  request yet to arrive would wait (unbounded by chunks, a short request sent during a
  lone 25K prefill on an H200 waited for a whole second's slice: TTFT p99 1.59x its
  value alone; at four chunks a slice, 2.26x). A prompt counts as too long to start at
  once when it would take more than `START_STEPS` such chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import PromptProcessingBatch, StopSequences, generation_stream
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from appliance.engine import attention
from appliance.engine.call_budget import batch_fits, max_call_tokens, model_shape
from appliance.engine.matmul_choice import MatmulChoice
from appliance.engine.mlxlm_seam import BatchCache, EagerGeneration, LeanGeneration, prompt_padded, row_view
from appliance.engine.prefill import STEP_TOKENS, can_prefill, prefill
from appliance.kernels.gate import GATE
from appliance.models.memory import free_bytes
from appliance.platform import device_kind
from appliance.spec import BatchingSpec

MIN_CHUNK_TOKENS = 16  # a time-sized chunk never gets smaller than this
START_STEPS = 4  # a prompt longer than this many timed chunks is chunked, not started at once
IDLE_BUDGET_FACTOR = 4  # the start budget while nothing is decoding, in chunks (`start_budget`)
ALONE_STEPS = 2  # a prompt prefilled alone gets time slices this many times longer
DEFAULT_PASS_TOKENS = 32.0  # one more model call, in prefill tokens, until both are measured
MAX_SUB_BATCH = 256  # prompts in one padded prefill call at most (bounds the split's search)
MIN_SHAPE_TOKENS = 32  # the shortest length a GPU's batched prefill call is padded to
GPU_SHAPE_TOKENS = 256  # GPU prefill calls come in multiples of this (see Scheduler.shape_tokens)
# On GPUs rows decode in generation batches of like KV lengths (`generation_for`): a batch
# pads every row to its longest, and on an H200 eight short rows beside one 25K row
# decoded at 45-150 ms a step against 10 ms alone (the padded rows' array mask keeps
# attention off the fused kernel). Each batch costs a pass over the weights a step.
LENGTH_RATIO = 4  # rows join a batch whose longest KV is at most this many times theirs ...
LENGTH_FLOOR = 2048  # ... or than this many tokens: below it, padding costs less than a pass
MAX_GENERATIONS = 3  # batches at most: past that, rows join the nearest


@dataclass
class _Prefill:
    """One request still prefilling: its own batch of one, and the prompt left to process."""

    uid: int
    batch: PromptProcessingBatch
    remaining: list[int]  # prompt tokens not yet in the cache, the last one included
    s_per_token: float | None = None  # measured on its last chunk (grows with the context)
    # The prompt tokens its prefill calls computed, and its share of their seconds (a call
    # shared by several prompts split by their tokens): its prefill speed, waits not counted.
    computed: int = 0
    seconds: float = 0.0

    @property
    def todo(self) -> int:
        return len(self.remaining) - 1  # the last token is the first decode step's input


def start_budget(chunk_tokens: int, *, decoding: bool) -> int:
    """Returns the prompt tokens one step may start: a chunk's while rows are decoding
    (they wait for it), `IDLE_BUDGET_FACTOR` chunks' while none is."""
    return chunk_tokens * (1 if decoding else IDLE_BUDGET_FACTOR)


def split_by_length(prompts: list[_Prefill], pass_tokens: float, shape_tokens: int = 1,
                    grouped: Callable[[int, int], bool] = lambda rows, length: True) -> list[list[_Prefill]]:
    """Returns `prompts` (shortest prompt first) cut into consecutive sub-batches at the
    least cost: a sub-batch costs its padded size (count x its longest prompt, in tokens)
    plus `pass_tokens` for each call it takes. Where shapes are fixed (`shape_tokens` > 1:
    GPUs) each is padded to `padded_length`, and one that is `grouped(rows, length)`
    runs as `row_groups` calls, one per power of two in its count: on an H200 a split
    blind to both cut 20 prompts into 12 calls (0.41 s to start them)."""
    lengths = [p.todo if shape_tokens <= 1 else padded_length(p.todo, shape_tokens) for p in prompts]

    def calls(rows: int, length: int) -> int:
        return rows.bit_count() if shape_tokens > 1 and grouped(rows, length) else 1

    best = [0.0]  # best[j]: the cost of the first j prompts
    cut = [0]  # cut[j]: where the last sub-batch of that best split starts
    for j in range(1, len(prompts) + 1):
        cost, i = min((best[i] + (j - i) * lengths[j - 1] + calls(j - i, lengths[j - 1]) * pass_tokens, i)
                      for i in range(max(0, j - MAX_SUB_BATCH), j))
        best.append(cost)
        cut.append(i)
    parts, j = [], len(prompts)
    while j:
        parts.append(prompts[cut[j]:j])
        j = cut[j]
    return parts[::-1]


def row_groups(prompts: list) -> list[list]:
    """Returns `prompts` cut, in order, into groups whose sizes are powers of two, largest
    first: a GPU then meets at most one new batch size per power of two."""
    groups, i = [], 0
    while i < len(prompts):
        size = 1 << ((len(prompts) - i).bit_length() - 1)
        groups.append(prompts[i:i + size])
        i += size
    return groups


def padded_length(num_tokens: int, shape_tokens: int) -> int:
    """Returns the length a batched prefill call whose longest prompt has `num_tokens` is
    padded to: below `shape_tokens` the next power of two (at least MIN_SHAPE_TOKENS),
    else the next multiple of `shape_tokens`; `num_tokens` itself where shapes are free."""
    if shape_tokens <= 1 or num_tokens <= 0:
        return num_tokens
    if num_tokens < shape_tokens:
        return min(shape_tokens, max(MIN_SHAPE_TOKENS, 1 << (num_tokens - 1).bit_length()))
    return -(-num_tokens // shape_tokens) * shape_tokens


def extend_first(batches: list[PromptProcessingBatch]) -> PromptProcessingBatch:
    """Extends the first of `batches` with the others, in order; returns it."""
    for other in batches[1:]:
        batches[0].extend(other)
    return batches[0]


def generation_tokens(rows: Any) -> int:
    """Returns the length every row of a generation batch's KV buffers has (0: none yet)."""
    caches = getattr(rows, "prompt_cache", None) or []
    keys = getattr(caches[0], "keys", None) if caches else None
    return 0 if keys is None else int(keys.shape[2])


def generation_for(lengths: list[int], length: int, *, most: int = MAX_GENERATIONS) -> int | None:
    """Returns which of the generation batches whose KV buffers hold `lengths` tokens rows
    of `length` tokens join (the nearest whose longest is within `LENGTH_RATIO` of theirs,
    counting any length under `LENGTH_FLOOR` as that); None: a batch of their own, while
    there are fewer than `most`."""
    def ratio(other: int) -> float:
        return max(other, length) / max(min(other, length), LENGTH_FLOOR, 1)

    nearest = min(range(len(lengths)), key=lambda i: ratio(lengths[i]), default=None)
    if nearest is not None and (ratio(lengths[nearest]) <= LENGTH_RATIO or len(lengths) >= most):
        return nearest
    return None


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
    def __init__(self, model: nn.Module, *, chunk_tokens: int, step_s: float | None = None,
                 lookahead: bool = False, shape_tokens: int = 1, apart: bool = False, composing: bool = False):
        self.model = model
        self.composing = composing
        self.chunk_tokens = chunk_tokens
        # Lone prefill calls take multiples of this many tokens (the last one padded):
        # MLX CUDA compiles kernels per shape, ~1 s for a new one on an H200.
        self.shape_tokens = shape_tokens
        self.step_s = step_s  # None: chunks are sized by tokens only
        self._prefills: list[_Prefill] = []
        self._generation_class = LeanGeneration if lookahead else EagerGeneration
        # The generation batches, rows of like KV lengths in each when `apart` (GPUs;
        # `generation_for`), else one; none while nothing decodes.
        self._generations: list = []
        self._apart = apart
        self._next_uid = 0
        self._budget_left = 0
        self._start_s_per_token: float | None = None  # measured when prompts were last started
        # The fastest start yet, per token: what one more token of padding costs. The last one
        # may hold a new shape's compile (1.1 s for 2 prompts on an H200).
        self._fastest_start_s_per_token: float | None = None
        self._pass_s: float | None = None  # the fastest decode step yet: a model call costs at least this
        # What one more batched start call costs beyond its tokens, the fewest seconds yet
        # (`_measure_call`): its own fixed cost and its rows' merge into their generation
        # batch, which the pass after it pays.
        self._call_s: float | None = None
        self._shape = model_shape(model)  # bounds each prefill call by free memory
        self._free = free_bytes  # what MLX may still allocate (a test may stub it)
        # The last step's halves, in seconds, and its prefill calls (for the engine's counters).
        self.last_start_s = self.last_decode_s = 0.0
        self.last_prefill_calls = 0
        self.last_advanced_tokens = 0  # by the last advance(): the blocks the engine may save next
        # The last step's model calls, in order, for the step trace: a start call is
        # ("start", rows, tokens each row is padded to (a lone prompt: its own), ms), a
        # chunk ("advance", 1, tokens, ms), a decode pass ("pass", rows, tokens its KV
        # buffers hold, ms).
        self.last_calls: list[tuple[str, int, int, float]] = []
        # The prompts the last step started: uid -> (prompt tokens computed, seconds), as _Prefill.
        self.last_prefilled: dict[int, tuple[int, float]] = {}
        self.matmuls = MatmulChoice()  # a pass's few-row matmuls: ours or MLX's, as measured
        self._first_tokens_due = False  # pipelined: the last step started rows whose first token is next
        self._held_back = False  # the last advance() gave way to such rows

    @classmethod
    def for_device(cls, model: nn.Module, limits: BatchingSpec) -> Scheduler:
        """Returns a scheduler for `model` with `limits`, set for the device MLX runs on."""
        gpu = device_kind() == "gpu"
        scheduler = cls(model, chunk_tokens=limits.prefill_chunk_tokens, lookahead=gpu,
                        shape_tokens=GPU_SHAPE_TOKENS if gpu else 1, apart=gpu)
        scheduler.set_limits(limits)
        return scheduler

    def set_limits(self, limits: BatchingSpec) -> None:
        """Applies `limits`' prefill settings from the next step on."""
        self.chunk_tokens = limits.prefill_chunk_tokens
        self.step_s = limits.prefill_step_s
        self.composing = limits.short_attention == "composed"

    @property
    def composing(self) -> bool:
        """Whether short prefill calls compose their attention (engine/attention.py); on
        GPUs such a call needs no power-of-two count of rows (`row_groups`): no graph per
        shape."""
        return self._composing

    @composing.setter
    def composing(self, on: bool) -> None:
        if on:  # mlx-lm's attention stays untouched until asked
            attention.install(self.model)
        self._composing = on

    def __len__(self) -> int:
        return len(self._prefills) + self.num_generating

    @property
    def num_generating(self) -> int:
        """Returns how many requests are decoding, in all generation batches."""
        return sum(map(len, self._generations))

    def insert(self, prompt: list[int], *, max_tokens: int, cache: list | None, cached_tokens: list[int],
               sampler: Any, processors: list, stop: StopSequences) -> int:
        """Returns the uid of a new request; `cache` is the batch-of-one cache (one
        BatchKVCache per layer) holding the KV of `cached_tokens`, when restored."""
        if not prompt:
            raise ValueError("the prompt must keep at least one token to process")
        uid = self._next_uid
        self._next_uid += 1
        caches = make_prompt_cache(self.model)
        plain = all(type(c) is KVCache for c in caches)  # else mlx-lm's own batch caches
        batch = PromptProcessingBatch(
            self.model, [uid], [[] if plain else caches],
            tokens=[list(cached_tokens)], prefill_step_size=self.chunk_tokens, samplers=[sampler],
            logits_processors=[processors], stop_sequences=[stop], max_tokens=[max_tokens],
        )
        if cache is not None:
            batch.prompt_cache = cache  # already merged: mlx-lm's merge would copy it again
        elif plain:
            batch.prompt_cache = [BatchCache([0]) for _ in caches]  # string masks while unpadded
        self._prefills.append(_Prefill(uid, batch, list(prompt)))
        return uid

    def step(self) -> tuple[list[int], list[Generated]]:
        """Starts the prompts that fit this step, then decodes one token for every running
        request; returns the uids that started and the decoded tokens."""
        self.last_prefilled = {}
        quiet = all(kind == "pass" for kind, *_ in self.last_calls)  # the last step queued no prefill
        self.last_calls = []
        with GATE.shared(), mx.stream(generation_stream), attention.composing(self.composing):
            t0 = time.perf_counter()
            started = self._start()
            t1 = time.perf_counter()
            generated = self._decode(measured=quiet and not started)
        self._first_tokens_due = bool(started) and self._generation_class is LeanGeneration
        self.last_start_s, self.last_decode_s = t1 - t0, time.perf_counter() - t1
        self._measure_call(self.last_start_s + self.last_decode_s)
        return started, generated

    def _measure_call(self, seconds: float) -> None:
        """Takes what a step's batched start calls (`last_calls`) cost beyond their tokens
        from the step's `seconds`, its start and its decode passes (the rows' merge
        included). A step that started a lone prompt's call, cheaper, is not measured."""
        starts = [(rows, tokens) for kind, rows, tokens, _ in self.last_calls if kind == "start"]
        if not starts or any(rows == 1 for rows, _ in starts):
            return
        if self._fastest_start_s_per_token is None or self._pass_s is None:
            return
        padded = sum(rows * tokens for rows, tokens in starts)
        passes = sum(kind == "pass" for kind, *_ in self.last_calls)
        per_call = (seconds - padded * self._fastest_start_s_per_token - passes * self._pass_s) / len(starts)
        if per_call > 0:
            self._call_s = min(self._call_s or per_call, per_call)

    def _start(self) -> list[int]:
        """Prefills, in one batched call, the shortest prompts whose padded size fits the
        budget, and moves them into the generation batch."""
        budget = start_budget(self.chunk_tokens, decoding=bool(self.num_generating))
        # The batches the starting rows join: their rows and the length they pad them to.
        lengths = [generation_tokens(g) for g in self._generations]
        rows = [len(g) for g in self._generations]
        free: list[int | None] = []  # read once, when a prompt would join others (a driver call on CUDA)
        starting: list[_Prefill] = []
        for p in sorted(self._prefills, key=lambda p: p.todo):
            # Shortest first: p is the longest of those starting, so the padded size is count x p.todo.
            if (len(starting) + 1) * p.todo > budget:
                break
            if p.todo > START_STEPS * self._timed_chunk(p):
                continue
            tokens = len(p.batch.tokens[0]) + len(p.remaining) + STEP_TOKENS
            i = self._joins(lengths, tokens)
            if i is None:
                i, lengths, rows = len(lengths), [*lengths, 0], [*rows, 0]
            if rows[i] and self._shape is not None:
                free = free or [self._free()]
                if not batch_fits(self._shape, rows=rows[i] + 1, tokens=max(lengths[i], tokens), free=free[0]):
                    break  # it waits for rows to finish, and the prompts behind it with it
            lengths[i], rows[i] = max(lengths[i], tokens), rows[i] + 1
            starting.append(p)
        self._budget_left = self.chunk_tokens
        self.last_prefill_calls = 0
        if not starting:
            return []
        for p in starting:
            self._prefills.remove(p)
        # Prompts `advance()` prefilled to their last token need no call: padded into one,
        # a row of nothing but padding would cost its whole length.
        parts = [p.batch for p in starting if not p.todo]
        for sub in split_by_length([p for p in starting if p.todo], self._pass_tokens(), self.shape_tokens,
                                   self._grouped):
            for group in self._calls(sub):
                part = extend_first([p.batch for p in group])
                todo = [p.remaining[:-1] for p in group]
                longest = max(map(len, todo))
                length = padded_length(longest, self.shape_tokens if len(group) > 1 else 1)
                padded = len(group) * length
                self._budget_left -= padded
                if padded:
                    seconds = self._timed_prompt(group, part, todo, length=length)
                    self.last_prefill_calls += 1
                    self._start_s_per_token = self._measured(seconds, padded, self._start_s_per_token)
                    if self._start_s_per_token is not None:
                        self._fastest_start_s_per_token = min(self._start_s_per_token,
                                                              self._fastest_start_s_per_token or float("inf"))
                parts.append(part)
        last = {p.uid: p.remaining[-1] for p in starting}  # each row's first decode input
        self.last_prefilled = {p.uid: (p.computed, p.seconds) for p in starting}
        for joining, part_group in self._by_generation(parts):
            batch = extend_first(part_group)
            # uint32, as sampled tokens are: a join concatenates the two, and mixed kinds would
            # index the embeddings with int64 (one more kernel for MLX CUDA to compile).
            pending = mx.array([last[u] for u in batch.uids], dtype=mx.uint32)
            started_rows = self._generation_class(
                self.model, batch.uids, pending, batch.prompt_cache,
                batch.tokens, batch.samplers, batch.fallback_sampler, batch.logits_processors,
                batch.stop_sequences, batch.max_tokens)
            if joining is None:
                self._generations.append(started_rows)
            else:
                joining.extend(started_rows)
        return [p.uid for p in starting]

    def _calls(self, sub: list[_Prefill]) -> list[list[_Prefill]]:
        """Returns the calls a sub-batch of the split runs as: on GPUs its `row_groups`,
        unless its attention composes (`_grouped`, as `split_by_length` priced it)."""
        if self.shape_tokens <= 1:
            return [sub]
        length = padded_length(max(p.todo for p in sub), self.shape_tokens)
        return row_groups(sub) if self._grouped(len(sub), length) else [sub]

    def _grouped(self, rows: int, length: int) -> bool:
        """Returns whether a start call of `rows` prompts padded to `length` tokens is cut
        into power-of-two counts of rows: unless its attention composes."""
        heads = self._shape.heads if self._shape is not None else 1
        return not (self.composing and attention.is_short(rows, heads, length, length))

    def _joins(self, lengths: list[int], length: int) -> int | None:
        """Returns which generation batch (by the lengths of their KV buffers) rows of
        `length` tokens join; None: one of their own. With `apart` the one of like lengths
        (`generation_for`), else the one batch there is."""
        if self._apart:
            return generation_for(lengths, length)
        return 0 if lengths else None

    def _by_generation(self, parts: list[PromptProcessingBatch]) -> list[tuple[Any, list[PromptProcessingBatch]]]:
        """Returns `parts` grouped by the generation batch each joins (None: a new one), in
        order of first appearance."""
        lengths = [generation_tokens(g) for g in self._generations]
        joining: list = list(self._generations)
        groups: dict[int, list[PromptProcessingBatch]] = {}
        for part in parts:
            length = max(map(len, part.tokens))
            i = self._joins(lengths, length)
            if i is None:  # a batch of its own, which later parts may join
                i, lengths, joining = len(lengths), [*lengths, length], [*joining, None]
            lengths[i] = max(lengths[i], length)
            groups.setdefault(i, []).append(part)
        return [(joining[i], group) for i, group in groups.items()]

    def advance(self) -> None:
        """Spends the rest of this step's budget on one chunk of the shortest prompt left,
        unless rows just started (see `_gives_way`)."""
        self.last_advanced_tokens = 0
        pending = [p for p in self._prefills if p.todo > 0]
        if self._budget_left <= 0 or not pending or self._gives_way():
            return
        p = min(pending, key=lambda p: p.todo)
        if self._alone():  # nothing decodes beside it: a longer slice, its chunks queued back to back
            n = min(p.todo, self._timed_chunk(p, most=ALONE_STEPS * self.chunk_tokens))
        else:
            n = min(p.todo, self._budget_left, self._timed_chunk(p))
        if n < p.todo:  # a cut chunk keeps to whole shapes; the prompt's last one is padded
            n = min(p.todo, max(self.shape_tokens, n // self.shape_tokens * self.shape_tokens))
        self._budget_left = 0
        with GATE.shared(), mx.stream(generation_stream), attention.composing(self.composing):
            seconds = self._timed_prompt([p], p.batch, [p.remaining[:n]])
        p.s_per_token = self._measured(seconds, n, p.s_per_token)
        p.remaining = p.remaining[n:]
        self.last_advanced_tokens = n

    def _gives_way(self) -> bool:
        """Returns whether this step's chunk waits a step for the rows it started: decoding
        pipelined, their first tokens come out of the next pass, and a chunk run now would
        hold them back by a whole slice (on an H200, 8 short requests sent during a 25K
        prefill got their first token 1.37 s after they were sent, 0.38 s alone). Never
        twice running, so arrivals at every step cannot starve a long prompt."""
        self._held_back = self._first_tokens_due and not self._held_back
        return self._held_back

    def _timed_prompt(self, prompts: list[_Prefill], batch: PromptProcessingBatch, todo: list[list[int]], *,
                      length: int = 0) -> float:
        """Runs `_prompt` for `prompts` and returns its seconds, shared among them by their
        tokens in `todo` (_Prefill.computed, .seconds)."""
        started = time.perf_counter()
        self._prompt(batch, todo, length=length)
        seconds = time.perf_counter() - started
        self.last_calls.append(("start" if length else "advance", len(todo), length or max(map(len, todo)),
                                round(1000 * seconds, 2)))
        total = sum(map(len, todo))
        for p, tokens in zip(prompts, todo):
            p.computed += len(tokens)
            p.seconds += seconds * len(tokens) / total if total else 0.0
        return seconds

    def _prompt(self, batch: PromptProcessingBatch, todo: list[list[int]], *, length: int = 0) -> None:
        """Prefills `todo` (one token list per row of `batch`) into its cache: a lone
        prompt by the plain chunked forward pass (`prefill`), a padded batch by mlx-lm's
        batch path, every row padded to `length` tokens (at least the longest row's)."""
        longest = max(len(t) for t in batch.tokens) + max(len(t) for t in todo)  # the context at the end
        if len(todo) == 1 and can_prefill(batch):
            cap = max_call_tokens(self._shape, context_tokens=longest)
            chunk = min(self.chunk_tokens, cap // 2 if cap else self.chunk_tokens)  # two queued at once
            if chunk < self.chunk_tokens:
                chunk = max(self.shape_tokens, chunk // self.shape_tokens * self.shape_tokens)
            prefill(batch, todo[0], chunk_tokens=chunk, shape_tokens=self.shape_tokens)
        else:  # mlx-lm's padded batch: an array mask, so unfused attention (scores in memory)
            cap = max_call_tokens(self._shape, context_tokens=longest, rows=len(todo), fused=False)
            step = self.chunk_tokens if cap is None else cap // len(todo)
            batch.prefill_step_size = max(MIN_CHUNK_TOKENS, min(self.chunk_tokens, step))
            if length > max(map(len, todo)):
                prompt_padded(batch, todo, length)
            else:
                batch.prompt(todo)

    @staticmethod
    def _measured(seconds: float, num_tokens: int, previous: float | None) -> float | None:
        """Returns the seconds per token of a prefill call of `num_tokens` that took `seconds`."""
        if num_tokens < MIN_CHUNK_TOKENS:
            return previous  # too few tokens to time
        return seconds / num_tokens

    def _timed_chunk(self, p: _Prefill, *, most: int | None = None) -> int:
        """Returns how many of `p`'s tokens take about `step_s` (`ALONE_STEPS` times that
        while nothing else is running: small chunks cost a lone prompt throughput, and
        only a request yet to arrive would wait), at its own last measured speed, else at
        the speed prompts were last started with; at most `most` (default: one chunk)."""
        most = most or self.chunk_tokens
        s_per_token = p.s_per_token or self._start_s_per_token
        if self.step_s is None or not s_per_token:
            return self.chunk_tokens
        step_s = self.step_s * (ALONE_STEPS if self._alone() else 1)
        return max(MIN_CHUNK_TOKENS, min(most, int(step_s / s_per_token)))

    def _alone(self) -> bool:
        """Returns whether one prompt is prefilling and nothing is decoding."""
        return not self.num_generating and len(self._prefills) == 1

    def _pass_tokens(self) -> float:
        """Returns what one more start call costs, in prompt tokens' worth of prefill time:
        the measured cost of a batched start call (`_call_s`), at least a decode pass. On an
        H100 a wave of 8 short prompts started in 3 calls took 0.20 s with the pass after
        them (their merge), in 1 call of more padding 0.08 s, and a decode pass ~5-12 ms."""
        if not self._pass_s or not self._fastest_start_s_per_token:
            return DEFAULT_PASS_TOKENS
        return max(self._pass_s, self._call_s or 0.0) / self._fastest_start_s_per_token

    def _decode(self, *, measured: bool) -> list[Generated]:
        """Runs one decode step of every generation batch (a pass each); drops the emptied.
        Each pass runs the matmuls chosen for its rows (engine/matmul_choice.py), which
        learns from its time when `measured` (no prefill call queued before it) and it is
        the step's only pass."""
        generated = []
        for rows in self._generations:
            shape = len(rows), generation_tokens(rows)
            self.matmuls.before(len(rows))
            started = time.perf_counter()
            responses = rows.next()
            elapsed = time.perf_counter() - started
            self.matmuls.after(shape[0], elapsed, measured=measured and len(self._generations) == 1)
            self._pass_s = min(self._pass_s or elapsed, elapsed)
            self.last_calls.append(("pass", *shape, round(1000 * elapsed, 2)))
            generated += [Generated(r.uid, r.token, r.logprobs, r.finish_reason, r.prompt_cache, r.all_tokens)
                          for r in responses]
        self._drop_emptied()
        return generated

    def _drop_emptied(self) -> None:
        """Drops the generation batches whose rows have all finished or been removed."""
        self._generations = [rows for rows in self._generations if len(rows)]

    def extract(self, uid: int, *, copy: bool = True) -> tuple[list | None, list[int] | None]:
        """Returns the request's KV and the tokens it holds: a copy, or with `copy=False`
        views of the live buffers, for a caller that copies what it keeps at once."""
        for p in self._prefills:
            if p.uid == uid:
                if not p.batch.tokens[0]:  # nothing computed yet: no KV to hand back
                    return None, None
                return self._row(p.batch.prompt_cache, 0, copy), list(p.batch.tokens[0])
        for rows in self._generations:
            if uid in rows.uids:
                i = rows.uids.index(uid)
                return self._row(rows.prompt_cache, i, copy), list(rows.tokens[i])
        return None, None

    @staticmethod
    def _row(caches: list, i: int, copy: bool) -> list:
        if copy or not all(isinstance(c, BatchKVCache) for c in caches):
            return [c.extract(i) for c in caches]
        return [row_view(c, i) for c in caches]

    def remove(self, uid: int, *, keep_cache: bool) -> tuple[list | None, list[int] | None]:
        """Takes the request out; returns its KV and tokens when `keep_cache`."""
        kept = self.extract(uid) if keep_cache else (None, None)
        for p in self._prefills:
            if p.uid == uid:
                self._prefills.remove(p)
                return kept
        for rows in self._generations:
            if uid in rows.uids:
                i = rows.uids.index(uid)
                rows.filter([j for j in range(len(rows)) if j != i])
        self._drop_emptied()
        return kept
