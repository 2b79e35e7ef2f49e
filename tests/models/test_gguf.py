"""Tests for appliance/models/gguf.py: the GGUF → MLX converter, against the real SmolLM2 GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer

from appliance.models import gguf as converter
from appliance.models.gguf import ModelSourceError, convert_gguf, fingerprint

from .conftest import write_tiny_gguf

# Reference ids from llama.cpp's own tokenizer, not from this converter: recorded once with the
# PyPI wheel llama-cpp-cffi 0.4.42 (its CPU build of libllama, called through cffi:
# llama_model_load_from_file(vocab_only) + llama_tokenize(vocab, text, add_special=False,
# parse_special=True)) on SmolLM2-135M-Instruct.Q4_1.gguf, whose pre-tokenizer is "smollm".
LLAMA_CPP_IDS = [
    ("The quick brown fox jumps over the lazy dog.", [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]),
    ("def add(a, b):\n    return a + b\n", [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198]),
    ("12345", [33, 34, 35, 36, 37]),
    (
        "Order 66 costs $1,024.50 in 2024",
        [22977, 216, 38, 38, 3499, 1885, 33, 28, 32, 34, 36, 30, 37, 32, 281, 216, 34, 32, 34, 36],
    ),
    (
        "Café naïve 日本語 🙂👍",
        [51, 1939, 2756, 15486, 46494, 17097, 241, 115, 40993, 179, 120, 248, 47526, 10813, 235, 231],
    ),
    ("   leading spaces", [256, 2899, 5600]),
    (" hello\n\n\tworld  ", [33662, 1116, 197, 6693, 256]),
    ("<|im_start|>user\nhi<|im_end|>\n", [1, 4093, 198, 6004, 2, 198]),
    (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
         198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    ),
]
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # shared/models/README.md


@pytest.mark.parametrize(("text", "ids"), LLAMA_CPP_IDS, ids=[repr(t[:24]) for t, _ in LLAMA_CPP_IDS])
def test_token_ids_match_llama_cpp(
    model_dir: Path, loaded_model: tuple[nn.Module, TokenizerWrapper], text: str, ids: list[int]
) -> None:
    _, tokenizer = loaded_model
    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids == ids
    assert tokenizer.encode(text, add_special_tokens=False) == ids  # the path the server takes


def test_no_bos_is_added(loaded_model: tuple[nn.Module, TokenizerWrapper]) -> None:
    # llama.cpp with add_special=True also gives [6004]: the GGUF says add_bos_token = false.
    _, tokenizer = loaded_model
    assert tokenizer.encode("hi") == [6004]


def test_special_tokens_and_chat_template(model_dir: Path, gguf_path: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    _, metadata = mx.load(str(gguf_path), return_metadata=True)
    assert config["chat_template"] == metadata["tokenizer.chat_template"]
    specials = (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"])
    assert specials == ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert len(config["added_tokens_decoder"]) == 17  # the CONTROL tokens
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_config_describes_smollm2(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
        "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


def _llama_cpp_permute(w: mx.array, n_heads: int) -> mx.array:
    """Return `w` with rows permuted the way llama.cpp's convert_hf_to_gguf.py does (HF → GGUF)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name", "n_heads"),
    [
        ("blk.0.attn_q", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.0.attn_k", "model.layers.0.self_attn.k_proj.weight", 3),
        ("blk.29.ffn_down", "model.layers.29.mlp.down_proj.weight", None),
        ("token_embd", "model.embed_tokens.weight", None),  # Q8_0, the others Q4_1
    ],
)
def test_weights_match_mlx_dequantization(
    model_dir: Path, gguf_path: Path, gguf_name: str, hf_name: str, n_heads: int | None
) -> None:
    # Independent route: MLX reads Q4_1/Q8_0 GGUF tensors natively as (weight, scales, biases).
    quantized = mx.load(str(gguf_path))
    packed, scales, biases = (quantized[f"{gguf_name}.{part}"] for part in ("weight", "scales", "biases"))
    bits = packed.shape[1] // scales.shape[1]  # a group of 32 values packs into `bits` uint32 words
    expected = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
    converted = mx.load(str(model_dir / "model.safetensors"))[hf_name]
    if n_heads is not None:
        converted = _llama_cpp_permute(converted, n_heads)
    assert converted.dtype == mx.float32 and converted.shape == expected.shape
    assert mx.allclose(converted, expected, rtol=0, atol=1e-6).item()  # observed: identical


def test_norm_weights_are_copied_exactly(model_dir: Path, gguf_path: Path) -> None:
    expected = mx.load(str(gguf_path))["blk.0.attn_norm.weight"]
    converted = mx.load(str(model_dir / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    assert mx.array_equal(converted, expected).item()


def test_greedy_answer_names_paris(loaded_model: tuple[nn.Module, TokenizerWrapper]) -> None:
    model, tokenizer = loaded_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == LLAMA_CPP_IDS[-1][1]  # the template renders the ChatML prompt llama.cpp tokenized
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer


def test_bfloat16_weights_are_rounded_float32(bfloat16_conversion: tuple[Path, Path], model_dir: Path) -> None:
    bf16_dir, _ = bfloat16_conversion
    name = "model.layers.0.self_attn.q_proj.weight"
    converted = mx.load(str(bf16_dir / "model.safetensors"))[name]
    reference = mx.load(str(model_dir / "model.safetensors"))[name].astype(mx.bfloat16)
    assert converted.dtype == mx.bfloat16
    assert mx.array_equal(converted, reference).item()
    assert json.loads((bf16_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_fingerprint_is_the_file_sha256(gguf_path: Path) -> None:
    assert fingerprint(gguf_path) == GGUF_SHA256


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny-mamba.gguf", arch="mamba")
    with pytest.raises(ModelSourceError, match=r"tiny-mamba\.gguf.*architecture 'mamba' is not supported"):
        convert_gguf(path, tmp_path / "out", dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-mamba.gguf"]


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelSourceError, match=r"fake\.gguf: not a readable GGUF file"):
        convert_gguf(path, tmp_path / "out", dtype="float32")


def test_failed_conversion_leaves_nothing(gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = []

    def fail_midway(w: np.ndarray, dtype: mx.Dtype) -> bytes:
        if len(written) == 20:
            raise OSError("disk full (injected)")
        written.append(w.shape)
        return to_bytes(w, dtype)

    to_bytes = converter._to_bytes
    monkeypatch.setattr(converter, "_to_bytes", fail_midway)  # fails with the weights file half written
    with pytest.raises(OSError, match="injected"):
        convert_gguf(gguf_path, tmp_path / "model", dtype="float16")
    assert list(tmp_path.iterdir()) == []


def test_unknown_dtype_is_refused(gguf_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float8"):
        convert_gguf(gguf_path, tmp_path / "model", dtype="float8")

