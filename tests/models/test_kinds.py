"""appliance/models/kinds.py: a model's kinds of weights, from the loaded model and, before
its load, from its files: the same, for the real tiny model as converted, cast and
quantized as mlx-lm quantizes (a layer apart at other bits)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.utils import quantize_model, save_config, save_model

from appliance.models import kinds

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def quantized_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Returns the tiny model quantized to 4 bits, its down projections to 8, as mlx-lm's
    convert writes it."""
    model, _, config = mlx_lm.load(str(model_dir), return_config=True)
    down = {"group_size": 64, "bits": 8, "mode": "affine"}
    model, config = quantize_model(model, config, 64, 4,
                                   quant_predicate=lambda path, _: down if path.endswith("down_proj") else True)
    out = tmp_path_factory.mktemp("quantized")
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, out / name)
    return out


def test_the_kinds_read_from_a_models_files_are_those_of_the_model_mlx_lm_loads(model_dir: Path,
                                                                                quantized_dir: Path):
    plain, _ = mlx_lm.load(str(model_dir))
    assert kinds.of_model(plain) == ("float32",)
    assert kinds.expected(str(model_dir), dtype="auto", base_dir=Path("/")) == ("float32",)
    quantized, _ = mlx_lm.load(str(quantized_dir))
    assert kinds.of_model(quantized) == ("b4_g64_affine", "b8_g64_affine", "float32", "uint32")
    assert kinds.expected(quantized_dir.name, dtype="auto", base_dir=quantized_dir.parent) == kinds.of_model(quantized)


def test_a_cast_changes_the_floats_and_leaves_the_quantized_weights(quantized_dir: Path):
    assert kinds.expected(str(quantized_dir), dtype="bfloat16", base_dir=Path("/")) == (
        "b4_g64_affine", "b8_g64_affine", "bfloat16", "uint32")


def test_a_gguf_converts_to_floats_of_the_dtype_asked_for(gguf_path: Path):
    assert kinds.expected(str(gguf_path), dtype="auto", base_dir=Path("/")) == ("float32",)
    assert kinds.expected(str(gguf_path), dtype="float16", base_dir=Path("/")) == ("float16",)


def test_what_is_not_here_or_cannot_be_read_is_not_known(tmp_path: Path, model_dir: Path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing downloaded
    assert kinds.expected("someone/some-model", dtype="auto", base_dir=tmp_path) is None
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00")  # cut short
    assert kinds.expected(str(broken), dtype="auto", base_dir=tmp_path) is None
    assert kinds.of_config({"quantization_config": {"quant_method": "fp8"}}) is None  # a checkpoint's own


def test_a_model_in_the_local_hub_cache_is_read_there(tmp_path: Path, model_dir: Path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--someone--some-model" / "snapshots" / ("0" * 40)
    shutil.copytree(model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert kinds.expected("someone/some-model", dtype="auto", base_dir=tmp_path) == ("float32",)
