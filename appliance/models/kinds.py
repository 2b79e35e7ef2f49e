"""A model's kinds of weights: the names of the MLX dtypes its parameters hold and, for
layers MLX quantized, how (bits, group size and mode, as MLX names its quantized matmuls:
"b4_g64_affine"), sorted: ("bfloat16",); ("b4_g64_affine", "bfloat16", "uint32"). MLX CUDA
compiles some of its kernels per kind of array and per quantization, so the kernels a
model's first start needs depend on them (kernels/ahead.py, engine/warm_up.batch_changes_mark).

`expected` tells them before the load, from the headers of the model's files, without MLX
(whose import would delay the compiles ahead): a serve compiles ahead only what its
default model will ask for.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.models.headers import tensors, weight_files

if TYPE_CHECKING:
    import mlx.nn as nn

# safetensors dtype -> the MLX dtype mx.load (MLX 0.32) reads it as, by name, its bytes unchanged
# (FP8 stays raw bytes in uint8, as mx.load leaves it); models/weights.DTYPES is made from it
SAFETENSORS_KINDS = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32",
    "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "C64": "complex64",
    "F8_E4M3": "uint8", "F8_E8M0": "uint8",
}
FLOATS = frozenset({"float16", "bfloat16", "float32"})
GGUF_KIND = "float32"  # what a GGUF file converts to unless the spec names a dtype (models/loaded.py)


def of_model(model: nn.Module) -> tuple[str, ...]:
    """Returns the kinds of `model`'s weights."""
    from mlx.utils import tree_flatten

    found = {str(p.dtype).removeprefix("mlx.core.") for _, p in tree_flatten(model.parameters())}
    found |= {quantization(m.bits, m.group_size, m.mode) for m in model.modules()
              if all(hasattr(m, a) for a in ("bits", "group_size", "mode"))}  # nn.QuantizedLinear and its kin
    return tuple(sorted(found))


def quantization(bits: int, group_size: int, mode: str) -> str:
    return f"b{bits}_g{group_size}_{mode}"


def of_config(config: dict) -> set[str] | None:
    """Returns the kinds of quantization an MLX model's config asks for (its "quantization":
    one for every layer, and those some layers override it with); None where it names
    another kind of quantization (a checkpoint's own, which mlx-lm converts its way)."""
    asked = config.get("quantization")
    if asked is None:
        return None if "quantization_config" in config else set()
    layers = [asked, *(v for v in asked.values() if isinstance(v, dict))]
    return {quantization(q["bits"], q["group_size"], q.get("mode", "affine")) for q in layers if "bits" in q}


def of_files(files: list[Path], *, dtype: str = "auto") -> tuple[str, ...] | None:
    """Returns the kinds of the weights in safetensors `files` as a GPU loads them: floats
    cast to `dtype` unless it is "auto"; None where there are none, or a header is
    unreadable or names a dtype MLX does not read."""
    try:
        found = {SAFETENSORS_KINDS[t.dtype] for f in files for t in tensors(f)}
    except (OSError, ValueError, KeyError, struct.error):
        return None
    if dtype != "auto" and found & FLOATS:
        found = (found - FLOATS) | {dtype}
    return tuple(sorted(found)) or None


def expected(source: str, *, dtype: str, base_dir: Path) -> tuple[str, ...] | None:
    """Returns the kinds a model of `source` (as the spec names it) will have on a GPU,
    where this machine holds its files already; None where it does not (a repo not yet
    downloaded) or they cannot be read."""
    if source.endswith(".gguf"):
        return (GGUF_KIND if dtype == "auto" else dtype,)  # converted to floats (models/gguf.py)
    path = Path(source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_dir():
        path = hub_snapshot(source)
    if path is None:
        return None
    try:
        quantized = of_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    weights = of_files(weight_files(path), dtype=dtype)
    return tuple(sorted({*weights, *quantized})) if weights is not None and quantized is not None else None


def hub_snapshot(source: str) -> Path | None:
    """Returns the directory of the Hugging Face repo `source`'s snapshot in the local hub
    cache, without reaching the hub; None where there is none."""
    from huggingface_hub import try_to_load_from_cache

    repo_id, _, revision = source.partition("@")
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
    except ValueError:  # not a repo id
        return None
    return Path(found).parent if isinstance(found, str) else None
