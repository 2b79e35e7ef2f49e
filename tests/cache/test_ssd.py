import errno
import hashlib
import io
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from appliance.cache.block import Block, encode_head, relative_path
from appliance.cache.ssd import SsdTier

DIR = "a1b2c3d4e5f6a7b8/default"
KiB = 1024
REPO = Path(__file__).resolve().parents[2]


def make_block(i: int, *, dir: str = DIR, nbytes: int = 4 * KiB) -> Block:
    key = hashlib.sha256(f"{dir}/{i}".encode()).digest()
    parent = hashlib.sha256(f"{dir}/{i - 1}".encode()).digest()  # i == 0: as if a root key
    return Block(key=key, parent=parent, dir=dir, tokens=tuple(range(i * 16, i * 16 + 16)),
                 meta={"dtype": "float32", "layers": 2, "i": i},
                 payload=random.Random(i).randbytes(nbytes))


def file_size(b: Block) -> int:
    return len(encode_head(b)) + b.payload_nbytes


def path_of(tier: SsdTier, b: Block) -> Path:
    return tier.root / relative_path(b.dir, b.key)


def get(tier: SsdTier, b: Block) -> Block | None:
    return tier.get(b.key, dir=b.dir, tokens=b.tokens)


def kv_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


@pytest.fixture
def tier(tmp_path: Path):
    with SsdTier(tmp_path / "ssd", budget_bytes=10 * 2**20) as t:
        yield t


def test_round_trip(tier: SsdTier):
    b = make_block(0)
    assert tier.put(b)
    back = get(tier, b)
    assert back is not None
    assert (back.key, back.parent, back.dir, back.tokens) == (b.key, b.parent, b.dir, b.tokens)
    assert back.meta == b.meta and bytes(back.payload) == b.payload
    assert tier.contains(b.key, dir=DIR)
    assert not tier.contains(b.key, dir="other/default")
    s = tier.stats()
    assert (s["blocks"], s["bytes"], s["writes"], s["hits"]) == (1, file_size(b), 1, 1)
    assert s["bytes"] == path_of(tier, b).stat().st_size
    assert s["read_bytes"] == s["bytes"] and s["read_gbps"] > 0


def test_absent_block_is_a_counted_miss(tier: SsdTier):
    assert tier.stats()["read_gbps"] is None
    assert get(tier, make_block(0)) is None
    assert tier.stats()["misses"] == {"absent": 1}


def test_putting_a_stored_key_again_writes_nothing(tier: SsdTier):
    b = make_block(0)
    assert tier.put(b) and tier.put(b)
    assert tier.stats()["writes"] == 1 and len(kv_files(tier.root)) == 1


def test_children_read_the_headers_of_those_not_skipped(tier: SsdTier, monkeypatch):
    from appliance.cache import ssd

    root = hashlib.sha256(b"root").digest()
    blocks = [Block(key=make_block(i).key, parent=root, dir=DIR, tokens=(i, i + 1), meta={}, payload=b"x" * 64)
              for i in range(3)]
    for b in blocks:
        tier.put(b)
    reads = []
    real = ssd.read_tokens
    monkeypatch.setattr(ssd, "read_tokens", lambda path, **kw: reads.append(path) or real(path, **kw))
    assert sorted(tier.children(root, dir=DIR)) == sorted((b.key, b.tokens) for b in blocks)
    reads.clear()
    assert tier.children(root, dir=DIR, skip={blocks[0].key, blocks[1].key}) == [(blocks[2].key, blocks[2].tokens)]
    assert reads == [path_of(tier, blocks[2])]


def test_longest_prefix_counts_leading_stored_keys(tier: SsdTier):
    blocks = [make_block(i) for i in range(5)]
    for b in blocks[:3] + blocks[4:]:
        tier.put(b)
    keys = [b.key for b in blocks]
    assert tier.longest_prefix(keys, dir=DIR) == 3
    assert tier.longest_prefix(keys[:2], dir=DIR) == 2
    assert tier.longest_prefix(keys, dir="other/default") == 0
    assert tier.longest_prefix([], dir=DIR) == 0


def test_lru_eviction_keeps_the_budget_and_get_bumps_recency(tmp_path: Path):
    blocks = [make_block(i) for i in range(1, 5)]  # equal file sizes
    with SsdTier(tmp_path, budget_bytes=3 * file_size(blocks[0])) as tier:
        for b in blocks[:3]:
            assert tier.put(b)
        assert get(tier, blocks[0]) is not None  # 0 is now newer than 1
        assert tier.put(blocks[3])
        present = [tier.contains(b.key, dir=DIR) for b in blocks]
        assert present == [True, False, True, True]
        assert not path_of(tier, blocks[1]).exists()
        s = tier.stats()
        assert s["evictions"] == 1 and s["bytes"] <= s["budget_bytes"]
        assert s["bytes"] == sum(p.stat().st_size for p in kv_files(tier.root))


def test_block_larger_than_the_budget_is_refused(tmp_path: Path):
    small, big = make_block(0), make_block(1, nbytes=64 * KiB)
    with SsdTier(tmp_path, budget_bytes=16 * KiB) as tier:
        assert tier.put(small)
        assert not tier.put(big)
        assert tier.contains(small.key, dir=DIR)  # nothing evicted for a hopeless put
        assert tier.stats()["refused"] == 1 and not path_of(tier, big).exists()


def test_resize_down_evicts_at_once(tier: SsdTier):
    blocks = [make_block(i) for i in range(1, 7)]
    for b in blocks:
        tier.put(b)
    tier.resize(2 * file_size(blocks[0]))
    assert [tier.contains(b.key, dir=DIR) for b in blocks] == [False] * 4 + [True] * 2
    assert len(kv_files(tier.root)) == 2
    assert tier.stats()["bytes"] <= tier.stats()["budget_bytes"]


def test_flipped_payload_byte_is_a_corrupt_miss_and_removed(tier: SsdTier):
    b = make_block(0)
    tier.put(b)
    path = path_of(tier, b)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(data)
    assert get(tier, b) is None
    assert tier.stats()["misses"] == {"corrupt": 1}
    assert not path.exists() and not tier.contains(b.key, dir=DIR)
    assert tier.stats()["bytes"] == 0


def test_truncated_file_is_a_miss(tier: SsdTier):
    b = make_block(0)
    tier.put(b)
    with open(path_of(tier, b), "r+b") as f:
        f.truncate(file_size(b) // 2)
    assert get(tier, b) is None
    assert tier.stats()["misses"] == {"truncated": 1}
    assert not path_of(tier, b).exists()


def test_file_deleted_behind_the_index_is_missing(tier: SsdTier):
    b = make_block(0)
    tier.put(b)
    path_of(tier, b).unlink()
    assert get(tier, b) is None
    assert tier.stats()["misses"] == {"missing": 1}
    assert not tier.contains(b.key, dir=DIR) and tier.stats()["blocks"] == 0


def test_file_of_another_key_or_dir_is_foreign(tier: SsdTier):
    mine, other_key, other_dir = make_block(0), make_block(1), make_block(0, dir="zz/t")
    for b in (mine, other_key, other_dir):
        tier.put(b)
    shutil.copyfile(path_of(tier, other_key), path_of(tier, mine))
    assert get(tier, mine) is None
    tier.put(mine)
    shutil.copyfile(path_of(tier, other_dir), path_of(tier, mine))
    assert get(tier, mine) is None
    assert tier.stats()["misses"] == {"foreign": 2}
    assert get(tier, other_key) is not None and get(tier, other_dir) is not None


def test_other_tokens_are_a_token_mismatch(tier: SsdTier):
    b = make_block(0)
    tier.put(b)
    assert tier.get(b.key, dir=DIR, tokens=(1,) * 16) is None
    assert tier.stats()["misses"] == {"token_mismatch": 1}
    assert not path_of(tier, b).exists()


def test_restart_keeps_blocks_and_their_recency(tmp_path: Path):
    blocks = [make_block(i) for i in range(1, 4)]
    with SsdTier(tmp_path, budget_bytes=2**20) as tier:
        for b in blocks:
            tier.put(b)
        get(tier, blocks[0])
    # A smaller budget at startup evicts the least recent first: block 1, then 2.
    with SsdTier(tmp_path, budget_bytes=2 * file_size(blocks[0])) as tier:
        assert [tier.contains(b.key, dir=DIR) for b in blocks] == [True, False, True]
        assert bytes(get(tier, blocks[0]).payload) == blocks[0].payload
        assert len(kv_files(tmp_path)) == 2


def test_a_dir_of_the_previous_format_starts_empty(tmp_path: Path):
    """Format 1 (schema 2) said "group" and let a first block's parent be null: its index
    is dropped and its files removed, never read as this format's."""
    old = tmp_path / relative_path(DIR, b"\x01" * 32)
    old.parent.mkdir(parents=True)
    old.write_bytes(b"OMLXKV\r\n" + b"\x01\x00\x00\x00" + b"\x00" * 64)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE blocks (path TEXT PRIMARY KEY, grp TEXT NOT NULL, key BLOB NOT NULL, parent BLOB, "
               "nbytes INTEGER NOT NULL, last_used INTEGER NOT NULL, written INTEGER NOT NULL) WITHOUT ROWID")
    db.execute("INSERT INTO blocks VALUES (?, ?, ?, NULL, 80, 1, 1)",
               (relative_path(DIR, b"\x01" * 32), DIR, b"\x01" * 32))
    db.execute("PRAGMA user_version=2")
    db.commit()
    db.close()
    with SsdTier(tmp_path, budget_bytes=2**30) as tier:
        assert tier.stats()["blocks"] == 0 and not old.exists()
        b = make_block(0)
        assert tier.put(b) and get(tier, b) is not None


def test_startup_reconciles_index_and_files(tmp_path: Path):
    blocks = [make_block(i, dir=f"m{i % 3}/t", nbytes=KiB) for i in range(300)]
    with SsdTier(tmp_path, budget_bytes=2**30) as tier:
        for b in blocks:
            assert tier.put(b)
    deleted, kept = blocks[:20], blocks[20:]
    for b in deleted:
        os.unlink(tmp_path / relative_path(b.dir, b.key))
    stray = tmp_path / relative_path("m0/t", b"\xab" * 32)  # a crash between rename and commit
    stray.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tmp_path / relative_path(kept[0].dir, kept[0].key), stray)
    tmps = [tmp_path / relative_path(b.dir, b.key + b"x") for b in blocks[:5]]
    for t in tmps:
        t.with_suffix(".kv.123.456.tmp").write_bytes(b"half a block")
    with SsdTier(tmp_path, budget_bytes=2**30) as tier:
        assert not list(tmp_path.rglob("*.tmp")) and not stray.exists()
        assert not any(tier.contains(b.key, dir=b.dir) for b in deleted)
        files = kv_files(tmp_path)
        s = tier.stats()
        assert s["blocks"] == len(files) == len(kept)
        assert s["bytes"] == sum(f.stat().st_size for f in files)
        assert all(get(tier, b) is not None for b in kept)
        assert tier.stats()["misses"] == {}


def test_unreadable_index_starts_empty_and_sweeps_its_files(tmp_path: Path):
    with SsdTier(tmp_path, budget_bytes=2**20) as tier:
        for i in range(3):
            tier.put(make_block(i))
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"index.sqlite{suffix}").unlink(missing_ok=True)
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with SsdTier(tmp_path, budget_bytes=2**20) as tier:
        assert tier.stats()["blocks"] == 0 and kv_files(tmp_path) == []
        assert tier.put(make_block(0)) and get(tier, make_block(0)) is not None


def test_unusable_root_disables_the_tier(tmp_path: Path):
    (tmp_path / "file").write_bytes(b"")
    with SsdTier(tmp_path / "file", budget_bytes=2**20) as tier:
        assert tier.stats()["disabled"] and "cannot open" in tier.stats()["disabled_reason"]
        assert not tier.put(make_block(0)) and get(tier, make_block(0)) is None


def test_second_tier_on_the_same_root_is_disabled(tmp_path: Path):
    with SsdTier(tmp_path, budget_bytes=2**20) as first:
        first.put(make_block(0))
        with SsdTier(tmp_path, budget_bytes=2**20) as second:
            assert second.stats()["disabled"]
            assert "in use" in second.stats()["disabled_reason"]
            assert not second.put(make_block(1))
        assert first.contains(make_block(0).key, dir=DIR)


KILL_SCRIPT = """
import hashlib, os, stat, sys, time
from pathlib import Path
from appliance.cache.block import Block
from appliance.cache.ssd import SsdTier
root, budget, first, stall_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
real_fsync = os.fsync

def stalling_fsync(fd):  # pins the kill between writing a block's temp file and its rename
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return real_fsync(fd)  # a directory
    print("stalled", flush=True)
    time.sleep(60)

tier = SsdTier(Path(root), budget_bytes=budget)
for i in range(first, first + 10**6):
    os.fsync = stalling_fsync if i == stall_at else real_fsync
    tier.put(Block(key=hashlib.sha256(b"kill/%d" % i).digest(), parent=b"root", dir="kill/t",
                   tokens=(i, i + 1), meta={}, payload=bytes([i % 251]) * 262144))
    print(i, flush=True)
"""
KILL_PAYLOAD = 262144


def run_until_killed(root: Path, budget: int, *, first: int, stall_at: int, delay_s: float
                     ) -> int:
    """Runs a writer subprocess, SIGKILLs it, and returns the last block it finished."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(root), str(budget), str(first), str(stall_at)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [proc.stdout.readline() for _ in range(5)]
    while stall_at >= 0 and lines[-1] != "stalled\n":
        lines.append(proc.stdout.readline())
        assert lines[-1], "writer subprocess died before it was killed"
    if stall_at >= 0:
        assert list(root.rglob("*.tmp")), "the stalled put has its temp file on disk"
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines += proc.stdout.read().splitlines()
    proc.stdout.close()
    return max(int(x) for x in lines if x.strip().isdigit())


def test_sigkill_while_writing_leaves_a_consistent_index(tmp_path: Path):
    budget = 20 * (KILL_PAYLOAD + 4096)  # about 20 blocks: evictions run when it is killed
    # Once killed mid-put on purpose, once at a random moment; the second run also opens
    # the root the first one crashed in.
    last = run_until_killed(tmp_path, budget, first=0, stall_at=30, delay_s=0)
    assert last == 29
    last = run_until_killed(tmp_path, budget, first=1000, stall_at=-1,
                            delay_s=random.uniform(0.01, 0.1))

    with SsdTier(tmp_path, budget_bytes=budget) as tier:
        assert not list(tmp_path.rglob("*.tmp"))
        files = kv_files(tmp_path)
        s = tier.stats()
        assert s["blocks"] == len(files) > 0
        assert s["bytes"] == sum(f.stat().st_size for f in files) <= budget
        num_valid = 0
        for i in [*range(31), *range(1000, last + 2)]:
            key = hashlib.sha256(b"kill/%d" % i).digest()
            if tier.contains(key, dir="kill/t"):
                b = tier.get(key, dir="kill/t", tokens=(i, i + 1))
                assert b is not None and bytes(b.payload) == bytes([i % 251]) * KILL_PAYLOAD
                num_valid += 1
        assert num_valid == len(files)
        assert tier.contains(hashlib.sha256(b"kill/%d" % last).digest(), dir="kill/t")


def no_space(fd: int, data: bytes) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_disables_writes_and_reads_continue(tier: SsdTier, monkeypatch, caplog):
    stored = make_block(0)
    assert tier.put(stored)
    with monkeypatch.context() as m:
        m.setattr(os, "write", no_space)
        assert not tier.put(make_block(1))
    s = tier.stats()
    assert s["disabled"] and "ENOSPC" in s["disabled_reason"] and s["write_errors"] == 1
    assert "disabled" in caplog.text
    assert not tier.put(make_block(2))  # stays off: no retry storm against a full disk
    assert bytes(get(tier, stored).payload) == stored.payload
    assert not list(tier.root.rglob("*.tmp")) and len(kv_files(tier.root)) == 1


def test_other_write_errors_are_counted_but_keep_the_tier_on(tier: SsdTier, monkeypatch):
    def io_error(fd: int, data: bytes) -> int:
        raise OSError(errno.EIO, "I/O error")

    with monkeypatch.context() as m:
        m.setattr(os, "write", io_error)
        assert not tier.put(make_block(1))
    assert tier.stats()["write_errors"] == 1 and not tier.stats()["disabled"]
    assert tier.put(make_block(2))


def test_clear_removes_a_dir_prefix_or_everything(tier: SsdTier):
    dirs = ["m1/t1", "m1/t2", "m10/t1", "m2/t1"]
    for g in dirs:
        for i in range(3):
            tier.put(make_block(i, dir=g))
    assert tier.clear("m1") == 6
    assert not (tier.root / "m1").exists()
    assert tier.contains(make_block(0, dir="m10/t1").key, dir="m10/t1")
    assert tier.clear() == 6
    assert tier.stats()["bytes"] == 0 and kv_files(tier.root) == []
    assert tier.put(make_block(0, dir="m1/t1"))  # directories come back on demand
    with pytest.raises(ValueError):
        tier.clear("../outside")


def test_export_then_import_into_a_fresh_root(tmp_path: Path):
    blocks = [make_block(i) for i in range(5)]
    with SsdTier(tmp_path / "a", budget_bytes=2**20) as src:
        for b in blocks:
            src.put(b)
        src.put(make_block(0, dir="other/t"))
        assert src.export(DIR, tmp_path / "cache.tar") == 5
    with SsdTier(tmp_path / "b", budget_bytes=2**20) as dst:
        assert dst.import_archive(tmp_path / "cache.tar") == 5
        for b in blocks:
            back = get(dst, b)
            assert back is not None and bytes(back.payload) == b.payload and back.meta == b.meta
        assert not dst.contains(make_block(0, dir="other/t").key, dir="other/t")


def rewrite_archive(src: Path, dest: Path, edit) -> None:
    with tarfile.open(src) as tin, tarfile.open(dest, "w") as tout:
        for m in tin.getmembers():
            data = edit(m.name, tin.extractfile(m).read())
            m.size = len(data)
            tout.addfile(m, io.BytesIO(data))


def test_tampered_archive_member_is_rejected(tmp_path: Path):
    blocks = [make_block(i) for i in range(4)]
    with SsdTier(tmp_path / "a", budget_bytes=2**20) as src:
        for b in blocks:
            src.put(b)
        src.export(DIR, tmp_path / "cache.tar")
    victim = f"blocks/{blocks[2].key.hex()}.kv"

    def flip(name: str, data: bytes) -> bytes:
        return data[:-1] + bytes([data[-1] ^ 1]) if name == victim else data

    rewrite_archive(tmp_path / "cache.tar", tmp_path / "bad.tar", flip)
    with SsdTier(tmp_path / "b", budget_bytes=2**20) as dst:
        assert dst.import_archive(tmp_path / "bad.tar") == 3
        assert dst.stats()["import_rejected"] == 1
        assert [dst.contains(b.key, dir=DIR) for b in blocks] == [True, True, False, True]
        assert len(kv_files(dst.root)) == 3


def test_archive_relabelled_to_another_dir_imports_nothing(tmp_path: Path):
    with SsdTier(tmp_path / "a", budget_bytes=2**20) as src:
        for i in range(3):
            src.put(make_block(i))
        src.export(DIR, tmp_path / "cache.tar")

    def relabel(name: str, data: bytes) -> bytes:
        return data.replace(DIR.encode(), b"evil/tenant") if name == "manifest.json" else data

    rewrite_archive(tmp_path / "cache.tar", tmp_path / "evil.tar", relabel)
    with SsdTier(tmp_path / "b", budget_bytes=2**20) as dst:
        assert dst.import_archive(tmp_path / "evil.tar") == 0
        assert dst.stats()["import_rejected"] == 3 and dst.stats()["blocks"] == 0


def test_import_of_a_non_archive_raises(tier: SsdTier, tmp_path: Path):
    (tmp_path / "junk.tar").write_bytes(b"not a tar file at all" * 100)
    with pytest.raises(ValueError):
        tier.import_archive(tmp_path / "junk.tar")


def test_reads_and_evicting_puts_from_many_threads_never_serve_bad_blocks(tmp_path: Path):
    blocks = [make_block(i, nbytes=16 * KiB) for i in range(1, 61)]
    with SsdTier(tmp_path, budget_bytes=20 * file_size(blocks[0])) as tier:
        served: list[Block] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                for b in blocks:
                    back = get(tier, b)
                    if back is not None:
                        assert bytes(back.payload) == b.payload
                        served.append(back)

        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        for b in blocks:
            assert tier.put(b)
        stop.set()
        for t in readers:
            t.join()
        misses = tier.stats()["misses"]
        assert set(misses) <= {"absent", "missing"}  # missing: evicted between lookup and open
        assert served and tier.stats()["bytes"] <= tier.stats()["budget_bytes"]
        assert tier.stats()["blocks"] == len(kv_files(tmp_path)) == 20
