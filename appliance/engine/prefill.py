"""A lone prompt's prefill: the plain chunked forward pass, into its batch-of-one cache.

mlx-lm's `PromptProcessingBatch.prompt` runs every batch through `BatchKVCache`, whose
attention mask is always an array (it allows for left padding); MLX CUDA's fused
attention computes "causal" itself but turns an array mask into a full additive one
(heads x chunk x context, 6.7 GB a 2,048-token chunk at a 25K context), so each chunk
runs ~5x slower at 25K tokens on an H200 (BENCHMARKS.md, "GPU"). It also empties MLX's
buffer cache after every chunk, and waits for each chunk before it builds the next.

A batch of one without padding needs none of that: `prefill` runs the chunks through
plain `KVCache`s that share the `BatchKVCache`s' buffers (so the mask is "causal") and
hands the buffers back. Each chunk is queued on the device before the previous one is
waited for, so the host builds the next chunk (and MLX CUDA its attention graph) while
the device runs this one.

Where shapes are free (CPUs) the whole prompt's room is reserved once. On GPUs the
buffers grow with the context, a chunk at a time, as mlx-lm's KVCache grows them: MLX
CUDA builds a cuDNN attention graph for each shape *and stride* it meets (~50 ms on an
H200, bench/attention_graphs.py), and a buffer sized to the prompt gives every chunk of
every new prompt length new strides. Grown with the context, a chunk's (queries,
context, buffer) are the same for every prompt, so each graph is built once per process.
Growing copies the cache once per chunk, ~1 ms at a 25K context there.

Read from mlx-lm 0.32.2 (`models/cache.py`): `BatchKVCache` keeps `keys`/`values`
as [B, heads, allocated, dim] with the tokens at [left_padding, size()), `offset` =
`size() - left_padding` per row (mlxlm_seam.set_size sets where they end); `KVCache`
keeps them at [0, offset). Checked by tests/engine/test_prefill.py.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from appliance.engine.mlxlm_seam import BatchCache, set_size

STEP_TOKENS = BatchKVCache.step  # buffers are allocated in multiples of this


def can_prefill(batch: PromptProcessingBatch) -> bool:
    """Returns whether `batch` is one request whose caches are all unpadded BatchKVCaches."""
    caches = batch.prompt_cache
    if len(batch.uids) != 1 or not caches or any(type(c) not in (BatchKVCache, BatchCache) for c in caches):
        return False
    if isinstance(caches[0], BatchCache):
        return not caches[0].padded
    return caches[0].keys is None or int(caches[0].left_padding[0].item()) == 0


def prefill(batch: PromptProcessingBatch, tokens: list[int], *, chunk_tokens: int,
            shape_tokens: int = 1) -> None:
    """Runs `tokens` through the model into the cache of `batch` (see `can_prefill`),
    `chunk_tokens` at a time, and records them as the tokens that cache holds.

    A last chunk shorter than a multiple of `shape_tokens` is padded up to one and the
    padding's KV dropped again (causal attention: no real token sees the padding), so
    a GPU meets few distinct shapes, each compiled once. With `shape_tokens` > 1 the
    buffers grow with the context instead of being reserved (see the module's
    docstring). Two chunks may be on the device at once: size `chunk_tokens` for that.
    """
    if not tokens:
        return
    batch.tokens[0] += tokens
    caches = [_plain(c) for c in batch.prompt_cache]
    total = caches[0].offset + len(tokens) + shape_tokens - 1  # room for the padding
    reserving = shape_tokens <= 1  # see the module's docstring
    ids = mx.array(tokens)[None]
    if reserving:
        for c in caches:
            reserve(c, total)
    queued = None  # the previous chunk's marker: waited for once this chunk is queued behind it
    for start in range(0, len(tokens), chunk_tokens):
        piece = ids[:, start:start + chunk_tokens]
        pad = -piece.shape[1] % shape_tokens
        if pad:
            piece = mx.concatenate([piece, mx.zeros((1, pad), dtype=piece.dtype)], axis=1)
        batch.model(piece, cache=caches)
        for c in caches:
            c.offset -= pad
        if start == 0 and reserving:  # the buffers exist now, if they did not before
            for c in caches:
                reserve(c, total)
        last = caches[-1]
        marker = mx.sum(last.values[..., last.offset - 1, :1])  # the chunk's last write
        mx.async_eval([(c.keys, c.values) for c in caches], marker)
        if queued is not None:  # at most two chunks' transient memory at once
            mx.eval(queued)
        queued = marker
    mx.eval([(c.keys, c.values) for c in caches])
    for b, c in zip(batch.prompt_cache, caches):
        b.keys, b.values = c.keys, c.values
        set_size(b, c.offset)
        b.offset = mx.array([c.offset])


def reserve(cache: KVCache, num_tokens: int) -> None:
    """Grows `cache`'s buffers once to hold `num_tokens` tokens plus a step of room for
    decoding, so later chunks write in place instead of copying the cache to grow it."""
    if cache.keys is None:
        return
    size = (num_tokens // STEP_TOKENS + 1) * STEP_TOKENS
    have = cache.keys.shape[2]
    if have >= size:
        return
    n = cache.offset

    def grown(a: mx.array) -> mx.array:
        pad = mx.zeros((*a.shape[:2], size - n, a.shape[3]), dtype=a.dtype)
        return mx.concatenate([a[..., :n, :], pad], axis=2)

    cache.keys, cache.values = grown(cache.keys), grown(cache.values)


def _plain(cache: BatchKVCache) -> KVCache:
    """Returns a KVCache over `cache`'s buffers (no copy)."""
    plain = KVCache()
    if cache.keys is not None:
        plain.keys, plain.values, plain.offset = cache.keys, cache.values, cache.size()
    return plain
