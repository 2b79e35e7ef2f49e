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
