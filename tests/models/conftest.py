"""Session fixtures for the model tests: the real SmolLM2 GGUF, converted once and cached;
and small generated Llama-shaped models for the GPU tests (the GGUF is not carried there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from appliance.models.gguf import PARTIAL_MARK
from appliance.models.source import converted_dir, materialize
from tests.conftest import MODEL_GGUF, REPO, TEST_CACHE


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """Return the default model's GGUF file, fetched by `make setup-test`."""
    if not MODEL_GGUF.is_file():
        pytest.fail(f"{MODEL_GGUF} is missing: run `make setup-test` (or `make model`) first")
    return MODEL_GGUF


@pytest.fixture(scope="session")
def model_dir(gguf_path: Path) -> Path:
    """Return the float32 MLX conversion of the GGUF, from the persistent test cache."""
    return materialize(str(gguf_path), base_dir=REPO, cache_dir=TEST_CACHE, dtype="float32")


@pytest.fixture(scope="session")
def loaded_model(model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Return `(model, tokenizer)` as mlx_lm loads the converted directory."""
    return mlx_lm.load(str(model_dir))


@pytest.fixture(scope="session")
def bfloat16_conversion(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Return `(model_dir, leftover)`: a bfloat16 conversion made beside a crashed conversion's partial."""
    cache_dir = tmp_path_factory.mktemp("bf16-cache")
    target = converted_dir(gguf_path, cache_dir, "bfloat16")
    leftover = target.with_name(f"{target.name}{PARTIAL_MARK}{_dead_pid()}-crashed")
    leftover.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):  # looks like a model, but was never finished
        (leftover / name).write_text("{}")
    model_dir = materialize(str(gguf_path), base_dir=REPO, cache_dir=cache_dir, dtype="bfloat16")
    return model_dir, leftover


def _dead_pid() -> int:
    """Return the id of a process that has already exited."""
    code = "import os; print(os.getpid())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(child.stdout)


def write_tiny_gguf(path: Path, *, arch: str) -> Path:
    """Write a minimal valid GGUF file of the given architecture and return its path."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def generated_llama():
    """Returns `make(layers, seed)`: a Llama-shaped model (hidden 256, 8 / 2 heads, FFN 512,
    a 512-token vocabulary) with random bfloat16 weights, evaluated, as GPUs run it."""
    from mlx_lm.models import llama

    def make(layers: int, seed: int) -> nn.Module:
        config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": layers, "intermediate_size": 512,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 512,
                  "rope_theta": 10000.0}
        mx.random.seed(seed)
        model = llama.Model(llama.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        return model

    return make
