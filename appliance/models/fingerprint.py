"""A model's identity by content: the hash of its weights and config, memoized on disk."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from pathlib import Path

MEMO_FILE = "fingerprints.json"
_lock = threading.Lock()


def weights_fingerprint(model_dir: Path, *, memo_dir: Path) -> str:
    """Returns the sha256 of the model's weight files and config.json, in name order.

    Hashing GBs of weights at every start would be slow, so the digest is memoized under
    `memo_dir`, keyed by each file's path, size, mtime and inode; any change rehashes.
    """
    files = sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"])
    stamp = "|".join(_stamp(f) for f in files)
    memo_path = memo_dir / MEMO_FILE
    with _lock:
        memo = _read(memo_path)
        if stamp in memo:
            return memo[stamp]
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    digest.update(chunk)
        memo[stamp] = digest.hexdigest()
        _write(memo_path, memo)
        return memo[stamp]


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _read(path: Path) -> dict[str, str]:
    """Returns the memo, or nothing when it is missing, damaged or does not match its
    checksum: a wrong digest would root the model's KV keys elsewhere, and a lost memo
    only costs a rehash."""
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if isinstance(entries, dict) and data["crc32"] == _crc(entries):
            return entries
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


def _write(path: Path, memo: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"crc32": _crc(memo), "entries": memo}))
    os.replace(tmp, path)


def _crc(entries: dict[str, str]) -> int:
    return zlib.crc32(json.dumps(entries, sort_keys=True).encode())
