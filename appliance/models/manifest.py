"""A converted model directory's own manifest: every file's size and crc32, written last.

Everything under `cache.dir` is derived data. A conversion is trusted only when its files
match the manifest written after them; one that does not (a file deleted, truncated,
bit-flipped, or a conversion from before manifests) is converted again.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

MANIFEST = "omlx-manifest.json"
FORMAT = 1
CHUNK_BYTES = 16 << 20  # zlib releases the GIL on chunks this large


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(model_dir: Path, **facts: str) -> Path:
    """Writes the manifest of every file in `model_dir` (plus `facts`), fsynced; returns its path."""
    files = {f.name: {"bytes": f.stat().st_size, "crc32": file_crc32(f)}
             for f in sorted(model_dir.iterdir()) if f.is_file() and f.name != MANIFEST}
    path = model_dir / MANIFEST
    with open(path, "w", encoding="utf-8") as out:
        json.dump({"format": FORMAT, **facts, "files": files}, out, indent=2)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())
    return path


def verify(model_dir: Path) -> str | None:
    """Returns None when every file of the manifest is present with its size and crc32,
    else why not (the first problem found)."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
            return f"{MANIFEST} has an unknown format"
    except FileNotFoundError:
        return f"no {MANIFEST} (an interrupted or older conversion)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    for name, want in files.items():
        path = model_dir / name
        try:
            if path.stat().st_size != want["bytes"]:
                return f"{name}: {path.stat().st_size} bytes, {want['bytes']} expected"
            if file_crc32(path) != want["crc32"]:
                return f"{name}: checksum mismatch"
        except FileNotFoundError:
            return f"{name}: missing"
        except (OSError, KeyError, TypeError) as e:
            return f"{name}: unreadable ({type(e).__name__})"
    return None
