"""A Llama block's decode calls compiled: the same logits, the same module, only decode calls."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from appliance.kernels import small_matmul
from appliance.models.compiled_blocks import CompiledBlock, compile_blocks
from appliance.models.fuse import fuse_projections
from appliance.models.native_linear import native_linear_here

PROMPT_ROWS = [[3, 9, 27, 81, 243, 217, 139], [5, 25, 125, 113], [11, 121, 307, 306, 295, 174]]


def batch_run(model, steps: int = 5) -> mx.array:
    """Returns the last logits of a padded prompt of three rows, then of `steps` greedy decode
    steps, through a batch cache (as a generation batch decodes)."""
    longest = max(map(len, PROMPT_ROWS))
    padding = [longest - len(p) for p in PROMPT_ROWS]
    caches = [BatchKVCache(padding) for _ in model.layers]
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, PROMPT_ROWS)])
    out = [model(tokens, cache=caches)[:, -1]]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=caches)[:, -1])
    return mx.stack(out).astype(mx.float32)


def test_compiled_blocks_decode_as_the_blocks_do(generated_llama):
    model = generated_llama(3, seed=2)
    fuse_projections(model)
    before, parameters = batch_run(model), tree_flatten(model.parameters())
    assert compile_blocks(model) == 3
    assert all(type(block) is CompiledBlock for block in model.layers)
    assert [(k, id(v)) for k, v in tree_flatten(model.parameters())] == [(k, id(v)) for k, v in parameters]
    after = batch_run(model)
    assert mx.allclose(before, after, rtol=1e-2, atol=1e-2).item(), mx.abs(before - after).max().item()
    assert "_compiled_parts" in model.layers[0].__dict__  # the decode steps ran compiled


def test_a_plain_cache_and_a_prompt_run_the_blocks_own_call(generated_llama):
    """An int offset (a lone KVCache) would trace anew at every step: those calls, and
    calls of more than one token, are the block's own."""
    model = generated_llama(2, seed=3)
    compile_blocks(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache), model(mx.array([[5]]), cache=cache))
    assert "_compiled_parts" not in model.layers[0].__dict__


@pytest.mark.skipif(not mx.cuda.is_available(), reason="small_matmul runs on CUDA")
def test_on_cuda_compiled_blocks_with_the_small_matmul_decode_the_same(generated_llama):
    model = generated_llama(4, seed=5)
    small_matmul.ENABLED = False
    before = batch_run(model)
    fuse_projections(model)
    native_linear_here(model)
    compile_blocks(model)
    small_matmul.ENABLED = True
    try:
        after = batch_run(model)
    finally:
        small_matmul.ENABLED = False
    assert mx.allclose(before, after, rtol=2e-2, atol=2e-2).item(), mx.abs(before - after).max().item()
    assert True in model.layers[0].__dict__["_compiled_parts"]  # traced with the kernel on


def test_a_dropped_model_s_compiled_blocks_go_with_it(generated_llama):
    """The compiled functions hold their block weakly: no cycle keeps a dropped model."""
    import weakref

    model = generated_llama(1, seed=4)
    compile_blocks(model)
    batch_run(model, steps=1)
    gone = weakref.ref(model.layers[0])
    del model
    assert gone() is None  # freed at once, without the cycle collector
