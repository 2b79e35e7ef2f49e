"""The largest prefill call: bounded by free memory, with attention scores when unfused."""

from __future__ import annotations

from appliance.engine.call_budget import MIN_CALL_TOKENS, ModelShape, max_call_tokens, model_shape

# Llama-3-8B's shape with SmolLM2's vocabulary, bf16
EIGHT_B = ModelShape(hidden=4096, ffn=14336, heads=32, vocab=49152, kv_bytes_per_token=131072)
GB = 10**9


def test_fused_calls_are_bounded_by_activations_only():
    n = max_call_tokens(EIGHT_B, context_tokens=32768, free=80 * GB)
    assert 50_000 < n < 200_000  # ≈ 0.54 MB a token, measured 0.4–0.6 on an H200


def test_unfused_calls_count_the_attention_scores():
    fused = max_call_tokens(EIGHT_B, context_tokens=32768, free=80 * GB)
    unfused = max_call_tokens(EIGHT_B, context_tokens=32768, free=80 * GB, fused=False)
    assert unfused < fused / 4
    # the failure seen on the H200: 32K tokens in one unfused call wanted far more than free
    assert unfused < 32768
    assert unfused * (EIGHT_B.token_bytes + EIGHT_B.score_bytes(32768)) < 80 * GB


def test_no_memory_left_still_allows_a_minimal_call_and_unknowns_bound_nothing():
    assert max_call_tokens(EIGHT_B, context_tokens=32768, free=0) == MIN_CALL_TOKENS
    assert max_call_tokens(None, context_tokens=100, free=GB) is None


def test_the_shape_is_read_from_the_model(loaded_model):
    shape = model_shape(loaded_model.model)
    args = loaded_model.model.args
    assert shape.hidden == args.hidden_size and shape.vocab == args.vocab_size
    assert shape.kv_bytes_per_token == 2 * args.num_hidden_layers * args.num_key_value_heads * \
        (args.hidden_size // args.num_attention_heads) * 4  # float32 on the CPU
