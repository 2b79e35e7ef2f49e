"""What the installed libmlx holds that compiling MLX CUDA's own kernels needs, read without
running it: the build's identity, the device headers MLX compiles its kernels with, and
the include paths it hands NVRTC (kernels/ahead.py compiles those kernels as MLX would).

MLX keeps its kernels' device headers (utils.cuh, indexing.cuh...) only inside libmlx,
as static strings (`mlx::core::jit_source_NAME`), not as files. They are read from the
library's symbol table: `headers` finds the symbols by name in the ELF's .symtab and
reads each one's bytes. pyelftools, which parses every symbol as an object, took 3.8 s
for libmlx's 151,000 symbols; matching the names in the string table first takes
milliseconds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import mmap
import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

LIBRARY = "mlx/lib/libmlx.so"  # as the wheel's RECORD names it
SOURCE_SYMBOL = re.compile(rb"_ZN\w*3mlx4coreL?\d+jit_source_(\w+?)E\Z")  # mlx::core::jit_source_NAME
DEVICE_INCLUDE = "mlx/backend/cuda/device"  # MLX's in-memory headers are named under it
# ELF64 section header and symbol (little-endian)
_SECTION = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, addralign, entsize
_SYMBOL = [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]
_SHT_SYMTAB = 2


def path() -> Path | None:
    """Returns the installed libmlx (the mlx package's lib/libmlx.so), without importing MLX."""
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "lib" / "libmlx.so"
        if candidate.is_file():
            return candidate
    return None


def build_id(library: Path) -> str | None:
    """Returns the SHA-256 that its wheel's RECORD gives `library` (one build of MLX,
    whatever its version says); None where no MLX distribution beside it records one."""
    site = library.parent.parent.parent
    for info in sorted(site.glob("mlx*.dist-info")):
        for file in importlib.metadata.Distribution.at(info).files or ():
            if str(file) == LIBRARY and file.hash is not None:
                return file.hash.value
    return None


def headers(library: Path) -> dict[str, str]:
    """Returns MLX CUDA's in-memory device headers by the names MLX includes them under
    (mlx/backend/cuda/device/NAME.cuh; config.h), read from `library`'s symbol table; {}
    for a libmlx without them (a CPU or Metal build) or without a symbol table."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _headers(data)


class Section(NamedTuple):
    """An ELF section's header, as far as reading its bytes needs."""

    name: str
    type: int
    addr: int
    offset: int
    size: int
    link: int  # the symbol table's: its string table's index


def sections(data: bytes | mmap.mmap) -> list[Section]:
    """Returns the section headers of an ELF64 little-endian file (libmlx, a cubin), their
    names read from the section-name table; [] for any other file."""
    if data[:6] != b"\x7fELF\x02\x01":  # ELF, 64-bit, little-endian
        return []
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", data, 0x3A)
    raw = [_SECTION.unpack_from(data, shoff + i * entsize) for i in range(count)]
    names = raw[names_at]
    table = data[names[4]:names[4] + names[5]]
    return [Section(table[h[0]:table.index(b"\0", h[0])].decode(), h[1], h[3], h[4], h[5], h[6]) for h in raw]


def _headers(data: mmap.mmap) -> dict[str, str]:
    import numpy as np  # here: a compile's process (kernels/ahead.py) needs none of this

    found_sections = sections(data)
    symtab = next((s for s in found_sections if s.type == _SHT_SYMTAB), None)
    if symtab is None:
        return {}
    strtab = found_sections[symtab.link]
    strings = data[strtab.offset:strtab.offset + strtab.size]
    wanted: dict[int, str] = {}  # string-table offset -> the source's name
    at = strings.find(b"jit_source_")
    while at >= 0:
        start = strings.rfind(b"\0", 0, at) + 1
        end = strings.index(b"\0", at)
        match = SOURCE_SYMBOL.match(strings[start:end])
        if match:
            wanted[start] = match.group(1).decode()
        at = strings.find(b"jit_source_", end)
    symbols = np.frombuffer(data[symtab.offset:symtab.offset + symtab.size], np.dtype(_SYMBOL))
    found: dict[str, str] = {}
    for symbol in symbols[np.isin(symbols["name"], list(wanted))]:
        index = int(symbol["shndx"])
        if index >= len(found_sections) or not symbol["size"]:
            continue
        section = found_sections[index]
        offset = section.offset + int(symbol["value"]) - section.addr
        text = data[offset:offset + int(symbol["size"])].split(b"\0", 1)[0]
        found[include_name(wanted[int(symbol["name"])])] = text.decode()
    return found


def include_name(source: str) -> str:
    """Returns the name MLX includes a device header of `source`'s name under."""
    return f"{DEVICE_INCLUDE}/{source}.h" if source == "config" else f"{DEVICE_INCLUDE}/{source}.cuh"


def include_paths(library: Path) -> tuple[str, ...]:
    """Returns the --include-path flags MLX CUDA hands NVRTC: its bundled headers, CCCL's
    beside them, and CUDA's runtime headers (the nvidia-cuda-runtime wheel's, else the
    toolkit's)."""
    include = library.parent.parent / "include"
    runtime = library.parent.parent.parent / "nvidia" / "cu13" / "include"
    if not runtime.is_dir():  # as MLX falls back: CUDA_HOME, CUDA_PATH, /usr/local/cuda
        runtime = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    return tuple(f"--include-path={p}" for p in (include, include / "cccl", runtime) if p.is_dir())
