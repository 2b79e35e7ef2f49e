"""A lone prompt's prefill through plain KVCaches: the same cache and logits as mlx-lm's
batch path, buffers grown once (or, where shapes matter, with the context), and the
caches' layout as read from mlx-lm."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from appliance.engine.mlxlm_seam import BatchCache
from appliance.engine.prefill import STEP_TOKENS, can_prefill, prefill, reserve

pytestmark = pytest.mark.slow


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def batch_of_one(model, caches) -> PromptProcessingBatch:
    batch = PromptProcessingBatch(model, [0], [[]], tokens=[[]], prefill_step_size=64)
    batch.prompt_cache = caches
    return batch


def kv(batch: PromptProcessingBatch, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    c = batch.prompt_cache[layer]
    pad = int(c.left_padding[0].item())
    return np.array(c.keys[0, :, pad:c.size()]), np.array(c.values[0, :, pad:c.size()])


def test_prefill_writes_the_same_cache_as_mlx_lms_batch_path(loaded_model):
    model, prompt = loaded_model.model, tokens(300)
    ours = batch_of_one(model, [BatchCache([0]) for _ in make_prompt_cache(model)])
    theirs = PromptProcessingBatch(model, [0], [make_prompt_cache(model)], prefill_step_size=64)
    assert can_prefill(ours)
    prefill(ours, prompt[:200], chunk_tokens=64)
    prefill(ours, prompt[200:], chunk_tokens=64)  # a second call continues the same cache
    theirs.prompt([prompt])
    assert ours.tokens == theirs.tokens == [prompt]
    for layer in (0, len(ours.prompt_cache) - 1):
        c = ours.prompt_cache[layer]
        assert c.size() == 300 and c.offset.tolist() == [300]
        for a, b in zip(kv(ours, layer), kv(theirs, layer)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_the_next_forward_pass_gives_the_same_logits(loaded_model):
    model, prompt = loaded_model.model, tokens(150, seed=1)
    ours = batch_of_one(model, [BatchCache([0]) for _ in make_prompt_cache(model)])
    prefill(ours, prompt, chunk_tokens=64)
    plain = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=plain)
    step = mx.array([[123]])
    np.testing.assert_allclose(np.array(model(step, cache=ours.prompt_cache)),
                               np.array(model(step, cache=plain)), rtol=1e-4, atol=1e-4)


def test_the_buffers_are_grown_once_for_the_whole_prompt(loaded_model):
    model = loaded_model.model
    ours = batch_of_one(model, [BatchCache([0]) for _ in make_prompt_cache(model)])
    prefill(ours, tokens(1000), chunk_tokens=128)
    c = ours.prompt_cache[0]
    assert c.keys.shape[2] == (1000 // STEP_TOKENS + 1) * STEP_TOKENS  # room to decode, no regrowth


def test_with_shapes_the_buffers_grow_with_the_context(loaded_model, monkeypatch):
    # MLX CUDA keys its attention graphs on the buffer's length too: every prompt's full
    # chunks must meet the same (context, buffer), whatever the prompt's length.
    model, seen = loaded_model.model, []
    update = KVCache.update_and_fetch

    def recording(self, keys, values):
        out = update(self, keys, values)
        seen.append((out[0].shape[2], self.keys.shape[2]))  # (context, buffer), every layer alike
        return out

    monkeypatch.setattr(KVCache, "update_and_fetch", recording)
    shapes = {}
    for n in (1000, 700):
        ours = batch_of_one(model, [BatchCache([0]) for _ in make_prompt_cache(model)])
        seen.clear()
        prefill(ours, tokens(n, seed=n), chunk_tokens=256, shape_tokens=256)
        shapes[n] = list(dict.fromkeys(seen))
        assert ours.prompt_cache[0].size() == n
        assert ours.prompt_cache[0].keys.shape[2] == -(-n // 256) * 256  # no reserved room
    assert shapes[1000] == [(256, 256), (512, 512), (768, 768), (1024, 1024)]
    assert shapes[700] == shapes[1000][:3]


def test_reserve_keeps_what_the_cache_holds():
    c = KVCache()
    k = mx.random.normal((1, 2, 10, 4))
    c.update_and_fetch(k, k)
    reserve(c, 600)
    assert c.keys.shape[2] == 768 and c.offset == 10
    np.testing.assert_array_equal(np.array(c.keys[..., :10, :]), np.array(k))


def test_padded_or_foreign_batches_go_to_mlx_lm(loaded_model):
    model = loaded_model.model
    padded = BatchCache([3])
    assert not can_prefill(batch_of_one(model, [padded]))
    assert not can_prefill(batch_of_one(model, [KVCache()]))
    two = PromptProcessingBatch(model, [0, 1], [[], []], tokens=[[], []])
    two.prompt_cache = [BatchKVCache([0, 0])]
    assert not can_prefill(two)


def test_a_padded_last_chunk_leaves_the_same_cache(loaded_model):
    model, prompt = loaded_model.model, tokens(300, seed=2)
    padded = batch_of_one(model, [BatchCache([0]) for _ in make_prompt_cache(model)])
    plain = batch_of_one(model, [BatchCache([0]) for _ in make_prompt_cache(model)])
    prefill(padded, prompt, chunk_tokens=128, shape_tokens=64)  # 128, 128, then 44 padded to 64
    prefill(plain, prompt, chunk_tokens=128)
    assert padded.prompt_cache[0].size() == 300 and padded.tokens == [prompt]
    for a, b in zip(kv(padded), kv(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
