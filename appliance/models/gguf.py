"""Converts a llama-architecture GGUF file into an MLX model directory that mlx_lm loads.

The directory holds `config.json`, one `model.safetensors` in the requested float dtype, and a
Hugging Face tokenizer (`tokenizer.json` and friends) rebuilt from the GGUF vocabulary, so
`mlx_lm.load(path)` needs nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import mlx.core as mx
import numpy as np
from gguf.gguf_reader import ReaderTensor
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from appliance.models.manifest import write_manifest

SUPPORTED_ARCHITECTURES = ("llama",)
DTYPES = {"float32": (mx.float32, "F32"), "float16": (mx.float16, "F16"), "bfloat16": (mx.bfloat16, "BF16")}
PARTIAL_MARK = ".partial-"

_MISSING: Any = object()
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
# llama.cpp's pre-tokenizer names → the `tokenizers` pipeline that splits text the same way.
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
}


class ModelSourceError(Exception):
    """A model source that cannot become a local MLX model directory; the message names it."""


@dataclass(frozen=True)
class LlamaShape:
    """The hyperparameters of a llama model, as read from GGUF metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    vocab_size: int
    tie_word_embeddings: bool


def fingerprint(path: Path) -> str:
    """Return the sha256 hex digest of the file's content (streamed, ~0.3 s per 100 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str) -> Path:
    """Return `out_dir` after writing the GGUF's model there as an MLX model directory.

    Everything is written to a sibling `.partial-` directory that replaces `out_dir` only when
    complete, so a crash never leaves a directory that looks like a finished model.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    reader = _open(gguf_path)
    shape = _llama_shape(reader, gguf_path)
    tokenizer = _bpe_tokenizer(reader, gguf_path)  # refuses what is not converted before any heavy work
    _check_tensor_types(reader, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out_dir)
    partial = out_dir.with_name(f"{out_dir.name}{PARTIAL_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        _write_tokenizer(reader, tokenizer, partial, shape)
        _write_json(partial / "config.json", _config(reader, shape, dtype))
        _write_weights(reader, shape, partial / "model.safetensors", dtype, gguf_path)
        write_manifest(partial, source=str(gguf_path), dtype=dtype)  # last: it vouches for the rest
        _swap_into_place(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def _open(gguf_path: Path) -> gguf.GGUFReader:
    """Return a reader over the file (tensor data stays memory-mapped until used)."""
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, struct.error) as exc:
        raise ModelSourceError(f"{gguf_path}: not a readable GGUF file ({exc})") from exc


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """Return the metadata value stored under `key`, or `default` when absent."""
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise ModelSourceError(f"{reader.data.filename}: GGUF metadata lacks {key!r}")
    return default


def _llama_shape(reader: gguf.GGUFReader, gguf_path: Path) -> LlamaShape:
    """Return the model's hyperparameters; refuses architectures and features not converted."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelSourceError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: {supported})")
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ModelSourceError(f"{gguf_path}: rope scaling is not supported by the GGUF converter")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    if int(_field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ModelSourceError(f"{gguf_path}: partial rotary embeddings are not supported")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelSourceError(f"{gguf_path}: GGUF has no token_embd.weight tensor")
    return LlamaShape(
        num_layers=int(_field(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(_field(reader, f"{arch}.context_length")),
        vocab_size=int(names["token_embd.weight"].shape[1]),
        tie_word_embeddings="output.weight" not in names,
    )


def _config(reader: gguf.GGUFReader, shape: LlamaShape, dtype: str) -> dict[str, Any]:
    """Return the Hugging Face style `config.json` content for the model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.context_length,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "torch_dtype": dtype,
    }


def _hf_name(gguf_name: str, gguf_path: Path) -> str:
    """Return the Hugging Face tensor name for a GGUF tensor name."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ModelSourceError(f"{gguf_path}: tensor {gguf_name!r} has no llama counterpart")


def _float_weight(tensor: ReaderTensor, shape: LlamaShape) -> np.ndarray:
    """Return the tensor dequantized to float32, rows as Hugging Face stores them."""
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    w = w.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # GGUF lists dims innermost first
    part = tensor.name.split(".")[-2]
    if part in ("attn_q", "attn_k"):
        # llama.cpp interleaves each head's rotary halves; put rows back in HF's half-split order.
        heads = shape.num_heads if part == "attn_q" else shape.num_kv_heads
        w = w.reshape(heads, shape.head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
    return w


def _check_tensor_types(reader: gguf.GGUFReader, gguf_path: Path) -> None:
    """Raise ModelSourceError unless every tensor type dequantizes (tried on one row of each)."""
    for qtype, tensor in {t.tensor_type: t for t in reader.tensors}.items():
        try:
            gguf.quants.dequantize(tensor.data[:1], qtype)
        except NotImplementedError as exc:
            raise ModelSourceError(f"{gguf_path}: tensor type {qtype.name} is not supported") from exc


def _write_weights(reader: gguf.GGUFReader, shape: LlamaShape, path: Path, dtype: str, gguf_path: Path) -> None:
    """Write every tensor to one safetensors file, one tensor in memory at a time."""
    mx_dtype, st_dtype = DTYPES[dtype]
    item_bytes = mx_dtype.size
    entries, offset = {}, 0
    for t in reader.tensors:
        dims = [int(d) for d in reversed(t.shape)]
        size = int(np.prod(dims)) * item_bytes
        entry = {"dtype": st_dtype, "shape": dims, "data_offsets": [offset, offset + size]}
        entries[_hf_name(t.name, gguf_path)] = entry
        offset += size
    header = json.dumps({"__metadata__": {"format": "mlx"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for t in reader.tensors:
            f.write(_to_bytes(_float_weight(t, shape), mx_dtype))
        _sync(f)


def _to_bytes(w: np.ndarray, mx_dtype: mx.Dtype) -> bytes:
    """Return the array's raw little-endian bytes in `mx_dtype` (MLX rounds, numpy has no bfloat16)."""
    cast = mx.array(w).astype(mx_dtype)
    if mx_dtype == mx.bfloat16:
        cast = cast.view(mx.uint16)
    return np.asarray(cast).tobytes()


def _write_tokenizer(reader: gguf.GGUFReader, tokenizer: Tokenizer, out: Path, shape: LlamaShape) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    controls = {i: tokens[i] for i, kind in enumerate(types) if kind == gguf.TokenType.CONTROL}
    special_ids = {name: _field(reader, f"tokenizer.ggml.{key}", None) for name, key in _SPECIAL_KEYS.items()}
    specials = {f"{name}_token": tokens[i] for name, i in special_ids.items() if i is not None}
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False) for content in controls.values()])
    if add_bos and special_ids["bos"] is not None:
        bos = tokens[special_ids["bos"]]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, special_ids["bos"])]
        )
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "special_tokens_map.json", specials)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": shape.context_length,
        **specials,
        "added_tokens_decoder": {str(i): _added_token(content) for i, content in controls.items()},
    }
    if (template := _field(reader, "tokenizer.chat_template", None)) is not None:
        config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", config)
    generation = {f"{name}_token_id": special_ids[name] for name in ("bos", "eos") if special_ids[name] is not None}
    _write_json(out / "generation_config.json", generation)


def _added_token(content: str) -> dict[str, Any]:
    """Return a special token's entry in tokenizer_config.json's added_tokens_decoder."""
    flags = dict.fromkeys(("lstrip", "normalized", "rstrip", "single_word"), False)
    return {"content": content, **flags, "special": True}


def _bpe_tokenizer(reader: gguf.GGUFReader, gguf_path: Path) -> Tokenizer:
    """Return the byte-level BPE tokenizer the GGUF vocabulary and merges describe."""
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ModelSourceError(
            f"{gguf_path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
            f"(supported: byte-level BPE 'gpt2' with pre-tokenizer {' or '.join(map(repr, _PRE_TOKENIZERS))})"
        )
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(_field(reader, "tokenizer.ggml.tokens"))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _write_json(path: Path, content: dict[str, Any]) -> None:
    """Write `content` as indented UTF-8 JSON, flushed to disk."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)
        f.write("\n")
        _sync(f)


def _sync(f: BinaryIO | Any) -> None:
    """Flush a file to disk, so the rename below never publishes unwritten data."""
    f.flush()
    os.fsync(f.fileno())


def _swap_into_place(partial: Path, out_dir: Path) -> None:
    """Rename the finished `partial` to `out_dir`, replacing an older `out_dir` if one exists."""
    if out_dir.exists():
        retired = out_dir.with_name(f"{out_dir.name}{PARTIAL_MARK}retired-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, retired)  # a directory cannot be replaced while non-empty
        os.replace(partial, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(partial, out_dir)


def _remove_stale_partials(out_dir: Path) -> None:
    """Delete partial siblings of `out_dir` left by conversions whose process is gone."""
    for stale in out_dir.parent.glob(f"{out_dir.name}{PARTIAL_MARK}*"):
        pid = stale.name.removeprefix(f"{out_dir.name}{PARTIAL_MARK}").split("-")[0]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Return whether a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
