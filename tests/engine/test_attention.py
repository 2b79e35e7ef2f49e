"""Composed attention: the fused kernel's maths, for short calls, when asked."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest

from appliance.engine import attention
from appliance.engine.attention import SHORT_SCORES, composed, composing, install, is_short


def qkv(rows: int, heads: int, kv_heads: int, length: int, keys: int, dtype=mx.float32):
    mx.random.seed(rows * 100 + keys)
    q = mx.random.normal((rows, heads, length, 16)).astype(dtype)
    k, v = (mx.random.normal((rows, kv_heads, keys, 16)).astype(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_composed_attention_computes_what_the_fused_kernel_does(dtype, heads, kv_heads):
    q, k, v = qkv(3, heads, kv_heads, 5, 9, dtype)
    masks = [None, "causal", mx.random.uniform(shape=(3, 1, 5, 9)) > 0.3,
             mx.random.normal((3, heads, 5, 9)).astype(dtype)]  # keep-masks and added ones
    for mask in masks:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        got = composed(q, k, v, scale=0.25, mask=mask)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=1e-2 if dtype == mx.bfloat16 else 1e-5)


def test_a_query_with_every_key_masked_gets_no_nan():
    """A padded row's padding positions see no key; NaN there would spread to real rows."""
    q, k, v = qkv(2, 4, 4, 3, 6)
    out = composed(q, k, v, scale=0.5, mask=mx.zeros((2, 1, 3, 6), dtype=mx.bool_))
    assert mx.isfinite(out).all().item()
    with pytest.raises(ValueError, match="unknown attention mask"):
        composed(q, k, v, scale=0.5, mask="sliding")


def test_a_call_is_short_with_several_queries_and_few_scores():
    assert is_short(8, 32, 128, 128)  # eight chat prompts started together
    assert is_short(64, 32, 128, 128)
    assert not is_short(1, 32, 2048, 2048)  # a long prompt's chunk keeps the fused kernel
    assert not is_short(32, 32, 1, 4096)  # decoding: one query
    assert is_short(1, 1, SHORT_SCORES, 1) and not is_short(1, 1, SHORT_SCORES + 1, 1)


@pytest.mark.slow
def test_installed_attention_composes_only_where_the_thread_asked(loaded_model, monkeypatch):
    model = loaded_model.model
    install(model)
    module = sys.modules[type(model).__module__]
    assert module.scaled_dot_product_attention is attention.attention
    calls = []
    real = attention.composed
    monkeypatch.setattr(attention, "composed", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompt = mx.array([[1, 2, 3, 4, 5, 6]])
    fused = model(prompt)
    assert calls == []
    with composing(True):
        got = model(prompt)
        with composing(False):
            model(prompt)
    assert len(calls) == model.args.num_hidden_layers  # each layer's attention, once
    assert mx.allclose(got, fused, atol=1e-4)
