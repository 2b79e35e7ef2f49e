"""Everything omlx takes from mlx-lm's private internals, read from mlx-lm 0.32.2.

The rest of omlx uses only mlx-lm's public surface (`make_prompt_cache`, the caches'
`keys`/`values`/`offset`/`size()`/`extract()`/`merge()`, `PromptProcessingBatch`,
`GenerationBatch.next/extend/filter`). What is here depends on code mlx-lm may change in
any release:

- `LeanGeneration._step` is a copy of `mlx_lm.generate.GenerationBatch._step`, and it
  and `EagerGeneration` read and write GenerationBatch's private `_current_tokens`,
  `_current_logprobs`, `_next_tokens`, `_next_logprobs`, `_token_context`,
  `_num_tokens` and `_matchers`, which `GenerationBatch.__init__`, `extend`, `filter`
  and `next` also use.
- `LeanGeneration` relies on `GenerationBatch.__init__` calling `_step()` once (the
  priming pass it turns off with its `_priming` flag), and its `next` is a copy of
  `GenerationBatch.next` that skips the rows still to be fed their last prompt token.
- `BatchCache` overrides the methods of `mlx_lm.models.cache.BatchKVCache` that change
  `left_padding` (`prepare`, `filter`, `extend`, `merge`, the `state` setter; `finalize`
  turns right padding into left padding) and takes its masks from `make_mask`.
- `prompt_padded` is `mlx_lm.generate.PromptProcessingBatch.prompt` with the padded
  length given (and no `mx.clear_cache()` after each chunk); it relies on `finalize()`
  turning any amount of right padding into left padding.
- `set_size` writes `BatchKVCache._idx`: the buffers hold a row's tokens at
  `[left_padding, _idx)` (see `update_and_fetch`), and `size()` returns `_idx`.
- `model_classes` is `mlx_lm.utils._get_classes`; models/loaded.py `load_with_weights`
  hands `mlx_lm.utils.load_model` a wrapper of it and relies on `load_model` passing
  every tensor of the files through the model class's `sanitize` before anything reads
  them (so that the weights read on CUDA replace the lazy ones).

`UPSTREAM` records a hash of each of those functions' source; tests/engine/
test_mlxlm_seam.py fails, naming what to re-check here, when an mlx-lm upgrade changes one.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from appliance.engine.sampling import Greedy

MLX_LM_VERSION = "0.32.2"

# mlx-lm function -> (upstream_hash of its source in MLX_LM_VERSION, what here to re-check
# when an upgrade changes it)
UPSTREAM: dict[str, tuple[str, str]] = {
    "mlx_lm.generate.GenerationBatch.__init__": (
        "dc828c7f63bfb07f", "LeanGeneration.__init__ (it still calls _step once: the _priming flag)"),
    "mlx_lm.generate.GenerationBatch._step": (
        "d7513c5031029194", "LeanGeneration._step is a copy of it: port the change"),
    "mlx_lm.generate.GenerationBatch.extend": (
        "4019e7eaf5d6782f", "LeanGeneration.extend (_fresh) and the placeholder _next_logprobs, one per row"),
    "mlx_lm.generate.GenerationBatch.filter": (
        "27a2165cf672969f", "LeanGeneration.filter (_fresh) and the placeholder _next_logprobs, one per row"),
    "mlx_lm.generate.GenerationBatch.next": (
        "5d2a3d229fba02a9", "LeanGeneration.next is a copy of it that skips fresh rows: port the change"),
    "mlx_lm.generate.PromptProcessingBatch.prompt": (
        "91194fe0a4fcd146", "prompt_padded is a copy of it with the padded length given: port the change"),
    "mlx_lm.models.cache.BatchKVCache.__init__": (
        "597e88a6f035b035", "BatchCache.__init__ and set_size (_idx still the end of the tokens)"),
    "mlx_lm.models.cache.BatchKVCache.update_and_fetch": (
        "d099a9c8781d7d67", "set_size: tokens still at [left_padding, _idx) of the buffers"),
    "mlx_lm.models.cache.BatchKVCache.prepare": ("86bc845de708c274", "BatchCache.prepare"),
    "mlx_lm.models.cache.BatchKVCache.finalize": ("6f06abded406dab4", "BatchCache.prepare (right padding)"),
    "mlx_lm.models.cache.BatchKVCache.filter": ("d7a4d2b5a763bc69", "BatchCache.filter"),
    "mlx_lm.models.cache.BatchKVCache.extend": ("672663f4062ad142", "BatchCache.extend"),
    "mlx_lm.models.cache.BatchKVCache.merge": ("b35ecc517f9540d3", "BatchCache.merge"),
    "mlx_lm.models.cache.BatchKVCache.make_mask": ("17cab343ff407f6c", "BatchCache.make_mask"),
    "mlx_lm.models.cache.BatchKVCache.state": ("2aa53c9083b2f131", "BatchCache.state"),
    "mlx_lm.models.cache.BatchKVCache.size": ("773246b57fb78a8b", "set_size (size() still returns _idx)"),
    "mlx_lm.utils._get_classes": ("c5f60582f151ad98", "model_classes, wrapped by models/loaded.py load_with_weights"),
    "mlx_lm.utils.load_model": (
        "7ee59ae12366f86b", "models/loaded.py load_with_weights: every tensor still through sanitize first"),
}


def upstream_hash(name: str) -> str:
    """Returns the first 16 hex digits of the sha256 of the source of the mlx-lm function
    `name` (module.Class.attr; a property's getter and setter together)."""
    module, cls, attr = name.rsplit(".", 2)
    obj = inspect.getattr_static(getattr(importlib.import_module(module), cls), attr)
    if isinstance(obj, property):
        source = inspect.getsource(obj.fget) + inspect.getsource(obj.fset)
    else:
        source = inspect.getsource(getattr(obj, "__func__", obj))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def model_classes(config: dict) -> tuple[type, type]:
    """Returns the model class and its args class that a model's config names."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


# --- BatchKVCache --------------------------------------------------------------------

def set_size(cache: BatchKVCache, num: int) -> None:
    """Makes `num` the end of the tokens in `cache`'s buffers (what `size()` returns)."""
    cache._idx = num


class BatchCache(BatchKVCache):
    """mlx-lm's BatchKVCache, with string masks while no row is padded.

    mlx-lm's BatchKVCache always builds an array mask (it allows for left padding). MLX
    CUDA's attention with an array mask first builds a full additive mask and the scores
    beside it; with "causal" (or no mask for one query) it needs neither. Measured on an
    H200 at a 25K-token context, one layer: 2048 queries 10.8 ms and 6.68 GB extra with
    the array, 1.65 ms and 34 MB with "causal" (BENCHMARKS.md, "GPU"). A lone request, the
    common case, has no padding, so this cache tracks, on the host, whether any row may
    be padded, and hands out the masks a plain KVCache would while none is.
    """

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.padded = any(left_padding)  # False: no row has padding, for sure

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if not self.padded and not return_array and kwargs.get("window_size") is None:
            return None if N == 1 else "causal"
        return super().make_mask(N, return_array=return_array, **kwargs)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        # Right padding becomes left padding at finalize().
        self.padded = self.padded or any(left_padding or ()) or any(right_padding or ())

    def filter(self, batch_indices):
        super().filter(batch_indices)  # reads left_padding back itself
        self.padded = any(self.left_padding.tolist())

    def extend(self, other):
        lengths_differ = self.size() != other.size()
        super().extend(other)
        self.padded = self.padded or getattr(other, "padded", True) or lengths_differ

    @classmethod
    def merge(cls, caches):
        cache = super().merge(caches)
        lengths = [c.size() for c in caches]
        cache.__class__ = cls
        cache.padded = len(set(lengths)) > 1
        return cache

    @property
    def state(self):
        return BatchKVCache.state.fget(self)

    @state.setter
    def state(self, v):
        BatchKVCache.state.fset(self, v)
        self.padded = True  # unknown: assume padding


def row_view(cache: BatchKVCache, row: int) -> KVCache:
    """Returns row `row` of `cache` as a KVCache over slices of its buffers: no copy, for
    a caller that copies what it keeps at once (and must not hold the slices: a held
    slice makes every later update copy the whole buffer)."""
    pad = 0 if isinstance(cache, BatchCache) and not cache.padded else int(cache.left_padding[row].item())
    end = cache.size()
    view = KVCache()
    view.keys = cache.keys[row:row + 1, :, pad:end]
    view.values = cache.values[row:row + 1, :, pad:end]
    view.offset = end - pad
    return view


# --- PromptProcessingBatch -----------------------------------------------------------

def prompt_padded(batch: PromptProcessingBatch, tokens: list[list[int]], length: int) -> None:
    """Runs `tokens` (one list per row of `batch`) through the model into `batch`'s
    caches, as `batch.prompt(tokens)` does, but with every row right-padded to `length`
    tokens (at least the longest row's), so that calls of different prompts share one
    shape. The padding comes after each row's tokens, where causal attention keeps it
    from them, and `finalize()` turns it into left padding."""
    for held, new in zip(batch.tokens, tokens):
        held += new
    lengths = [len(t) for t in tokens]
    length = max(length, *lengths)
    padding = [length - n for n in lengths]
    ids = mx.array([t + [0] * p for t, p in zip(tokens, padding)])
    if any(padding):
        for c in batch.prompt_cache:
            c.prepare(lengths=lengths, right_padding=padding)
    step = batch.prefill_step_size
    for start in range(0, length, step):
        batch.model(ids[:, start:start + step], cache=batch.prompt_cache)
        mx.eval([c.state for c in batch.prompt_cache])
    if any(padding):
        for c in batch.prompt_cache:
            c.finalize()
        mx.eval([c.state for c in batch.prompt_cache])


# --- GenerationBatch -----------------------------------------------------------------

class LeanGeneration(GenerationBatch):
    """mlx-lm's GenerationBatch, with two changes:

    - Its step normalizes the logits only when a row needs log-probabilities: a batch of
      greedy rows that report none is sampled with one argmax over the logits (see
      `Greedy`), and each row's `logprobs` is then its raw logits, which nothing reads.
    - New rows get no priming pass. mlx-lm runs one forward pass over the rows of a new
      batch when it is made, so that their first token is ready when they join the
      running batch: one more pass of the whole model per start (and on MLX CUDA a
      decode of its own shape). Here a new row's pending token is its last prompt
      token, which the running batch's next pass feeds it together with every other
      row's; that row is "fresh" until then and hands out nothing at that `next()`.
      Its first token comes out of the same number of passes, one step later.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self._priming = True
        super().__init__(*args, **kwargs)
        self._priming = False
        self._next_logprobs = [mx.array(0.0)] * len(self.uids)  # placeholders, one per row
        self._fresh = [True] * len(self.uids)  # pending: the last prompt token, not a sampled one

    def extend(self, batch: GenerationBatch) -> None:
        super().extend(batch)
        self._fresh.extend(batch._fresh)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self._fresh = [self._fresh[i] for i in keep]

    def next(self) -> list[GenerationBatch.Response]:
        """mlx-lm's `next`, which fresh rows sit out: the token this step hands them is
        their own last prompt token."""
        if not self.uids:
            return []
        fresh, self._fresh = self._fresh, [False] * len(self.uids)
        tokens, logprobs = self._step()
        keep, responses = [], []
        for i in range(len(self.uids)):
            if fresh[i]:
                keep.append(i)
                continue
            finish_reason = None
            self._num_tokens[i] += 1
            if self._num_tokens[i] >= self.max_tokens[i]:
                finish_reason = "length"
            if self._matchers[i].advance(tokens[i]):
                finish_reason = "stop"
            if finish_reason is None:
                keep.append(i)
            responses.append(self.Response(
                uid=self.uids[i], token=tokens[i], logprobs=logprobs[i], finish_reason=finish_reason,
                prompt_cache=self.extract_cache(i) if finish_reason else None,
                all_tokens=self.tokens[i] if finish_reason else None))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _step(self) -> tuple[list[int], list[mx.array]]:
        if self._priming:
            return [], []
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        token_context = []
        if any(self.logits_processors):
            rows = []
            for e in range(len(self.uids)):
                row = logits[e:e + 1]
                if self.logits_processors[e]:  # only rows with processors need a context
                    context = self._token_context[e].update_and_fetch(inputs[e:e + 1])
                    token_context.append(context)
                    for processor in self.logits_processors[e]:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
        greedy = all(isinstance(s, Greedy) for s in samplers)
        if greedy and not any(s.logprobs for s in samplers):
            logprobs = logits
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if greedy or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e:e + 1]) for e, s in enumerate(samplers)], axis=0)
        self._next_tokens = sampled
        self._next_logprobs = list(logprobs)
        mx.async_eval(self._next_tokens, self._next_logprobs, token_context)
        mx.eval(inputs, self._current_logprobs)
        tokens = inputs.tolist()
        for row, token in zip(self.tokens, tokens):
            row.append(token)
        return tokens, self._current_logprobs


class EagerGeneration(LeanGeneration):
    """mlx-lm's GenerationBatch without its one-step look-ahead: each `next()` feeds every
    row its pending token and returns the tokens sampled from that forward pass.

    mlx-lm samples token t+1 before handing out token t, so that host work overlaps the
    device's. On MLX's CPU backend `async_eval` returns only once most of the pass has
    run (measured here: 58 of a 66 ms step), so the look-ahead hides little and delays
    every token, the first one included, by a whole forward pass.

    Rows hold the token to feed next in `_next_tokens`: the last prompt token for a new
    row (no priming pass at construction), else the token handed out last. No row is
    ever fresh: the token a step returns is the one it sampled.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fresh = [False] * len(self.uids)

    def _step(self) -> tuple[list[int], list[mx.array]]:
        if self._priming:
            return [], []
        super()._step()  # feeds _next_tokens (recording them in self.tokens), samples the next
        mx.eval(self._next_tokens, self._next_logprobs)
        return self._next_tokens.tolist(), self._next_logprobs
