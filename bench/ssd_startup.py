"""SSD tier startup: how long SsdTier takes to open and reconcile 100,000 blocks.

The target is under 1 s. Blocks are tiny (the cost is per file, not per byte) and are
written straight to disk with their index rows in one transaction, since 100,000 real
puts would spend minutes on fsyncs that startup never sees. Run:

    .venv/bin/python bench/ssd_startup.py [--blocks 100000] [--dir /path/on/the/ssd]

Timings are with a warm page cache (dropping it needs root); a cold scandir on an SSD
adds the directory reads, about 256 directories per dir.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from appliance.cache.block import Block, encode_head, relative_path
from appliance.cache.ssd import SsdTier

DIRS = ("a1b2c3d4e5f6a7b8/default", "a1b2c3d4e5f6a7b8/tenant2", "0f0e0d0c0b0a0908/default")


def build(root: Path, num_blocks: int) -> list[str]:
    """Returns the relative paths of `num_blocks` block files written under `root`."""
    SsdTier(root, budget_bytes=2**40).close()  # creates the index schema
    rows, dirs = [], set()
    for i in range(num_blocks):
        dir = DIRS[i % len(DIRS)]
        block = Block(key=hashlib.sha256(b"%d" % i).digest(), parent=b"root", dir=dir,
                      tokens=(i,), meta={}, payload=b"\0" * 16)
        head = encode_head(block)
        rel = relative_path(dir, block.key)
        path = root / rel
        if path.parent not in dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            dirs.add(path.parent)
        path.write_bytes(head + block.payload)
        rows.append((rel, dir, block.key, block.parent, len(head) + 16, i + 1, i + 1))
    db = sqlite3.connect(root / "index.sqlite")
    with db:
        db.executemany("INSERT INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()
    return [r[0] for r in rows]


def damage(root: Path, rels: list[str], fraction: float) -> None:
    """Deletes a fraction of indexed files and adds as many strays and temp files."""
    n = int(len(rels) * fraction)
    for rel in rels[:n]:
        os.unlink(root / rel)
    for rel in rels[n:2 * n]:
        shutil.copyfile(root / rel, root / (rel[:-3] + "0.kv"))
        (root / (rel + ".1.2.tmp")).write_bytes(b"half")


def time_open(root: Path) -> tuple[float, dict]:
    """Returns the seconds SsdTier took to open `root`, and its stats."""
    started = time.perf_counter()
    tier = SsdTier(root, budget_bytes=2**40)
    elapsed = time.perf_counter() - started
    stats = tier.stats()
    tier.close()
    return elapsed, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: tmp)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ssd-startup-", dir=args.dir))
    try:
        started = time.perf_counter()
        rels = build(root, args.blocks)
        print(f"built {args.blocks:,} blocks in {time.perf_counter() - started:.1f} s")
        for label in ("clean", "clean, again"):
            elapsed, stats = time_open(root)
            print(f"startup ({label}): {elapsed:.3f} s for {stats['blocks']:,} blocks")
        damage(root, rels, 0.01)
        elapsed, stats = time_open(root)
        print(f"startup (1% missing, 1% strays, 1% .tmp): {elapsed:.3f} s, "
              f"{stats['blocks']:,} blocks left")
        elapsed, stats = time_open(root)
        print(f"startup (after repair): {elapsed:.3f} s for {stats['blocks']:,} blocks")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
