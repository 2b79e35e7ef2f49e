"""The warm-up beside the load: a one-layer stand-in read from the model's own files."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import mlx.core as mx
import pytest

from appliance.cache.kv import probe_layout
from appliance.engine.stand_in import load_stand_in, warm_up_stand_in
from appliance.spec import BatchingSpec

pytestmark = pytest.mark.slow


def test_a_stand_in_is_the_model_cut_to_its_first_layer(loaded_model):
    stand_in = load_stand_in(loaded_model.spec, loaded_model.path, loaded_model.dtype)
    model, full = stand_in.model, loaded_model.model
    assert len(model.layers) == 1 < len(full.layers)
    assert probe_layout(model) == replace(probe_layout(full), num_layers=1)
    # The model's own weights, read from its files: embeddings and the first layer.
    assert mx.array_equal(model.model.embed_tokens.weight, full.model.embed_tokens.weight)
    assert mx.array_equal(model.layers[0].self_attn.q_proj.weight, full.layers[0].self_attn.q_proj.weight)
    assert stand_in.tokenizer.encode("hello") == loaded_model.tokenizer.encode("hello")


def test_the_stand_in_warms_up_and_hands_over_the_model_s_layout(loaded_model, caplog):
    layouts = []
    with caplog.at_level(logging.INFO, logger="omlx.engine"):
        ran = warm_up_stand_in(loaded_model.spec, loaded_model.path, loaded_model.dtype,
                               BatchingSpec(prefill_chunk_tokens=64), on_layout=layouts.append)
    assert ran
    assert layouts == [probe_layout(loaded_model.model)]  # the model's, its layer count included
    assert "warmed up beside its load" in caplog.text


def test_an_architecture_that_does_not_cut_gets_no_stand_in(tmp_path, loaded_model):
    (tmp_path / "config.json").write_text(json.dumps({  # gpt2 counts its layers in n_layer
        "model_type": "gpt2", "n_ctx": 64, "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 64,
        "layer_norm_epsilon": 1e-5, "vocab_size": 64}))
    assert load_stand_in(loaded_model.spec, tmp_path, None) is None
    assert not warm_up_stand_in(loaded_model.spec, tmp_path, None, BatchingSpec())


def test_a_stand_in_that_fails_is_logged_and_the_load_goes_on(tmp_path, loaded_model, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with caplog.at_level(logging.WARNING, logger="omlx.engine"):
        assert not warm_up_stand_in(loaded_model.spec, tmp_path, None, BatchingSpec())
    assert "the warm-up beside its load failed" in caplog.text


def test_a_stand_in_that_would_crowd_the_model_is_not_loaded(loaded_model, caplog):
    with caplog.at_level(logging.INFO, logger="omlx.engine"):
        assert load_stand_in(loaded_model.spec, loaded_model.path, loaded_model.dtype, room_bytes=1 << 20) is None
    assert "no room for its stand-in" in caplog.text


def test_a_stand_in_counts_the_weights_a_preload_has_read_as_the_model_s(loaded_model, monkeypatch):
    """A preload still reading the model's weights holds some on the device: counted once."""
    from appliance.engine import stand_in

    asked = []
    monkeypatch.setattr(stand_in.preload, "resident_bytes", lambda model: 123 if model == loaded_model.spec.name else 0)
    monkeypatch.setattr(stand_in, "room_beside", lambda path, resident=0: asked.append(resident) or 0)
    assert not warm_up_stand_in(loaded_model.spec, loaded_model.path, loaded_model.dtype, BatchingSpec())
    assert asked == [123]
