import threading
from pathlib import Path

import pytest

from appliance.cache.block import Block
from appliance.cache.ssd import SsdTier
from appliance.cache.writer import SsdWriter
from tests.cache.test_ssd import DIR, KiB, make_block


@pytest.fixture
def tier(tmp_path: Path):
    with SsdTier(tmp_path, budget_bytes=2**30) as t:
        yield t


def stall_puts(tier: SsdTier, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Injects a stuck disk: puts wait until the returned event is set."""
    release = threading.Event()
    real_put = tier.put

    def slow_put(block: Block) -> bool:
        release.wait(10)
        return real_put(block)

    monkeypatch.setattr(tier, "put", slow_put)
    return release


def test_submitted_blocks_reach_the_tier(tier: SsdTier):
    writer = SsdWriter(tier, max_pending_bytes=2**20)
    blocks = [make_block(i) for i in range(10)]
    assert all(writer.submit(b) for b in blocks)
    assert writer.flush(timeout_s=10)
    assert tier.longest_prefix([b.key for b in blocks], dir=DIR) == 10
    assert writer.stats()["written"] == 10 and writer.stats()["pending_bytes"] == 0
    assert writer.close()


def test_submit_drops_instead_of_waiting_when_the_queue_is_full(tier, monkeypatch):
    release = stall_puts(tier, monkeypatch)
    writer = SsdWriter(tier, max_pending_bytes=10 * KiB)
    first, second, third = (make_block(i, nbytes=4 * KiB) for i in range(3))
    assert writer.submit(first) and writer.submit(second)
    assert not writer.submit(third)  # 12 KiB would exceed the 10 KiB bound
    assert not writer.submit(make_block(9, nbytes=64 * KiB))
    assert writer.stats()["dropped"] == 2
    release.set()
    assert writer.flush(timeout_s=10)
    assert tier.contains(second.key, dir=DIR) and not tier.contains(third.key, dir=DIR)
    writer.close()


def test_is_pending_until_written(tier, monkeypatch):
    release = stall_puts(tier, monkeypatch)
    writer = SsdWriter(tier, max_pending_bytes=2**20)
    b = make_block(0)
    writer.submit(b)
    assert writer.is_pending(b.key, dir=DIR)
    assert writer.submit(b) and writer.stats()["submitted"] == 1  # queued once
    assert not writer.flush(timeout_s=0.05)
    release.set()
    assert writer.flush(timeout_s=10)
    assert not writer.is_pending(b.key, dir=DIR) and tier.contains(b.key, dir=DIR)
    writer.close()


def test_close_writes_what_is_queued_and_refuses_more(tier, monkeypatch):
    release = stall_puts(tier, monkeypatch)
    writer = SsdWriter(tier, max_pending_bytes=2**20)
    blocks = [make_block(i) for i in range(3)]
    for b in blocks:
        writer.submit(b)
    release.set()
    assert writer.close(timeout_s=10)
    assert tier.longest_prefix([b.key for b in blocks], dir=DIR) == 3
    assert not writer.submit(make_block(5))


def test_a_failing_put_does_not_stop_the_writer(tier, monkeypatch):
    real_put = tier.put
    calls = []

    def put_failing_once(block: Block) -> bool:
        calls.append(block.key)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_put(block)

    monkeypatch.setattr(tier, "put", put_failing_once)
    writer = SsdWriter(tier, max_pending_bytes=2**20)
    writer.submit(make_block(0))
    writer.submit(make_block(1))
    assert writer.flush(timeout_s=10)
    assert writer.stats()["failed"] == 1 and writer.stats()["written"] == 1
    assert tier.contains(make_block(1).key, dir=DIR)
    writer.close()


def test_reads_while_the_writer_thread_puts(tier: SsdTier):
    blocks = [make_block(i, nbytes=32 * KiB) for i in range(80)]
    writer = SsdWriter(tier, max_pending_bytes=2**30)
    served = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            for b in blocks:
                if tier.contains(b.key, dir=DIR):
                    back = tier.get(b.key, dir=DIR, tokens=b.tokens)
                    assert back is not None and bytes(back.payload) == b.payload
                    served.append(b.key)

    reader = threading.Thread(target=read)
    reader.start()
    for b in blocks:
        assert writer.submit(b)
    assert writer.flush(timeout_s=20)
    done.set()
    reader.join()
    writer.close()
    assert served
    assert tier.stats()["misses"] == {} and tier.stats()["blocks"] == 80
