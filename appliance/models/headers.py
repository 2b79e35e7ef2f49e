"""A model's safetensors files and what their headers say of each tensor, read without MLX
(kernels/ahead.py reads them before MLX is imported)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import NamedTuple


class Tensor(NamedTuple):
    """One tensor of a safetensors file, as the file's header describes it."""

    name: str
    dtype: str  # the file's name for it: BF16, F32, U32...
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def weight_files(model_dir: Path) -> list[Path]:
    """Returns the safetensors files mlx-lm loads from a model directory (model*.safetensors)."""
    return sorted(model_dir.glob("model*.safetensors"))


def tensors(path: Path) -> list[Tensor]:
    """Returns the tensors of a safetensors file, in the order of their bytes in the file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    start = 8 + header_len
    listed = [Tensor(name, t["dtype"], tuple(t["shape"]), start + t["data_offsets"][0],
                     t["data_offsets"][1] - t["data_offsets"][0])
              for name, t in header.items() if name != "__metadata__"]
    return sorted(listed, key=lambda t: t.offset)
