"""appliance/models/preload.py: the default model's weights, read while `omlx serve` imports."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from appliance.config import LoadedConfig, load_spec
from appliance.models import preload
from appliance.models.headers import weight_files
from appliance.models.loaded import load_model
from appliance.models.weights import load_mlx

REPO = Path(__file__).resolve().parents[2]


def config_of(tmp_path: Path, source: Path | str) -> LoadedConfig:
    path = tmp_path / "omlx.toml"
    path.write_text(f'[[models]]\nname = "smollm2-135m"\nsource = "{source}"\nmax_context_tokens = 2048\n\n'
                    f'[cache]\ndir = "{tmp_path / "cache"}"\n')
    return load_spec(path)


def preloaded(config: LoadedConfig) -> preload.Preloaded | None:
    preload.start(config)
    assert preload.claim("another-model") is None  # not its weights: left for the default model's load
    pending = preload.claim("smollm2-135m")
    assert preload.claim("smollm2-135m") is None  # the default model's load claims it, once
    return pending.result(timeout=120)


def test_off_cuda_nothing_is_preloaded(tmp_path: Path, model_dir: Path):
    if mx.cuda.is_available():
        pytest.skip("this is CUDA")
    assert preloaded(config_of(tmp_path, model_dir)) is None


@pytest.fixture
def as_on_cuda(monkeypatch):
    """The preload's CUDA path on this machine: the pinned loader then fails for want of a
    driver, and the weights are read by mx.load, as that path's fallback reads them."""
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)


def test_the_default_model_s_weights_are_read_and_its_load_takes_them(tmp_path: Path, model_dir: Path, as_on_cuda,
                                                                    caplog):
    config = config_of(tmp_path, model_dir)
    preload.start(config)
    with caplog.at_level(logging.INFO, logger="omlx.models"):
        loaded = load_model(config.spec.default_model, base_dir=config.base_dir,
                            cache_dir=config.spec.cache.path(config.base_dir))
    assert "smollm2-135m preloaded by mx.load" in caplog.text
    assert caplog.text.count("loading them with mx.load") == 1  # read once: the load took the preload
    want = load_mlx(weight_files(model_dir))
    got = dict(tree_flatten(loaded.model.parameters()))
    assert all(mx.array_equal(got[name], want[name]).item() for name in ("model.embed_tokens.weight",
                                                                        "model.norm.weight"))


def test_a_gguf_source_is_not_preloaded(tmp_path: Path, gguf_path: Path, as_on_cuda):
    assert preloaded(config_of(tmp_path, gguf_path)) is None  # it converts first, in the load


def test_a_model_that_does_not_fit_is_not_preloaded(tmp_path: Path, model_dir: Path, as_on_cuda, monkeypatch,
                                                    caplog):
    monkeypatch.setattr("appliance.models.memory.free_bytes", lambda: 1 << 20)
    with caplog.at_level(logging.INFO, logger="omlx.models"):
        assert preloaded(config_of(tmp_path, model_dir)) is None
    assert "no preload (MemoryError" in caplog.text


def test_a_load_takes_only_the_weights_of_its_own_model_and_path():
    done: Future = Future()
    done.set_result(preload.Preloaded("a", Path("/m/a"), "weights of a"))
    assert preload.weights_of(done, "a", Path("/m/a")) == "weights of a"
    assert preload.done(done, "a", Path("/m/a")) and not preload.done(done, "b", Path("/m/a"))
    assert preload.weights_of(done, "b", Path("/m/a")) is None
    assert preload.weights_of(done, "a", Path("/m/b")) is None
    assert preload.weights_of(None, "a", Path("/m/a")) is None
    nothing: Future = Future()
    nothing.set_result(None)
    assert preload.weights_of(nothing, "a", Path("/m/a")) is None
    assert not preload.done(nothing, "a", Path("/m/a")) and not preload.done(Future(), "a", Path("/m/a"))


def test_the_runtime_defers_to_the_preload_s_memory_check_once(tmp_path: Path, model_dir: Path, as_on_cuda,
                                                                 monkeypatch):
    """The weights a preload reads are on the device by the runtime's own check, which
    would count them against the model itself."""
    config = config_of(tmp_path, model_dir)
    preload.start(config)
    assert not preload.memory_checked("another-model")
    assert preload.memory_checked("smollm2-135m")
    assert not preload.memory_checked("smollm2-135m")  # a later load of it checks again
    preload.claim("smollm2-135m").result(timeout=120)
    monkeypatch.setattr("appliance.models.memory.free_bytes", lambda: 1 << 20)
    preload.start(config)  # a model that does not fit: the runtime's check runs and says so
    assert not preload.memory_checked("smollm2-135m")
    assert preload.claim("smollm2-135m").result(timeout=120) is None


def test_off_cuda_the_runtime_checks_memory_itself(tmp_path: Path, model_dir: Path):
    if mx.cuda.is_available():
        pytest.skip("this is CUDA")
    preload.start(config_of(tmp_path, model_dir))
    assert not preload.memory_checked("smollm2-135m")
    preload.claim("smollm2-135m").result(timeout=120)


def test_resident_bytes_are_what_the_device_gained_while_the_model_s_weights_are_read(monkeypatch):
    monkeypatch.setattr(mx, "get_active_memory", lambda: 9000)
    assert preload.resident_bytes("smollm2-135m") == 0  # nothing reading
    monkeypatch.setattr(preload, "_reading", ("smollm2-135m", 2000))
    assert preload.resident_bytes("smollm2-135m") == 7000
    assert preload.resident_bytes("another-model") == 0


def test_a_preload_reports_its_bytes_while_it_reads_and_none_after(tmp_path: Path, model_dir: Path, as_on_cuda,
                                                                  monkeypatch):
    from appliance.models import weights

    seen = []
    real = weights.load_weights

    def load_weights(files, **kw):
        seen.append(preload._reading)
        return real(files, **kw)

    monkeypatch.setattr(weights, "load_weights", load_weights)
    assert preloaded(config_of(tmp_path, model_dir)) is not None
    assert [s[0] for s in seen] == ["smollm2-135m"]  # while reading: its model and MLX's memory before
    for _ in range(100):  # cleared by the preload's thread just after it set the result
        if preload._reading is None:
            break
        time.sleep(0.01)
    assert preload._reading is None and preload.resident_bytes("smollm2-135m") == 0
