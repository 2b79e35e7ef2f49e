"""The SSD tier: one crash-safe file per block under a byte budget, evicted LRU.

Layout: `<root>/<dir>/<kk>/<key hex>.kv` (format in block.py), the index in
`<root>/index.sqlite`, and `<root>/lock`, held with flock so that two processes never
share a root. All methods are thread-safe; file reads and writes run outside the lock, so
a put of a 50 MB block never holds up a concurrent get.
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import re
import sqlite3
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from appliance.cache.block import (
    FORMAT_VERSION,
    MISSING,
    Block,
    BlockError,
    decode,
    encode_head,
    fsync_dir,
    is_valid_dir,
    read_block,
    read_file,
    read_tokens,
    relative_path,
    write_atomic,
)
from appliance.cache.ssd_index import IndexEntry, SsdIndex, unlink_quietly

log = logging.getLogger("omlx.cache")

ABSENT = "absent"  # not indexed: the ordinary miss
UNREADABLE = "unreadable"  # indexed, but reading the file failed (EIO, EACCES)
# A disk that is full, read-only or not ours: retrying every block would only spam errors.
DISABLING_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}
ARCHIVE_FORMAT = "omlx-kv-archive"
_MEMBER_RE = re.compile(r"blocks/([0-9a-f]{2,})\.kv")


@dataclass
class _Counters:
    hits: int = 0
    misses: Counter = field(default_factory=Counter)
    evictions: int = 0
    writes: int = 0
    write_errors: int = 0
    refused: int = 0  # larger than the budget, or no room next to in-flight writes
    import_rejected: int = 0
    read_bytes: int = 0
    read_s: float = 0.0


class SsdTier:
    def __init__(self, root: Path, *, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.root = Path(root)
        self._budget = budget_bytes
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._reserved = 0  # bytes of puts between reserving room and indexing
        self._dirs: set[Path] = set()  # directories known to exist (saves a stat per put)
        self._disabled_reason: str | None = None
        self._lock_fd: int | None = None
        self._index = self._open()

    def contains(self, key: bytes, *, dir: str) -> bool:
        """Returns whether the block is indexed (no file I/O; get still verifies it)."""
        with self._lock:
            return self._index.contains(dir, key)

    def longest_prefix(self, keys: list[bytes], *, dir: str) -> int:
        """Returns how many of the leading `keys` are indexed (no file I/O)."""
        with self._lock:
            for n, key in enumerate(keys):
                if not self._index.contains(dir, key):
                    return n
            return len(keys)

    def children(self, parent: bytes, *, dir: str, limit: int = 32,
                 skip: Collection[bytes] = ()) -> list[tuple[bytes, tuple[int, ...]]]:
        """Returns (key, tokens) of the blocks that follow `parent`, but those in `skip`:
        header reads only, one file each (on an H200, 32 short chats' lookups read 2-3 ms
        of headers each, of blocks the memory tier held)."""
        with self._lock:
            entries = self._index.children(dir, parent, limit=limit)
        found = []
        for entry in entries:
            if entry.key in skip:
                continue
            tokens = read_tokens(self.root / entry.path, key=entry.key, dir=dir)
            if tokens is not None:
                found.append((entry.key, tokens))
        return found

    def get(self, key: bytes, *, dir: str, tokens: Sequence[int],
            buffer: Callable[[int], memoryview | None] | None = None) -> Block | None:
        """Returns the verified block, or None (a counted miss; a bad file is removed).
        The payload is read into `buffer(nbytes)` when given (block.read_block).

        Blocks the caller for one sequential read of the file and a crc32 over it.
        """
        with self._lock:
            entry = self._index.get(dir, key)
            if entry is None:
                self._counters.misses[ABSENT] += 1
                return None
        loaded = self._load(entry, tuple(tokens), buffer)
        if loaded is None:
            return None
        with self._lock:
            self._touch(entry)
            self._counters.hits += 1
        return loaded[1]

    def probe_read(self, max_bytes: int, *, threads: int) -> tuple[int, float] | None:
        """Reads up to `max_bytes` of stored block files, `threads` at a time, as restores
        do (O_DIRECT: the disk, not the page cache), and returns (bytes, seconds); None
        when nothing is stored or a read fails. Nothing is verified, counted or touched."""
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            entries = self._index.least_recent(max_bytes)
        if not entries:
            return None
        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="kv-probe") as pool:
                nbytes = sum(len(data) for data in pool.map(lambda e: read_file(self.root / e.path), entries))
        except OSError:
            return None
        return nbytes, time.perf_counter() - started

    def put(self, block: Block) -> bool:
        """Returns whether the block is stored (True also when it already was).

        Blocks the caller for the write and two fsyncs; evicts LRU blocks to make room.
        False when the tier is disabled, the block exceeds the budget, or the write failed.
        """
        with self._lock:
            if self._disabled_reason is not None:
                return False
            entry = self._index.get(block.dir, block.key)
            if entry is not None:  # keys are content hashes: same key, same bytes
                self._touch(entry)
                return True
        head = encode_head(block)  # checksums the payload: done outside the lock
        nbytes = len(head) + block.payload_nbytes
        with self._lock:
            if not self._make_room(nbytes):
                self._counters.refused += 1
                return False
            self._reserved += nbytes
        path = self.root / relative_path(block.dir, block.key)
        try:
            self._ensure_dir(path.parent)
            write_atomic(path, head, block.payload)
        except OSError as e:
            with self._lock:
                self._reserved -= nbytes
                self._write_failed(e)
            return False
        with self._lock:
            self._reserved -= nbytes
            return self._index_written(block, nbytes, path)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def resize(self, budget_bytes: int) -> None:
        """Sets the byte budget; a lower one evicts LRU blocks before returning."""
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        with self._lock:
            self._budget = budget_bytes
            self._evict_until(budget_bytes)

    def clear(self, dir: str | None = None) -> int:
        """Returns the number of blocks removed: those under `dir` (its subdirs too), or all."""
        if dir is not None and not is_valid_dir(dir):
            raise ValueError(f"invalid cache dir {dir!r}")
        with self._lock:
            try:
                paths = self._index.remove_under(dir)
            except sqlite3.Error as e:
                self._disable(f"index: {e}")
                return 0
            for rel in paths:
                unlink_quietly(self.root / rel)
            self._dirs.clear()
        _prune_empty_dirs(self.root if dir is None else self.root / dir, self.root)
        return len(paths)

    def stats(self) -> dict:
        """Returns counters, sizes and the measured read throughput (GB/s, None before a read)."""
        with self._lock:
            c = self._counters
            return {
                "bytes": self._index.total_bytes,
                "budget_bytes": self._budget,
                "blocks": self._index.num_blocks,
                "hits": c.hits,
                "misses": dict(c.misses),
                "evictions": c.evictions,
                "writes": c.writes,
                "write_errors": c.write_errors,
                "refused": c.refused,
                "import_rejected": c.import_rejected,
                "disabled": self._disabled_reason is not None,
                "disabled_reason": self._disabled_reason,
                "read_bytes": c.read_bytes,
                "read_s": c.read_s,
                "read_gbps": c.read_bytes / c.read_s / 1e9 if c.read_s > 0 else None,
            }

    def close(self) -> None:
        """Closes the index and releases the root for another process; idempotent."""
        with self._lock:
            # A put racing the shutdown then returns False instead of raising.
            self._disabled_reason = self._disabled_reason or "closed"
            self._index.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # closing drops the flock
                self._lock_fd = None

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def export(self, dir: str, dest: Path) -> int:
        """Returns the number of blocks of `dir` written to the tar archive `dest`.

        Each file is verified as it is read, so a damaged block is dropped, not exported.
        Blocks the caller for reading every block of the dir.
        """
        with self._lock:
            entries = self._index.of_dir(dir)
        dest = Path(dest)
        tmp = dest.with_name(dest.name + ".tmp")
        exported: list[str] = []
        try:
            with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
                for entry in entries:
                    loaded = self._load(entry, None)
                    if loaded is not None:
                        _add_member(tar, f"blocks/{entry.key.hex()}.kv", loaded[0])
                        exported.append(entry.key.hex())
                manifest = {"format": ARCHIVE_FORMAT, "version": FORMAT_VERSION,
                            "dir": dir, "blocks": exported}
                _add_member(tar, "manifest.json", orjson.dumps(manifest))
            os.replace(tmp, dest)
        except BaseException:
            unlink_quietly(tmp)
            raise
        return len(exported)

    def import_archive(self, src: Path) -> int:
        """Returns the number of blocks imported from an archive written by export.

        Every member is verified (checksum, key, dir) before it is stored; bad members
        are skipped and counted in stats()["import_rejected"]. Raises ValueError when
        `src` is not such an archive.
        """
        imported = 0
        try:
            with tarfile.open(src, "r:") as tar:
                members = tar.getmembers()
                dir, listed = _read_manifest(tar, members)
                for member in members:
                    if member.name == "manifest.json":
                        continue
                    block = self._verify_member(tar, member, dir, listed)
                    if block is None:
                        with self._lock:
                            self._counters.import_rejected += 1
                    elif self.put(block):
                        imported += 1
        except tarfile.TarError as e:
            raise ValueError(f"{src}: not a readable tar archive: {e}") from None
        return imported

    def _open(self) -> SsdIndex:
        try:
            _make_private_dir(self.root)
            self._lock_fd = _lock_root(self.root / "lock")
            index = SsdIndex(self.root / "index.sqlite")
        except (OSError, sqlite3.Error) as e:
            self._disable(f"cannot open {self.root}: {e}")
            return SsdIndex(":memory:")
        self._index = index
        started = time.perf_counter()
        try:
            fixed = index.reconcile(self.root)
            self._evict_until(self._budget)  # the budget may have shrunk since last run
        except (OSError, sqlite3.Error) as e:
            self._disable(f"cannot reconcile {self.root}: {e}")
            return index
        log.info("SSD cache %s: %d blocks, %d bytes; reconciled in %.3f s (%s)", self.root,
                 index.num_blocks, index.total_bytes, time.perf_counter() - started, fixed)
        return index

    def _load(self, entry: IndexEntry, tokens: tuple[int, ...] | None,
              buffer: Callable[[int], memoryview | None] | None = None) -> tuple[memoryview, Block] | None:
        """Returns the file's bytes (its head alone when its payload was read apart into
        `buffer`: block.read_block) and its verified block, or None after dropping it."""
        started = time.perf_counter()
        try:
            data, payload = read_block(self.root / entry.path, buffer)
        except FileNotFoundError:
            self._drop(entry, MISSING, "file deleted behind the index")
            return None
        except OSError as e:
            self._drop(entry, UNREADABLE, str(e))
            return None
        elapsed = time.perf_counter() - started
        with self._lock:
            self._counters.read_bytes += len(data) + (len(payload) if payload is not None else 0)
            self._counters.read_s += elapsed
        try:
            return data, decode(data, key=entry.key, dir=entry.dir, tokens=tokens, payload=payload)
        except BlockError as e:
            self._drop(entry, e.reason, str(e))
            return None

    def _drop(self, entry: IndexEntry, reason: str, detail: str) -> None:
        log.warning("SSD cache miss (%s) for %s: %s", reason, entry.path, detail)
        with self._lock:
            self._counters.misses[reason] += 1
            self._forget([entry])  # a no-op when it was evicted or re-put meanwhile

    def _make_room(self, nbytes: int) -> bool:
        if self._reserved + nbytes > self._budget:
            return False  # evicting could not make it fit: keep what we have
        return self._evict_until(self._budget - self._reserved - nbytes)

    def _evict_until(self, limit_bytes: int) -> bool:
        """Returns whether indexed bytes are <= limit_bytes after evicting LRU blocks."""
        victims = self._index.least_recent(self._index.total_bytes - max(limit_bytes, 0))
        self._counters.evictions += self._forget(victims)
        return self._index.total_bytes <= limit_bytes

    def _forget(self, entries: list[IndexEntry]) -> int:
        """Returns how many entries were removed from the index, then from disk (a crash
        in between leaves stray files, which startup deletes). Caller holds the lock."""
        if not entries:
            return 0
        try:
            removed = self._index.remove(entries)
        except sqlite3.Error as e:
            self._disable(f"index: {e}")
            return 0
        for e in removed:
            unlink_quietly(self.root / e.path)
        return len(removed)

    def _touch(self, entry: IndexEntry) -> None:
        try:
            self._index.touch(entry)
        except sqlite3.Error as e:  # recency is advisory: a lost update costs nothing
            log.debug("SSD cache index touch failed: %s", e)

    def _index_written(self, block: Block, nbytes: int, path: Path) -> bool:
        try:
            self._index.add(block.dir, block.key, block.parent, nbytes)
        except sqlite3.Error as e:
            unlink_quietly(path)
            self._counters.write_errors += 1
            self._disable(f"index: {e}")
            return False
        self._counters.writes += 1
        self._evict_until(self._budget)  # the budget may have been lowered meanwhile
        return self._index.contains(block.dir, block.key)

    def _ensure_dir(self, directory: Path) -> None:
        if directory in self._dirs:
            return
        missing = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                pass
            fsync_dir(d.parent)  # a new directory's name must be as durable as its files
        self._dirs.add(directory)

    def _write_failed(self, error: OSError) -> None:
        self._counters.write_errors += 1
        if error.errno in DISABLING_ERRNOS:
            name = errno.errorcode.get(error.errno or 0, "OSError")
            self._disable(f"{name}: {error.strerror or error}")
        else:
            log.warning("SSD cache write failed: %s", error)

    def _disable(self, reason: str) -> None:
        if self._disabled_reason is None:
            self._disabled_reason = reason
            log.warning("SSD cache tier disabled (%s); stored blocks remain readable", reason)

    def _verify_member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, dir: str,
                       listed: set[str]) -> Block | None:
        match = _MEMBER_RE.fullmatch(member.name)
        if not member.isreg() or match is None or match[1] not in listed:
            log.warning("archive member %s rejected: not a listed block file", member.name)
            return None
        if member.size > self._budget:
            log.warning("archive member %s rejected: larger than the budget", member.name)
            return None
        data = tar.extractfile(member).read()  # type: ignore[union-attr]
        try:
            return decode(memoryview(data), key=bytes.fromhex(match[1]), dir=dir,
                          tokens=None)
        except BlockError as e:
            log.warning("archive member %s rejected: %s", member.name, e)
            return None


def _read_manifest(tar: tarfile.TarFile, members: list[tarfile.TarInfo]
                   ) -> tuple[str, set[str]]:
    """Returns the archive's dir and listed key hexes; raises ValueError if unusable."""
    member = next((m for m in members if m.name == "manifest.json" and m.isreg()), None)
    if member is None:
        raise ValueError("not an omlx cache archive: no manifest.json")
    try:
        manifest = orjson.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
        dir, listed = manifest["dir"], set(manifest["blocks"])
        ok = manifest["format"] == ARCHIVE_FORMAT and isinstance(dir, str)
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable manifest.json: {e}") from None
    if not ok or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"unsupported archive: {manifest.get('format')} "
                         f"version {manifest.get('version')}")
    return dir, listed


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _make_private_dir(path: Path) -> None:
    """Creates `path` (and its parents) when missing; only this user may enter it: it holds
    every tenant's prompts (files are created private too: see runner's umask)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        path.chmod(0o700)
    except OSError as e:  # not ours: the lock and the index report what else is wrong
        log.warning("cache directory %s: %s", path, e)


def _lock_root(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(errno.EBUSY, "cache root in use by another SsdTier") from None
    return fd


def _prune_empty_dirs(top: Path, root: Path) -> None:
    """Removes empty directories under `top` (and `top` itself unless it is the root)."""
    if not top.is_dir():
        return
    for dirpath, _, _ in os.walk(top, topdown=False):
        if Path(dirpath) != root:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass  # not empty: a block of another dir, or a concurrent put
