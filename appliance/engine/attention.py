"""Which attention a model's short prefill calls take: MLX's fused kernel, or the same
maths composed of plain MLX ops (`[batching] short_attention = "composed"`).

MLX CUDA runs attention with more than one query through cuDNN graphs cached per shape
and stride, per thread: on an H200 a new key costs ~50 ms, the first of each kind
0.6-0.9 s, and a padded batch (an array mask) 0.9 s for each new length
(bench/attention_graphs.py, docs/GPU.md). The batched starts of chat-sized prompts meet
a new key nearly every wave (rows x padded length x the KV buffer's length), and those
builds, not the maths, were most of their cost: 7 prompts of ~125 tokens took 0.37 s to
start over HTTP, against 0.07 s in process once their keys were built. Composed, a short
call's attention is two matmuls, a `where` and a softmax, kernels with no per-shape
build. On the H200 that made a wave's starts faster but its decode steps slower, the
throughput the same within the noise (BENCHMARKS.md, 2026-12-05 05:05), so the fused
kernel stays the default. A call counts as short when its scores (rows x heads x
queries x keys) are at most `SHORT_SCORES`: a chunk of a long prompt is far larger and
keeps the fused kernel, whose graphs are the same for every prompt (engine/prefill.py).

mlx-lm's models call `mlx_lm.models.base.scaled_dot_product_attention`, imported into each
model's module; `install` points that name at `attention` here, which composes when the
engine thread asked for it (`composing`) and the call is short, else calls mlx-lm's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

SHORT_SCORES = 1 << 26  # attention scores of a short call at most: 128 MiB at 2 bytes each

_upstream = base.scaled_dot_product_attention
_thread = threading.local()  # .composing: this thread's calls may compose


def is_short(rows: int, heads: int, queries: int, keys: int) -> bool:
    """Returns whether a call of `queries` queries per row over `keys` keys composes
    (when composing is on): more than one query, scores within `SHORT_SCORES`."""
    return queries > 1 and rows * heads * queries * keys <= SHORT_SCORES


@contextmanager
def composing(on: bool) -> Iterator[None]:
    """Within it, this thread's short calls compose when `on`."""
    before = getattr(_thread, "composing", False)
    _thread.composing = on
    try:
        yield
    finally:
        _thread.composing = before


def install(model: nn.Module) -> None:
    """Points the attention of `model`'s modules at `attention` (once per module)."""
    for name in {type(m).__module__ for m in [model, *model.modules()]}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is _upstream:
            module.scaled_dot_product_attention = attention


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
              mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, composed for short calls when asked."""
    if (getattr(_thread, "composing", False) and sinks is None and not hasattr(cache, "bits")
            and is_short(queries.shape[0], queries.shape[1], queries.shape[2], keys.shape[2])):
        return composed(queries, keys, values, scale=scale, mask=mask)
    return _upstream(queries, keys, values, cache, scale, mask, sinks)


def composed(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any) -> mx.array:
    """Attention of `queries` [B, heads, L, D] over `keys`/`values` [B, kv heads, S, D]
    with `mask` None, "causal" (the last L of S positions) or an array (bool: keep;
    else added): what `mx.fast.scaled_dot_product_attention` computes. A query whose
    keys are all masked (a padded row's padding) gets an average, never NaN."""
    rows, heads, length, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    q = queries * mx.array(scale, dtype=queries.dtype)
    grouped = heads != kv_heads
    if grouped:  # each kv head serves heads // kv_heads query heads
        q = q.reshape(rows, kv_heads, heads // kv_heads, length, dim)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = mx.arange(num_keys - length, num_keys)[:, None] >= mx.arange(num_keys)[None]
    if mask is not None:
        if grouped and mask.ndim >= 3:  # [.., 1 or heads, L, S] -> [.., kv heads or 1, group or 1, L, S]
            if mask.shape[-3] == 1:
                mask = mx.expand_dims(mask, -3)
            else:
                mask = mask.reshape(*mask.shape[:-3], kv_heads, heads // kv_heads, *mask.shape[-2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    return out.reshape(rows, heads, length, dim) if grouped else out
