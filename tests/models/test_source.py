"""Tests for appliance/models/source.py: turning a configured source into a model directory."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from appliance.models.manifest import verify
from appliance.models.source import ModelSourceError, converted_dir, describe_source, materialize
from tests.conftest import REPO, TEST_CACHE

from .conftest import write_tiny_gguf

HF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def unused_port() -> int:
    """Return a loopback TCP port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_model_dir_is_returned_as_is(model_dir: Path, tmp_path: Path) -> None:
    assert describe_source(str(model_dir), tmp_path) == "mlx-dir"
    assert materialize(str(model_dir), base_dir=tmp_path, cache_dir=tmp_path, dtype="float32") == model_dir
    assert list(tmp_path.iterdir()) == []  # nothing converted or downloaded


def test_gguf_conversion_is_reused(gguf_path: Path, model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    started = time.monotonic()
    again = materialize(str(gguf_path), base_dir=REPO, cache_dir=TEST_CACHE, dtype="float32")
    assert again == model_dir == converted_dir(gguf_path, TEST_CACHE, "float32")
    assert weights.stat().st_mtime_ns == before
    assert time.monotonic() - started < 5  # a fingerprint, not a conversion (~10 s)


def test_relative_gguf_path_resolves_against_base_dir(gguf_path: Path, model_dir: Path, tmp_path: Path) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / gguf_path.name).symlink_to(gguf_path)
    source = f"../weights/{gguf_path.name}"
    assert describe_source(source, config_dir) == "gguf"
    # Same content, same name: the cached conversion is found, wherever the file lives.
    assert materialize(source, base_dir=config_dir, cache_dir=TEST_CACHE, dtype="float32") == model_dir


def test_leftover_partial_is_not_a_finished_model(bfloat16_conversion: tuple[Path, Path]) -> None:
    model_dir, leftover = bfloat16_conversion
    assert model_dir.name.endswith("-bfloat16") and (model_dir / "model.safetensors").stat().st_size > 200e6
    assert not leftover.exists()  # its process is gone, so the new conversion cleared it
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name]


@pytest.mark.parametrize("source", ["./missing.gguf", "missing.gguf", "/nowhere/model", "~/no-such-dir-omlx-test"])
def test_missing_local_path_names_it(source: str, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no such file") as raised:
        materialize(source, base_dir=tmp_path, cache_dir=tmp_path, dtype="float32")
    assert source in str(raised.value)


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "empty-model" / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"'empty-model' is not a model directory"):
        materialize("empty-model", base_dir=tmp_path, cache_dir=tmp_path, dtype="float32")


def test_unsupported_gguf_names_the_source(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "ssm.gguf", arch="mamba")
    with pytest.raises(ModelSourceError, match=r"ssm\.gguf.*'mamba' is not supported \(supported: llama\)"):
        materialize("ssm.gguf", base_dir=tmp_path, cache_dir=tmp_path / "cache", dtype="float32")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_nonsense_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="neither a local path nor a Hugging Face repo id"):
        describe_source("not a model", tmp_path)


@pytest.mark.timeout(60)
def test_repo_id_without_network_fails_fast(tmp_path: Path) -> None:
    # This machine reaches no model hub; with one, the repo would simply not exist.
    source = "omlx-tests/no-such-model"
    assert describe_source(source, tmp_path) == "hf-repo"
    started = time.monotonic()
    with pytest.raises(ModelSourceError, match="omlx-tests/no-such-model") as raised:
        materialize(source, base_dir=tmp_path, cache_dir=tmp_path, dtype="float32")
    assert time.monotonic() - started < 30
    assert "local directory" in str(raised.value)


@pytest.mark.timeout(60)
def test_unreachable_hub_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unused_port: int) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{unused_port}")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError) as raised:
        materialize(f"{HF_REPO}@main", base_dir=tmp_path, cache_dir=tmp_path, dtype="float32")
    message = str(raised.value)
    assert message.startswith(f"could not download {HF_REPO}@main: hub unreachable (ConnectError")
    assert f"hf download {HF_REPO}" in message and "set source to the local directory" in message


@pytest.mark.timeout(60)
def test_offline_mode_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError, match=r"hub unreachable \(HF_HUB_OFFLINE is set\)"):
        materialize(HF_REPO, base_dir=tmp_path, cache_dir=tmp_path, dtype="float32")


def test_a_conversion_that_does_not_verify_is_converted_again(
        gguf_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache_dir = tmp_path / "cache"
    first = materialize(str(gguf_path), base_dir=REPO, cache_dir=cache_dir, dtype="bfloat16")
    assert verify(first) is None
    (first / "tokenizer_config.json").write_bytes(b"\xff\xfe\x00 not utf-8")  # what broke a load before
    with caplog.at_level(logging.WARNING, logger="appliance.models.source"):
        again = materialize(str(gguf_path), base_dir=REPO, cache_dir=cache_dir, dtype="bfloat16")
    assert again == first
    assert verify(again) is None
    assert "tokenizer_config.json: " in caplog.text and "converting" in caplog.text
    assert json.loads((again / "tokenizer_config.json").read_text())  # readable again
