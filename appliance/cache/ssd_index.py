"""The SSD tier's index: one SQLite (WAL) row per stored block, keyed by its file path.

SQLite answers every question directly (a point query is ~5 us) instead of a mirror in
Python objects, because building 100,000 objects alone would blow the 1 s startup budget.
Not thread-safe: the tier calls it under its own lock.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from appliance.cache.block import relative_path

log = logging.getLogger("omlx.cache")

SCHEMA_VERSION = 3  # 3: the "grp" column became "dir", and parent is never NULL
# The path is the key: it is a function of (dir, key), and a range over it selects a
# dir and everything below it.
_SCHEMA = (
    """CREATE TABLE blocks (
        path TEXT PRIMARY KEY,
        dir TEXT NOT NULL,
        key BLOB NOT NULL,
        parent BLOB NOT NULL,
        nbytes INTEGER NOT NULL,
        last_used INTEGER NOT NULL,
        written INTEGER NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX blocks_lru ON blocks (last_used)",
)
# Added after the first schema: created on open when missing (children of a block).
_PARENT_INDEX = "CREATE INDEX IF NOT EXISTS blocks_parent ON blocks (dir, parent)"
_COLUMNS = "path, dir, key, parent, nbytes, written"


@dataclass(frozen=True, slots=True)
class IndexEntry:
    path: str  # relative to the tier root
    dir: str
    key: bytes
    parent: bytes
    nbytes: int  # the whole file, so accounting matches the disk
    written: int  # when the row was written: tells a re-put block from the one we read


@dataclass(frozen=True)
class Reconciled:
    num_rows_dropped: int  # indexed, but the file is gone
    num_strays_removed: int  # .kv files nobody indexed (a crash between rename and commit)
    num_tmp_removed: int  # half-written files of a crashed put


class SsdIndex:
    def __init__(self, path: Path | str):
        self._path = str(path)
        try:
            self._db = self._open_db()
        except sqlite3.OperationalError:
            raise  # cannot open or write (permissions, full disk): not a bad file
        except sqlite3.DatabaseError as e:
            # A cache index is not worth failing over: start empty, strays get cleaned.
            log.warning("SSD cache index %s unreadable (%s); starting a new one", path, e)
            for suffix in ("", "-wal", "-shm"):
                unlink_quietly(Path(self._path + suffix))
            self._db = self._open_db()
        self._db.execute(_PARENT_INDEX)
        # A counter, not a clock: monotonic across restarts and wall-clock jumps.
        self._clock = self._db.execute("SELECT max(last_used) FROM blocks").fetchone()[0] or 0
        self.num_blocks, self.total_bytes = self._count()

    def get(self, dir: str, key: bytes) -> IndexEntry | None:
        """Returns the entry of (dir, key), or None when it is not indexed."""
        row = self._db.execute(f"SELECT {_COLUMNS} FROM blocks WHERE path = ?",
                               (relative_path(dir, key),)).fetchone()
        return None if row is None else IndexEntry(*row)

    def children(self, dir: str, parent: bytes, *, limit: int) -> list[IndexEntry]:
        """Returns up to `limit` blocks that follow `parent`, most recently used first."""
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM blocks WHERE dir = ? AND parent = ? "
                                "ORDER BY last_used DESC LIMIT ?", (dir, parent, limit)).fetchall()
        return [IndexEntry(*row) for row in rows]

    def contains(self, dir: str, key: bytes) -> bool:
        """Returns whether (dir, key) is indexed."""
        return self._db.execute("SELECT 1 FROM blocks WHERE path = ?",
                                (relative_path(dir, key),)).fetchone() is not None

    def least_recent(self, nbytes: int) -> list[IndexEntry]:
        """Returns the least recently used entries whose sizes add up to >= nbytes (or all)."""
        victims: list[IndexEntry] = []
        if nbytes <= 0:
            return victims
        query = f"SELECT {_COLUMNS} FROM blocks ORDER BY last_used"
        with closing(self._db.execute(query)) as rows:  # stops reading at the last victim
            for row in rows:
                victims.append(IndexEntry(*row))
                nbytes -= row[4]
                if nbytes <= 0:
                    break
        return victims

    def of_dir(self, dir: str) -> list[IndexEntry]:
        """Returns the entries of exactly `dir`, least recently used first."""
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM blocks WHERE dir = ? "
                                "ORDER BY last_used", (dir,))
        return [IndexEntry(*row) for row in rows]

    def add(self, dir: str, key: bytes, parent: bytes, nbytes: int) -> IndexEntry:
        """Returns the new, most recently used entry (replacing one of the same key)."""
        path = relative_path(dir, key)
        self._clock += 1
        with self._transaction():
            old = self._db.execute("SELECT nbytes FROM blocks WHERE path = ?", (path,)).fetchone()
            self._db.execute("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (path, dir, key, parent, nbytes, self._clock, self._clock))
        if old is not None:
            self.num_blocks -= 1
            self.total_bytes -= old[0]
        self.num_blocks += 1
        self.total_bytes += nbytes
        return IndexEntry(path, dir, key, parent, nbytes, self._clock)

    def touch(self, entry: IndexEntry) -> None:
        """Marks `entry` most recently used."""
        self._clock += 1
        self._db.execute("UPDATE blocks SET last_used = ? WHERE path = ?",
                         (self._clock, entry.path))

    def remove(self, entries: list[IndexEntry]) -> list[IndexEntry]:
        """Returns the entries forgotten: those not replaced since they were read."""
        removed = []
        with self._transaction():
            for e in entries:
                cur = self._db.execute("DELETE FROM blocks WHERE path = ? AND written = ?",
                                       (e.path, e.written))
                if cur.rowcount:
                    removed.append(e)
        self.num_blocks -= len(removed)
        self.total_bytes -= sum(e.nbytes for e in removed)
        return removed

    def remove_under(self, prefix: str | None) -> list[str]:
        """Returns the paths forgotten: those under dir `prefix` (its subdirs too), or all."""
        # "/" sorts just before "0", so [prefix/, prefix0) is exactly the subtree.
        where, args = ("", ()) if prefix is None else (
            "WHERE path >= ? AND path < ?", (prefix + "/", prefix + "0"))
        with self._transaction():
            paths = [p for (p,) in self._db.execute(f"SELECT path FROM blocks {where}", args)]
            self._db.execute(f"DELETE FROM blocks {where}", args)
        self.num_blocks, self.total_bytes = self._count()
        return paths

    def reconcile(self, root: Path) -> Reconciled:
        """Returns what was fixed after making the index and the files under `root` agree.

        One listdir per directory, no stat per file, one SELECT: 100,000 blocks take well
        under a second. File sizes are trusted from the index and checked on read.
        """
        files: set[str] = set()
        num_tmp = _scan_root(str(root), files)
        indexed = {p for (p,) in self._db.execute("SELECT path FROM blocks")}
        gone = indexed - files
        if gone:
            with self._transaction():
                self._db.executemany("DELETE FROM blocks WHERE path = ?", ((p,) for p in gone))
            self.num_blocks, self.total_bytes = self._count()
        strays = files - indexed
        for rel in strays:
            unlink_quietly(root / rel)
        return Reconciled(len(gone), len(strays), num_tmp)

    def close(self) -> None:
        self._db.close()

    def _count(self) -> tuple[int, int]:
        n, total = self._db.execute("SELECT count(*), total(nbytes) FROM blocks").fetchone()
        return n, int(total)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        # Explicit, because with isolation_level=None `with db:` would not BEGIN.
        self._db.execute("BEGIN")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # also when COMMIT itself failed (disk full)
                self._db.execute("ROLLBACK")
            raise

    def _open_db(self) -> sqlite3.Connection:
        # Autocommit unless in _transaction(). check_same_thread off: the tier's lock
        # serialises access from the writer and request threads.
        db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL survives a killed process; a power cut may lose the last
            # commits, which only turns their files into strays (fsynced before indexing).
            db.execute("PRAGMA synchronous=NORMAL")
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version != SCHEMA_VERSION:
                # Older layouts are dropped, not migrated: their files become strays.
                db.execute("DROP TABLE IF EXISTS blocks")
                for statement in _SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        return db


def _scan_root(root: str, files: set[str]) -> int:
    """Returns the number of .tmp files deleted; adds relative .kv paths to `files`."""
    num_tmp = 0
    for name in os.listdir(root):  # the root's own files are the index and the lock
        path = os.path.join(root, name)
        if os.path.isdir(path):
            num_tmp += _scan(path, name + "/", files)
    return num_tmp


def _scan(directory: str, rel: str, files: set[str]) -> int:
    names = os.listdir(directory)
    blocks = [n for n in names if n.endswith(".kv")]
    files.update(map(rel.__add__, blocks))  # in C: this line runs once per block file
    num_tmp = 0
    if len(blocks) < len(names):  # shard directories, subdirs or crash leftovers
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".tmp"):
                unlink_quietly(Path(path))
                num_tmp += 1
            elif not name.endswith(".kv") and os.path.isdir(path):
                num_tmp += _scan(path, rel + name + "/", files)
    return num_tmp


def unlink_quietly(path: Path) -> None:
    """Deletes a file; a missing one is fine, another failure is logged, never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not delete %s: %s", path, e)
