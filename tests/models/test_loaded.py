"""appliance/models/loaded.py: the context limit a spec and a model's config give."""

from __future__ import annotations

import logging

import pytest

from appliance.models.loaded import context_tokens
from appliance.spec import ModelSpec

TRAINED = {"max_position_embeddings": 8192}


def spec(**keys) -> ModelSpec:
    return ModelSpec(name="tiny", source="tiny.gguf", **keys)


@pytest.mark.parametrize(("keys", "expected"), [
    ({}, 8192),  # unset: the trained length
    ({"max_context_tokens": 2048}, 2048),  # less: as asked
    ({"max_context_tokens": 16384}, 8192),  # more without the opt-in: capped
])
def test_context_is_capped_at_the_trained_length(keys, expected):
    assert context_tokens(spec(**keys), TRAINED) == expected


def test_beyond_the_trained_length_by_explicit_choice_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="omlx.models"):
        limit = context_tokens(spec(max_context_tokens=16384, allow_beyond_trained_context=True), TRAINED)
    assert limit == 16384
    assert "beyond its trained 8192 tokens" in caplog.text


def test_a_config_without_a_trained_length_falls_back():
    assert context_tokens(spec(), {}) == 4096
    assert context_tokens(spec(max_context_tokens=1000), {}) == 1000


def test_a_model_asked_to_fuse_its_projections_loads_fused(gguf_path, loaded_model, caplog):
    import mlx.core as mx

    from appliance.models.fuse import Part
    from appliance.models.loaded import load_model
    from tests.conftest import REPO, TEST_CACHE

    prompt = mx.array([[1, 504, 2114, 314, 253, 1789, 30]])
    with caplog.at_level(logging.INFO, logger="omlx.models"):
        fused = load_model(ModelSpec(name="fused", source=str(gguf_path), fuse_projections="on"),
                           base_dir=REPO, cache_dir=TEST_CACHE)
    assert isinstance(fused.model.model.layers[0].self_attn.k_proj, Part)
    assert "60 projection groups fused" in caplog.text  # 30 layers: q/k/v and gate/up each
    assert mx.allclose(fused.model(prompt), loaded_model[0](prompt), atol=1e-4).item()


def test_a_model_asked_to_compile_its_blocks_decodes_the_same(gguf_path, loaded_model, caplog):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from appliance.models.compiled_blocks import CompiledBlock
    from appliance.models.loaded import load_model
    from tests.conftest import REPO, TEST_CACHE

    def decode(model) -> mx.array:
        caches = [BatchKVCache([0, 2]) for _ in model.layers]
        out = [model(mx.array([[1, 504, 2114, 314, 253], [0, 0, 1789, 30, 42]]), cache=caches)[:, -1]]
        for _ in range(3):
            out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=caches)[:, -1])
        return mx.stack(out)

    with caplog.at_level(logging.INFO, logger="omlx.models"):
        compiled = load_model(ModelSpec(name="compiled", source=str(gguf_path), compile_blocks="on"),
                              base_dir=REPO, cache_dir=TEST_CACHE)
    assert type(compiled.model.model.layers[0]) is CompiledBlock
    assert "30 blocks decode compiled" in caplog.text
    assert mx.allclose(decode(compiled.model), decode(loaded_model[0]), atol=1e-4).item()
