"""The engine's per-layer batch cache: mlx-lm's BatchKVCache, with string masks while no
row is padded.

mlx-lm's BatchKVCache always builds an array mask (it allows for left padding). MLX
CUDA's fused attention takes only the "causal" mask (and no mask for one query); with
an array it materializes the scores. Measured on an H200 at a 25K-token context, one
layer: 2048 queries 10.5 ms and 6.7 GB of scores with the array, 1.6 ms and 17 MB with
"causal" (BENCHMARKS.md, "GPU"). A lone request, the common case, has no padding, so
this cache tracks, on the host, whether any row may be padded, and hands out the
masks a plain KVCache would while none is.

Read from mlx-lm 0.32.2 (`models/cache.py`): the methods that change `left_padding`
(`prepare`, `finalize`, `filter`, `extend`, `merge`, the `state` setter) are the ones
overridden here; tests/cache/test_batch_cache.py checks the masks against mlx-lm's.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache, KVCache


class BatchCache(BatchKVCache):
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
        lengths_differ = self._idx != other._idx
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
    view = KVCache()
    view.keys = cache.keys[row:row + 1, :, pad:cache._idx]
    view.values = cache.values[row:row + 1, :, pad:cache._idx]
    view.offset = cache._idx - pad
    return view
