"""A model's identity by content: a hash of its weights and config, memoized on disk.

The digest is a two-level sha256 (each 64 MiB piece of each file, then the list of those),
so the pieces hash on all cores: one thread hashed an 8B model's 16 GB in 13-24 s on an
H200 host, which was most of that server's start. `start_fingerprint` begins it beside
the model load; `weights_fingerprint` joins it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

MEMO_FILE = "fingerprints.json"
SCHEME = "sha256-tree-64MiB"  # part of each memo key: a new scheme rehashes, never mixes
PIECE_BYTES = 64 << 20
READ_BYTES = 4 << 20
_lock = threading.Lock()
_running: dict[str, Future] = {}  # stamp -> digest being computed in this process


def weights_fingerprint(model_dir: Path, *, memo_dir: Path) -> str:
    """Returns the digest of the model's weight files and config.json (see the module
    docstring), from the memo under `memo_dir` when no file changed since it was hashed."""
    return start_fingerprint(model_dir, memo_dir=memo_dir).result()


def start_fingerprint(model_dir: Path, *, memo_dir: Path) -> Future:
    """Returns a future of `weights_fingerprint`, computed on a background thread; callers
    asking for the same files meanwhile share it.

    The memo is keyed by each file's path, size, mtime and inode; any change rehashes.
    """
    files = sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"])
    stamp = SCHEME + "|" + "|".join(_stamp(f) for f in files)
    memo_path = memo_dir / MEMO_FILE
    with _lock:
        future = _running.get(stamp)
        if future is not None:
            return future
        future = Future()
        digest = _read(memo_path).get(stamp)
        if digest is not None:
            future.set_result(digest)
            return future
        _running[stamp] = future
    threading.Thread(target=_compute, args=(future, files, stamp, memo_path),
                     name="omlx-fingerprint", daemon=True).start()
    return future


def _compute(future: Future, files: list[Path], stamp: str, memo_path: Path) -> None:
    try:
        digest = tree_digest(files)
        with _lock:
            memo = {k: v for k, v in _read(memo_path).items() if k.startswith(SCHEME + "|")}
            memo[stamp] = digest
            _write(memo_path, memo)
        future.set_result(digest)
    except BaseException as e:  # the waiter re-raises it
        future.set_exception(e)
    finally:
        with _lock:
            _running.pop(stamp, None)


def tree_digest(files: list[Path], *, workers: int | None = None) -> str:
    """Returns sha256 over the scheme, then each file's name and size followed by the
    sha256 of each of its PIECE_BYTES pieces in order."""
    pieces = [(f, offset) for f in files for offset in range(0, max(f.stat().st_size, 1), PIECE_BYTES)]
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="omlx-hash") as pool:
        digests = list(pool.map(lambda p: _piece_digest(*p), pieces))
    top = hashlib.sha256(SCHEME.encode() + b"\0")
    for f in files:
        top.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        top.update(b"".join(d for (g, _), d in zip(pieces, digests) if g == f))
    return top.hexdigest()


def _piece_digest(path: Path, offset: int) -> bytes:
    """Returns the sha256 of one piece (hashlib and reads release the GIL)."""
    digest = hashlib.sha256()
    left = PIECE_BYTES
    with open(path, "rb") as fh:
        fh.seek(offset)
        while left > 0 and (chunk := fh.read(min(READ_BYTES, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.digest()


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
