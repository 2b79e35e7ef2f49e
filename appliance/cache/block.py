"""A KV block as bytes, and its on-disk form: magic, version, JSON header, then the payload.

File layout (all integers little-endian):

    offset 0   8 bytes   MAGIC  b"OMLXKV\\r\\n"
    offset 8   u32       FORMAT_VERSION
    offset 12  u32       header_nbytes (JSON, padded with spaces so the payload starts
                         at a multiple of PAYLOAD_ALIGN; files written before it was
                         4096 have it at a multiple of 64, and are read whole)
    offset 16  header    {"key", "parent", "dir", "tokens", "meta",
                          "payload_nbytes", "checksum"}
    ...        payload   payload_nbytes raw bytes, nothing after them
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson

_T = TypeVar("_T")

MAGIC = b"OMLXKV\r\n"  # \r\n catches a file mangled by text-mode transfers
FORMAT_VERSION = 2  # 2: "group" became "dir", and a first block's parent is the root key
PRELUDE = struct.Struct("<8sII")  # magic, version, header_nbytes
DIRECT_ALIGN = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's block size
# The payload's offset: a page, so the payload is read on its own with O_DIRECT into a
# buffer of its own size (read_block: a pinned slot the size a demoted block takes).
PAYLOAD_ALIGN = DIRECT_ALIGN
# Segments may not start with "." so a dir can never be "..", "." or a hidden dir.
_DIR_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")

# Reasons a stored block is not served; each is a miss counted by the tier.
CORRUPT = "corrupt"
TRUNCATED = "truncated"
MISSING = "missing"
FOREIGN = "foreign"
TOKEN_MISMATCH = "token_mismatch"
VERSION = "version"


@dataclass(frozen=True)
class Block:
    """A KV block as bytes: what the host tier holds, the SSD stores and archives carry
    (kv.KVBlock is the same block as MLX arrays)."""

    key: bytes  # chained hash computed by the caller; opaque here
    parent: bytes  # key of the previous block of the prefix; the key space's root for the first
    dir: str  # where its file lives under the tier root (model fingerprint + tenant)
    tokens: tuple[int, ...]  # the block's token ids, compared on every hit
    meta: dict  # small JSON-able dict, opaque to the tier
    # The KV bytes: bytes, a memoryview, or anything else with the buffer protocol (an
    # evaluated MLX uint8 array, whose bytes reach the host when first read: kv.to_bytes).
    payload: Any = field(repr=False)

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("block key is empty")
        if not self.parent:
            raise ValueError("block parent is empty: a first block's parent is the root key")
        if not is_valid_dir(self.dir):
            raise ValueError(f"invalid cache dir {self.dir!r}: use [A-Za-z0-9._/-] "
                             "segments that do not start with '.'")

    @property
    def payload_nbytes(self) -> int:
        """Returns the payload size in bytes (a memoryview's len counts items, not bytes),
        without reading it (an MLX array's bytes would be moved to the host)."""
        p = self.payload
        nbytes = getattr(p, "nbytes", None)  # memoryview, MLX and numpy arrays
        return len(p) if nbytes is None else int(nbytes)


class BlockError(Exception):
    """A stored block that must not be served; `reason` is one of the miss reasons above."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def is_valid_dir(dir: str) -> bool:
    """Returns whether `dir` is safe to use as a relative directory path."""
    # Segments named like block or temp files would be taken for files by the startup scan.
    return (_DIR_RE.fullmatch(dir) is not None
            and not any(s.endswith((".kv", ".tmp")) for s in dir.split("/")))


def relative_path(dir: str, key: bytes) -> str:
    """Returns the block file's path relative to the tier root: dir/kk/key.kv."""
    h = key.hex()
    return f"{dir}/{h[:2]}/{h}.kv"


def checksum(tokens: tuple[int, ...], payload: bytes | memoryview) -> int:
    """Returns the crc32 of the token ids and the payload.

    crc32 is the fastest checksum in the stdlib here (~1.1 GB/s per core; sha256 0.6) and
    releases the GIL, so parallel reads verify on both cores. It guards against torn or
    rotten files, not forgery: the cache is local and keys are not secrets. Tokens are
    covered so an edited header cannot serve KV under other token ids.
    """
    token_bytes = struct.pack(f"<{len(tokens)}q", *tokens)
    return zlib.crc32(payload, zlib.crc32(token_bytes))


def encode_head(block: Block) -> bytes:
    """Returns the prelude and padded JSON header; the payload follows them in the file."""
    header = orjson.dumps({
        "key": block.key.hex(),
        "parent": block.parent.hex(),
        "dir": block.dir,
        "tokens": list(block.tokens),
        "meta": block.meta,
        "payload_nbytes": block.payload_nbytes,
        "checksum": checksum(block.tokens, block.payload),
    })
    pad = -(PRELUDE.size + len(header)) % PAYLOAD_ALIGN
    header += b" " * pad
    return PRELUDE.pack(MAGIC, FORMAT_VERSION, len(header)) + header


def decode(data: memoryview, *, key: bytes, dir: str, tokens: tuple[int, ...] | None,
           payload: memoryview | None = None) -> Block:
    """Returns the verified block stored in `data` (a whole file; or its head, with the
    rest in `payload`, as read_block reads it); raises BlockError.

    The payload is a zero-copy view into the bytes read. `tokens=None` skips the token
    comparison (imports, which have no caller expectation), never the checksum.
    """
    if len(data) < PRELUDE.size:
        raise BlockError(TRUNCATED, "shorter than the prelude")
    magic, version, header_nbytes = PRELUDE.unpack_from(data)
    if magic != MAGIC:
        raise BlockError(CORRUPT, "bad magic")
    if version != FORMAT_VERSION:
        raise BlockError(VERSION, f"format version {version}, expected {FORMAT_VERSION}")
    start = PRELUDE.size + header_nbytes
    if len(data) < start:
        raise BlockError(TRUNCATED, "header cut short")
    header = _parse_header(data[PRELUDE.size:start])
    if header["key"] != key.hex() or header["dir"] != dir:
        raise BlockError(FOREIGN, f"holds {header['dir']}/{header['key'][:16]}")
    rest = data[start:] if payload is None else payload
    nbytes = header["payload_nbytes"]
    if len(rest) < nbytes:
        raise BlockError(TRUNCATED, f"{start + len(rest)} of {start + nbytes} bytes")
    if len(rest) > nbytes:
        raise BlockError(CORRUPT, "trailing bytes after the payload")
    stored_tokens = tuple(header["tokens"])
    if tokens is not None and stored_tokens != tuple(tokens):
        raise BlockError(TOKEN_MISMATCH)
    payload = rest
    try:
        expected = checksum(stored_tokens, payload)
    except struct.error:  # token ids outside int64 cannot have been written by us
        raise BlockError(CORRUPT, "token ids out of range") from None
    if expected != header["checksum"]:
        raise BlockError(CORRUPT, "checksum mismatch")
    return Block(key=key, parent=bytes.fromhex(header["parent"]), dir=dir, tokens=stored_tokens,
                 meta=header["meta"], payload=payload)


def _parse_header(raw: memoryview) -> dict:
    try:
        header = orjson.loads(raw)
        ok = (isinstance(header, dict)
              and isinstance(header.get("key"), str)
              and isinstance(header.get("dir"), str)
              and isinstance(header.get("parent"), str) and header["parent"] != ""
              and isinstance(header.get("tokens"), list)
              and all(isinstance(t, int) for t in header["tokens"])
              and isinstance(header.get("meta"), dict)
              and isinstance(header.get("payload_nbytes"), int)
              and header["payload_nbytes"] >= 0
              and isinstance(header.get("checksum"), int))
        if ok:
            bytes.fromhex(header["parent"])
    except (orjson.JSONDecodeError, ValueError) as e:
        raise BlockError(CORRUPT, f"unreadable header: {e}") from None
    if not ok:
        raise BlockError(CORRUPT, "malformed header")
    return header


def write_atomic(path: Path, head: bytes, payload: bytes | memoryview) -> None:
    """Writes a block file crash-safely: temp file in the same directory, fsync, rename,
    fsync the directory. A crash leaves the old state or the new, plus at most a .tmp."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, head)
        _write_all(fd, payload)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)  # makes the rename itself durable


def fsync_dir(directory: Path) -> None:
    """Flushes a directory's entries (new names, renames) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def read_file(path: Path, buffer: Callable[[int], memoryview | None] | None = None) -> memoryview:
    """Returns a whole file's bytes, read around the page cache where the OS allows, into
    `buffer(nbytes)` when given and it returns memory (e.g. pinned memory a GPU reads
    directly; page-aligned for O_DIRECT), else into fresh memory.

    A restored block is copied into the caller's memory anyway; staging it in the page
    cache as well costs a fresh page per 4 KiB read (and evicts useful pages). On Linux
    the file is read with O_DIRECT into an aligned buffer; where the filesystem refuses
    that (tmpfs, some network mounts), with ordinary reads.
    """
    return _read(path, lambda fd: _read_whole(fd, buffer))


def read_block(path: Path, buffer: Callable[[int], memoryview | None] | None = None
               ) -> tuple[memoryview, memoryview | None]:
    """Returns a block file as (head, payload) for decode: with a `buffer`, its payload is
    read on its own into `buffer(nbytes)` (nbytes: the payload rounded up to a page), so it
    fits a pinned slot the size of a payload, the slot a demoted block of the same
    precision takes. Without one, or for a file whose payload does not start at a page
    (written before PAYLOAD_ALIGN was one), the whole file is read at once: (file, None).
    """
    return _read(path, lambda fd: _read_parts(fd, buffer))


def _read(path: Path, read: Callable[[int], _T]) -> _T:
    """Returns `read(fd)` of `path` opened with O_DIRECT, else (refused) opened plainly."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return _with_fd(path, direct, read)
        except OSError as e:  # EINVAL: refused at open or at the first read
            if e.errno != errno.EINVAL:
                raise
    return _with_fd(path, 0, read)


def _with_fd(path: Path, flags: int, read: Callable[[int], _T]) -> _T:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        return read(fd)
    finally:
        os.close(fd)


def _read_whole(fd: int, buffer: Callable[[int], memoryview | None] | None) -> memoryview:
    size = os.fstat(fd).st_size
    buf = _buffer(_padded(size), buffer)
    return buf[:_pread_into(fd, buf, 0, size)]


def _read_parts(fd: int, buffer: Callable[[int], memoryview | None] | None
                ) -> tuple[memoryview, memoryview | None]:
    if buffer is None:  # fresh memory either way: one read
        return _read_whole(fd, None), None
    size = os.fstat(fd).st_size
    first = _aligned(DIRECT_ALIGN)
    got = _pread_into(fd, first, 0, DIRECT_ALIGN)
    start = None
    if got >= PRELUDE.size:
        magic, _, header_nbytes = PRELUDE.unpack_from(first)
        start = PRELUDE.size + header_nbytes if magic == MAGIC else None
    if start is None or start % DIRECT_ALIGN or start > size:  # not a page-aligned payload: all at once
        return _read_whole(fd, buffer), None
    if start <= got:
        head = first[:start]
    else:
        head = _aligned(start)
        head = head[:_pread_into(fd, head, 0, start)]
    nbytes = size - start
    payload = _buffer(_padded(nbytes), buffer)
    return head, payload[:_pread_into(fd, payload, start, nbytes)]


def _pread_into(fd: int, buf: memoryview, offset: int, size: int) -> int:
    """Reads up to `size` bytes at `offset` into `buf` (at least `size` long); returns how
    many were read (fewer when the file is shorter: decode reports it truncated)."""
    done = 0
    while done < size:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return min(done, size)


def _buffer(nbytes: int, buffer: Callable[[int], memoryview | None] | None) -> memoryview:
    """`buffer(nbytes)`, else (none given, or it has none) fresh page-aligned memory."""
    buf = buffer(nbytes) if buffer is not None else None
    return _aligned(nbytes) if buf is None else buf


def _aligned(nbytes: int) -> memoryview:
    raw = np.empty(nbytes + DIRECT_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return memoryview(raw[start:start + nbytes])


def _padded(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def read_tokens(path: Path, *, key: bytes, dir: str) -> tuple[int, ...] | None:
    """Returns the token ids in a block file's header (a small read), or None if unreadable."""
    try:
        with open(path, "rb") as f:
            prelude = f.read(PRELUDE.size)
            if len(prelude) < PRELUDE.size:
                return None
            magic, version, header_nbytes = PRELUDE.unpack(prelude)
            if magic != MAGIC or version != FORMAT_VERSION:
                return None
            header = _parse_header(memoryview(f.read(header_nbytes)))
    except (OSError, BlockError):
        return None
    if header["key"] != key.hex() or header["dir"] != dir:
        return None
    return tuple(header["tokens"])
