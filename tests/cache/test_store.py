import functools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from appliance.cache import store as store_module
from appliance.cache.block import Block
from appliance.cache.keys import KeySpace, KVLayout, key_space
from appliance.cache.kv import KVBlock, from_bytes
from appliance.cache.store import GENERIC, HOST, MEMORY, SSD, Fetched, KVStore, Rate
from appliance.kernels.pinned import PinnedPool
from tests.kernels.test_pinned import PlainBuffer

LAYERS, HEADS, DIM, B = 2, 2, 8, 4
LAYOUT = KVLayout(num_layers=LAYERS, kv_heads=HEADS, k_head_dim=DIM, v_head_dim=DIM, dtype="float32",
                  itemsize=4)
SPACE = key_space(weights="ab" * 32, compute_dtype="float32", layout=LAYOUT, block_tokens=B)
DIR = SPACE.dir
BLOCK_BYTES = LAYOUT.bytes_per_token * B  # 1 KiB: keys and values of 4 tokens
MIB = 2**20


def make_blocks(n: int, *, first_token: int = 0, seed: int = 0, space: KeySpace = SPACE) -> list[KVBlock]:
    """Returns a chain of `n` full blocks of random float32 KV."""
    rng = np.random.default_rng(seed)
    tokens = list(range(first_token, first_token + n * B))
    blocks, parent = [], space.root
    for i, key in enumerate(space.chain(tokens)):
        keys = mx.array(rng.standard_normal((LAYERS, HEADS, B, DIM), dtype=np.float32))
        values = mx.array(rng.standard_normal((LAYERS, HEADS, B, DIM), dtype=np.float32))
        blocks.append(KVBlock(key, parent, space.dir, tuple(tokens[i * B:(i + 1) * B]), keys, values))
        parent = key
    mx.eval([(b.keys, b.values) for b in blocks])
    return blocks


def same_kv(a: KVBlock, b: KVBlock) -> bool:
    return (a.key == b.key and a.tokens == b.tokens
            and np.array_equal(np.array(a.keys.view(mx.uint8)), np.array(b.keys.view(mx.uint8)))
            and np.array_equal(np.array(a.values.view(mx.uint8)), np.array(b.values.view(mx.uint8))))


def fetch(store: KVStore, block: KVBlock, dir: str = DIR) -> Fetched | None:
    fetched = store.fetch_all([(block.key, block.tokens)], dir=dir)
    return fetched[0] if fetched else None


def open_store(root: Path, *, memory: int = 2, host: int = 2, ssd: int = 64) -> KVStore:
    """Returns a store whose budgets are counted in blocks."""
    return KVStore(root=root, memory_bytes=memory * BLOCK_BYTES, host_bytes=host * BLOCK_BYTES,
                   ssd_bytes=ssd * MIB)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "kv")
    yield s
    s.close()


def test_measured_rates_outlive_a_restart(tmp_path):
    """The first request after a start decides restore-or-recompute from measured speeds."""
    first = open_store(tmp_path / "kv")
    first.rates[SSD].add(4 << 30, 2.0)
    first.prefill_tok_s["model-a"] = 1234.0
    first.close()
    again = open_store(tmp_path / "kv")
    try:
        assert again.rates[SSD].bytes_per_s == pytest.approx(2 * 2**30)
        assert again.rates[HOST].value is None  # never measured: the default stands
        assert again.prefill_tok_s == {"model-a": 1234.0}
    finally:
        again.close()
    (tmp_path / "kv" / "rates.json").write_text("{not json")
    garbled = open_store(tmp_path / "kv")
    assert garbled.prefill_tok_s == {}
    garbled.close()


def only_on_ssd(store: KVStore) -> None:
    """Flushes, then empties memory and host (their blocks are on the SSD already)."""
    assert store.flush(timeout_s=10)
    memory, host = store.memory.budget_bytes, store.host.budget_bytes
    ssd = store.stats()[SSD]["budget_bytes"]
    store.resize(memory_bytes=0, host_bytes=0, ssd_bytes=ssd)
    store.resize(memory_bytes=memory, host_bytes=host, ssd_bytes=ssd)
    assert len(store.memory) == 0 and len(store.host) == 0


# --- save and demotion -------------------------------------------------------------


def test_save_puts_blocks_in_memory_and_writes_them_through(store):
    blocks = make_blocks(2)
    store.save(blocks)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [MEMORY, MEMORY]
    assert store.flush(timeout_s=10)
    assert all(store.ssd.contains(b.key, dir=DIR) for b in blocks)
    assert store.stats()[SSD]["blocks"] == 2 and store.stats()[SSD]["writer"]["written"] == 2
    assert store.memory.get(blocks[0].key).dir == DIR


def test_memory_pressure_demotes_the_oldest_block_to_host(store):
    blocks = make_blocks(3)
    store.save(blocks)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST, MEMORY, MEMORY]
    assert blocks[0].key not in store.memory  # a block lives in memory or host, not both
    host = store.host.get(blocks[0].key)
    assert isinstance(host, Block)
    assert (host.dir, host.parent, host.tokens) == (DIR, SPACE.root, blocks[0].tokens)
    assert host.payload_nbytes == BLOCK_BYTES
    back = from_bytes(host)
    assert same_kv(back, blocks[0])


def test_host_pressure_drops_blocks_the_ssd_holds_without_writing_them_again(store):
    blocks = make_blocks(6)
    store.save(blocks)
    assert store.flush(timeout_s=10)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [SSD, SSD, HOST, HOST, MEMORY, MEMORY]
    assert store.stats()[SSD]["writer"]["submitted"] == 6  # one write per block, none on spill


def test_host_pressure_spills_blocks_absent_from_the_ssd(store):
    blocks = make_blocks(6)
    for b in blocks:  # as fetch does: into memory without writing through
        store.put_memory(b)
    assert store.flush(timeout_s=10)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [SSD, SSD, HOST, HOST, MEMORY, MEMORY]
    assert store.stats()[SSD]["writer"]["submitted"] == 2
    assert not store.ssd.contains(blocks[2].key, dir=DIR)
    only_on_ssd(store)
    got = fetch(store, blocks[0])
    assert got is not None and got.tier == SSD and same_kv(got.block, blocks[0])


def test_a_block_larger_than_memory_goes_straight_to_host(tmp_path):
    store = open_store(tmp_path / "kv", memory=0, host=2)
    try:
        (block,) = make_blocks(1)
        store.save([block])
        assert store.tier_of(block.key, DIR) == HOST
        got = fetch(store, block)
        assert got is not None and got.tier == HOST and same_kv(got.block, block)
        assert store.tier_of(block.key, DIR) == HOST  # still too large for memory
    finally:
        store.close()


# --- fetch and prefetch ------------------------------------------------------------


def test_fetch_from_memory(store):
    (block,) = make_blocks(1)
    store.save([block])
    got = fetch(store, block)
    assert got == Fetched(block, MEMORY)


def test_fetch_from_host_promotes_to_memory(store):
    blocks = make_blocks(3)
    store.save(blocks)
    got = fetch(store, blocks[0])
    assert got is not None and got.tier == HOST and same_kv(got.block, blocks[0])
    assert got.block.parent == SPACE.root
    assert store.tier_of(blocks[0].key, DIR) == MEMORY and blocks[0].key not in store.host
    assert store.tier_of(blocks[1].key, DIR) == HOST  # made room for the promoted block


def test_fetch_from_ssd_promotes_to_memory(store):
    blocks = make_blocks(2)
    store.save(blocks)
    only_on_ssd(store)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [SSD, SSD]
    got = fetch(store, blocks[1])
    assert got is not None and got.tier == SSD and same_kv(got.block, blocks[1])
    assert got.block.parent == blocks[0].key
    assert store.tier_of(blocks[1].key, DIR) == MEMORY
    assert fetch(store, blocks[1]).tier == MEMORY


def test_fetch_misses(store):
    blocks = make_blocks(2)
    assert fetch(store, blocks[0]) is None
    store.save(blocks)
    only_on_ssd(store)
    assert store.fetch_all([(blocks[0].key, blocks[1].tokens)], dir=DIR) == []
    assert fetch(store, blocks[1], dir="other/default") is None


def test_fetch_all_keeps_the_chain_s_memory_blocks_while_promoting_the_rest(store):
    """A restore that promotes a chain's host blocks evicts other blocks, not the chain's
    own blocks in memory (which would go down and straight back up)."""
    chain = make_blocks(2)
    other = make_blocks(1, first_token=100)
    store.save(chain)
    store.save(other)  # memory (2 blocks): chain[1], other; chain[0] down to host
    assert [store.tier_of(b.key, DIR) for b in (*chain, *other)] == [HOST, MEMORY, MEMORY]
    got = store.fetch_all([(b.key, b.tokens) for b in chain], dir=DIR)
    assert [f.tier for f in got] == [HOST, MEMORY]
    assert all(same_kv(f.block, b) for f, b in zip(got, chain))
    assert [store.tier_of(b.key, DIR) for b in (*chain, *other)] == [MEMORY, MEMORY, HOST]


def test_fetch_all_returns_the_chain_in_order_over_waves(tmp_path, monkeypatch):
    monkeypatch.setattr("appliance.cache.store.RESTORE_WAVE_BYTES", 2 * BLOCK_BYTES)
    store = open_store(tmp_path / "kv", memory=8, host=8)
    try:
        blocks = make_blocks(5)
        store.save(blocks)
        only_on_ssd(store)
        store.put_memory(blocks[2])  # a memory hit between waves
        got = store.fetch_all([(b.key, b.tokens) for b in blocks], dir=DIR)
        assert [f.tier for f in got] == [SSD, SSD, MEMORY, SSD, SSD]
        assert all(same_kv(f.block, b) for f, b in zip(got, blocks))
        assert all(store.tier_of(b.key, DIR) == MEMORY for b in blocks)
    finally:
        store.close()


def test_a_restore_measures_the_ssd_read_and_the_move_up_apart(tmp_path):
    """Blocks read from the SSD count their read to the SSD's rate and their move to the
    device to the host tier's, so `restore_s` can add the two."""
    store = open_store(tmp_path / "kv", memory=2048, host=2048)
    try:
        blocks = make_blocks(1100)  # > 1 MiB, the least a rate counts
        store.save(blocks)
        only_on_ssd(store)
        assert store.rates[SSD].value is None and store.rates[HOST].value is None
        assert len(store.fetch_all([(b.key, b.tokens) for b in blocks], dir=DIR)) == len(blocks)
        assert store.rates[SSD].value is not None and store.rates[HOST].value is not None
    finally:
        store.close()


def test_fetch_all_stops_at_the_first_lost_block(store):
    blocks = make_blocks(3)
    store.save(blocks)
    only_on_ssd(store)
    wanted = [(blocks[0].key, blocks[0].tokens), (blocks[1].key, blocks[2].tokens), (blocks[2].key, blocks[2].tokens)]
    got = store.fetch_all(wanted, dir=DIR)
    assert [f.block.key for f in got] == [blocks[0].key]


def test_fetch_all_stops_at_an_unreadable_block_and_keeps_those_before_it(store):
    blocks = make_blocks(2)
    store.save(blocks)
    only_on_ssd(store)
    store.prefetch([(b.key, b.tokens) for b in blocks], dir=DIR)
    bad = store.host.pop(blocks[1].key)
    store.host.put(bad.key, Block(bad.key, bad.parent, bad.dir, bad.tokens, bad.meta, bad.payload[:-4]),
                   bad.payload_nbytes)
    got = store.fetch_all([(b.key, b.tokens) for b in blocks], dir=DIR)
    assert [f.block.key for f in got] == [blocks[0].key] and same_kv(got[0].block, blocks[0])


def test_prefetched_block_reports_ssd_as_its_origin(store):
    blocks = make_blocks(2)
    store.save(blocks)
    only_on_ssd(store)
    assert store.prefetch([(b.key, b.tokens) for b in blocks], dir=DIR) == 2
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST, HOST]
    assert isinstance(store.host.get(blocks[0].key), Block)
    got = fetch(store, blocks[0])
    assert got is not None and got.tier == SSD and same_kv(got.block, blocks[0])
    assert store.tier_of(blocks[0].key, DIR) == MEMORY


def chain_without_its_middle(store: KVStore) -> list[KVBlock]:
    """Returns a chain of 3 blocks of which the first and last are on the SSD alone."""
    blocks = make_blocks(3)
    store.save(blocks)
    only_on_ssd(store)
    assert store.ssd.clear(DIR) == 3
    store.save([blocks[0], blocks[2]])
    only_on_ssd(store)
    return blocks


def test_prefetch_stops_at_the_first_missing_block(store):
    blocks = chain_without_its_middle(store)
    assert store.prefetch([(b.key, b.tokens) for b in blocks], dir=DIR) == 1
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST, None, SSD]


def test_prefetch_skips_blocks_already_in_ram(store):
    blocks = make_blocks(3)
    store.save(blocks)
    only_on_ssd(store)
    assert fetch(store, blocks[0]).tier == SSD
    assert store.prefetch([(b.key, b.tokens) for b in blocks], dir=DIR) == 2
    assert [store.tier_of(b.key, DIR) for b in blocks] == [MEMORY, HOST, HOST]


def test_prefetch_with_wrong_tokens_stops(store):
    blocks = make_blocks(2)
    store.save(blocks)
    only_on_ssd(store)
    assert store.prefetch([(blocks[0].key, blocks[1].tokens), (blocks[1].key, blocks[1].tokens)],
                          dir=DIR) == 0
    assert store.tier_of(blocks[1].key, DIR) == SSD


def slow_reads(store: KVStore, monkeypatch, delay_s: float) -> list[bytes]:
    """Makes each SSD read take `delay_s` more (a slow disk); returns the keys read, in order."""
    read, keys = store.ssd.get, []

    def get(key, **kwargs):
        time.sleep(delay_s)
        keys.append(key)
        return read(key, **kwargs)

    monkeypatch.setattr(store.ssd, "get", get)
    return keys


def test_a_restore_takes_over_the_reads_a_prefetch_has_under_way(store, monkeypatch):
    """Blocks read first go to the device while the rest are read, and no file is read twice."""
    blocks = make_blocks(6)
    store.save(blocks)
    only_on_ssd(store)
    # Room in host for all six: a prefetch into a full host tier evicts the blocks it read
    # first, and a restore that comes for them later must read them again.
    store.resize(memory_bytes=store.memory.budget_bytes, host_bytes=3 * store.host.budget_bytes,
                 ssd_bytes=store.stats()[SSD]["budget_bytes"])
    keys = slow_reads(store, monkeypatch, 0.05)
    wanted = [(b.key, b.tokens) for b in blocks]
    under_way, counted = threading.Event(), []
    prefetch = threading.Thread(target=lambda: counted.append(store.prefetch(wanted, dir=DIR, started=under_way.set)))
    prefetch.start()
    assert under_way.wait(5)
    got = store.fetch_all(wanted, dir=DIR)
    prefetch.join(5)
    assert [f.tier for f in got] == [SSD] * 6
    assert all(same_kv(f.block, b) for f, b in zip(got, blocks))
    assert sorted(keys) == sorted(b.key for b in blocks)  # each read once
    assert counted == [6]
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST] * 4 + [MEMORY] * 2


def test_a_claimed_read_that_finds_nothing_ends_the_restore_there(store, monkeypatch):
    blocks = chain_without_its_middle(store)
    slow_reads(store, monkeypatch, 0.05)
    under_way = threading.Event()
    wanted = [(b.key, b.tokens) for b in blocks]
    prefetch = threading.Thread(target=lambda: store.prefetch(wanted, dir=DIR, started=under_way.set))
    prefetch.start()
    assert under_way.wait(5)
    got = store.fetch_all(wanted, dir=DIR)
    prefetch.join(5)
    assert [f.block.key for f in got] == [blocks[0].key]


def test_tier_of_does_not_touch_recency(store):
    blocks = make_blocks(3)
    store.save(blocks[:2])
    assert store.tier_of(blocks[0].key, DIR) == MEMORY
    store.save(blocks[2:])
    assert store.tier_of(blocks[0].key, DIR) == HOST
    assert store.tier_of(b"\0" * 32, DIR) is None


# --- management --------------------------------------------------------------------


def test_resize_demotes_spills_and_shrinks_the_ssd(store):
    blocks = make_blocks(4)
    store.save(blocks)
    assert store.flush(timeout_s=10)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST, HOST, MEMORY, MEMORY]
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=2 * BLOCK_BYTES, ssd_bytes=64 * MIB)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [SSD, HOST, HOST, MEMORY]
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=BLOCK_BYTES, ssd_bytes=64 * MIB)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [SSD, SSD, HOST, MEMORY]
    assert store.memory.stats()["budget_bytes"] == store.host.stats()["budget_bytes"] == BLOCK_BYTES
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=BLOCK_BYTES, ssd_bytes=0)
    assert store.stats()[SSD]["blocks"] == 0 and store.stats()[SSD]["budget_bytes"] == 0
    assert [store.tier_of(b.key, DIR) for b in blocks] == [None, None, HOST, MEMORY]


def test_a_store_keeps_blocks_while_any_tier_has_a_budget(store):
    assert store.keeps_blocks
    store.resize(memory_bytes=0, host_bytes=0, ssd_bytes=64 * MIB)
    assert store.keeps_blocks
    store.resize(memory_bytes=0, host_bytes=0, ssd_bytes=0)
    assert not store.keeps_blocks
    store.resize(memory_bytes=0, host_bytes=BLOCK_BYTES, ssd_bytes=0)
    assert store.keeps_blocks


def test_raising_budgets_keeps_blocks_and_takes_new_ones(store):
    blocks = make_blocks(6)
    store.save(blocks[:4])
    store.resize(memory_bytes=4 * BLOCK_BYTES, host_bytes=4 * BLOCK_BYTES, ssd_bytes=64 * MIB)
    store.save(blocks[4:])
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST, HOST, MEMORY, MEMORY, MEMORY, MEMORY]


def test_moving_budget_from_memory_to_host_keeps_every_block_in_ram(store):
    blocks = make_blocks(4)
    store.save(blocks)
    store.resize(memory_bytes=BLOCK_BYTES, host_bytes=3 * BLOCK_BYTES, ssd_bytes=64 * MIB)
    assert [store.tier_of(b.key, DIR) for b in blocks] == [HOST, HOST, HOST, MEMORY]


def test_clear_of_a_prefix_removes_its_dirs_in_every_tier(tmp_path):
    store = open_store(tmp_path / "kv", memory=4, host=4)
    try:
        spaces = [key_space(weights=w, compute_dtype="float32", layout=LAYOUT, block_tokens=B, tenant=t)
                  for w, t in [("m1", "default"), ("m1", "alice"), ("m2", "default"), ("m10", "default")]]
        blocks = {s.dir: make_blocks(2, seed=i, space=s) for i, s in enumerate(spaces)}
        assert list(blocks) == ["m1/default", "m1/alice", "m2/default", "m10/default"]
        for bs in blocks.values():
            store.save(bs)
        assert store.flush(timeout_s=10)
        # 8 blocks: 4 in memory, 4 in host, all 8 on the SSD.
        assert store.clear("m1") == 4 + 4
        for g, bs in blocks.items():
            want_gone = g.startswith("m1/")
            assert all((store.tier_of(b.key, g) is None) == want_gone for b in bs), g
        assert store.clear("m2/default") == 2 + 2
        assert all(store.tier_of(b.key, "m10/default") is not None for b in blocks["m10/default"])
        assert store.clear() == 2 + 2
        assert len(store.memory) == len(store.host) == store.stats()[SSD]["blocks"] == 0
        assert store.clear() == 0
    finally:
        store.close()


def test_clear_waits_for_pending_writes(store):
    blocks = make_blocks(4)
    store.save(blocks)
    store.clear(DIR)  # a write landing after the clear would resurrect the block
    assert store.flush(timeout_s=10)
    assert store.stats()[SSD]["blocks"] == 0
    assert all(store.tier_of(b.key, DIR) is None for b in blocks)


def test_reopened_store_serves_blocks_from_the_ssd(tmp_path):
    blocks = make_blocks(2)
    first = open_store(tmp_path / "kv")
    first.save(blocks)
    first.flush(timeout_s=10)
    first.close()
    second = open_store(tmp_path / "kv")
    try:
        assert [second.tier_of(b.key, DIR) for b in blocks] == [SSD, SSD]
        got = fetch(second, blocks[1])
        assert got is not None and got.tier == SSD and same_kv(got.block, blocks[1])
    finally:
        second.close()


def test_second_store_on_the_same_root_keeps_memory_and_host(tmp_path, caplog):
    first = open_store(tmp_path / "kv")
    try:
        with caplog.at_level(logging.WARNING, logger="omlx.cache"):
            second = open_store(tmp_path / "kv")
        try:
            blocks = make_blocks(3)
            second.save(blocks)
            assert [second.tier_of(b.key, DIR) for b in blocks] == [HOST, MEMORY, MEMORY]
            got = fetch(second, blocks[0])
            assert got is not None and got.tier == HOST and same_kv(got.block, blocks[0])
            s = second.stats()[SSD]
            assert s["disabled"] and "in use" in s["disabled_reason"]
            assert "disabled" in caplog.text
            second.flush(timeout_s=10)
            assert first.stats()[SSD]["blocks"] == 0  # nothing written under the first one's feet
        finally:
            second.close()
        first.save(make_blocks(1, seed=9, first_token=500))
        assert first.flush(timeout_s=10) and first.stats()[SSD]["blocks"] == 1
    finally:
        first.close()


def test_second_store_on_the_same_root_reports_ssd_error(tmp_path):
    first = open_store(tmp_path / "kv")
    second = open_store(tmp_path / "kv")
    try:
        assert second.ssd_error is not None and "in use" in second.ssd_error
        assert second.ssd is None
    finally:
        second.close()
        first.close()


def test_stats_shape(store):
    s = store.stats()
    assert set(s) == {MEMORY, HOST, SSD}
    for tier in (MEMORY, HOST):
        assert set(s[tier]) - {"kv_bits", "pinned_bytes", "pinned_free_bytes"} == {
            "bytes", "budget_bytes", "blocks", "hits", "evictions", "restore_gbps"}
    assert s[HOST]["pinned_bytes"] == s[HOST]["pinned_free_bytes"] == 0  # pinned memory is for CUDA
    assert s[HOST]["kv_bits"] == s[SSD]["kv_bits"] == 16
    assert s[MEMORY]["budget_bytes"] == 2 * BLOCK_BYTES and s[HOST]["budget_bytes"] == 2 * BLOCK_BYTES
    assert s[SSD]["budget_bytes"] == 64 * MIB and not s[SSD]["disabled"]
    assert {"blocks", "bytes", "hits", "misses", "writer", "restore_gbps"} <= set(s[SSD])
    assert {"submitted", "written", "pending_blocks"} <= set(s[SSD]["writer"])
    assert all(s[t]["restore_gbps"] is None for t in (MEMORY, HOST, SSD))


def test_stats_count_blocks_and_measure_large_restores(store):
    store.resize(memory_bytes=8 * MIB, host_bytes=8 * MIB, ssd_bytes=64 * MIB)
    rng = np.random.default_rng(0)
    tokens = tuple(range(B))
    (key,) = SPACE.chain(list(tokens))
    big = KVBlock(key, SPACE.root, DIR, tokens, mx.array(rng.standard_normal((1, 1, B, 2**16), dtype=np.float32)),
                  mx.array(rng.standard_normal((1, 1, B, 2**16), dtype=np.float32)))
    assert big.nbytes == 2 * MIB
    store.save([big])
    s = store.stats()
    assert (s[MEMORY]["blocks"], s[MEMORY]["bytes"]) == (1, 2 * MIB)
    only_on_ssd(store)
    got = fetch(store, big)
    assert got is not None and got.tier == SSD and same_kv(got.block, big)
    s = store.stats()
    assert s[SSD]["restore_gbps"] is not None and s[SSD]["restore_gbps"] > 0
    assert s[SSD]["hits"] == 1 and s[MEMORY]["blocks"] == 1


def test_rate_ignores_tiny_reads_and_averages():
    rate = Rate(5e9)
    assert rate.bytes_per_s == 5e9 and rate.value is None
    rate.add(1000, 1e-6)
    rate.add(MIB, 0)
    assert rate.value is None
    rate.add(10 * MIB, 1.0)
    assert rate.value == 10 * MIB
    rate.add(20 * MIB, 1.0)
    assert rate.value == pytest.approx(0.7 * 10 * MIB + 0.3 * 20 * MIB)
    assert rate.bytes_per_s == rate.value


# --- precision ---------------------------------------------------------------------

QDIM = 64  # quantized in groups of 64 along the head dimension
QLAYOUT = KVLayout(num_layers=LAYERS, kv_heads=HEADS, k_head_dim=QDIM, v_head_dim=QDIM, dtype="float32",
                   itemsize=4)
QSPACE = key_space(weights="ab" * 32, compute_dtype="float32", layout=QLAYOUT, block_tokens=B, kv_bits=(8, 4))
QBLOCK_BYTES = QLAYOUT.bytes_per_token * B


def make_wide_blocks(n: int) -> list[KVBlock]:
    rng = np.random.default_rng(0)
    tokens = list(range(n * B))
    blocks, parent = [], QSPACE.root
    for i, key in enumerate(QSPACE.chain(tokens)):
        kv = [mx.array(rng.standard_normal((LAYERS, HEADS, B, QDIM), dtype=np.float32)) for _ in range(2)]
        blocks.append(KVBlock(key, parent, QSPACE.dir, tuple(tokens[i * B:(i + 1) * B]), *kv))
        parent = key
    mx.eval([(b.keys, b.values) for b in blocks])
    return blocks


def close_kv(a: KVBlock, b: KVBlock, tolerance: float) -> bool:
    return (a.key == b.key and a.keys.dtype == b.keys.dtype and a.keys.shape == b.keys.shape
            and mx.abs(a.keys - b.keys).max().item() < tolerance
            and mx.abs(a.values - b.values).max().item() < tolerance)


def test_blocks_are_quantized_once_on_their_way_down_and_restored_close(tmp_path):
    store = KVStore(root=tmp_path / "kv", memory_bytes=2 * QBLOCK_BYTES, host_bytes=8 * QBLOCK_BYTES,
                    ssd_bytes=64 * MIB, host_kv_bits=8, ssd_kv_bits=4)
    try:
        blocks = make_wide_blocks(3)
        store.save(blocks)
        assert store.flush(timeout_s=10)
        demoted = store.host.get(blocks[0].key)  # memory holds 2: the first went down to host
        assert demoted.meta["bits"] == 8 and demoted.payload_nbytes < blocks[0].nbytes / 3
        written = store.ssd.get(blocks[0].key, dir=QSPACE.dir, tokens=blocks[0].tokens)
        assert written.meta["bits"] == 4 and written.payload_nbytes < blocks[0].nbytes / 6
        got = fetch(store, blocks[0], QSPACE.dir)
        assert got.tier == HOST and close_kv(got.block, blocks[0], 0.05)
        only_on_ssd(store)
        got = fetch(store, blocks[1], QSPACE.dir)
        assert got.tier == SSD and close_kv(got.block, blocks[1], 0.6)
        stats = store.stats()
        assert (stats[HOST]["kv_bits"], stats[SSD]["kv_bits"]) == (8, 4)
    finally:
        store.close()


def test_a_block_spilled_from_host_keeps_the_hosts_precision(tmp_path):
    store = KVStore(root=tmp_path / "kv", memory_bytes=QBLOCK_BYTES, host_bytes=int(QBLOCK_BYTES * 0.3),
                    ssd_bytes=64 * MIB, host_kv_bits=8, ssd_kv_bits=4)  # host holds one 8-bit block
    try:
        blocks = make_wide_blocks(3)
        for b in blocks:  # as fetch does: into memory without writing through
            store.put_memory(b)
        assert store.flush(timeout_s=10)
        spilled = store.ssd.get(blocks[0].key, dir=QSPACE.dir, tokens=blocks[0].tokens)
        assert spilled is not None and spilled.meta["bits"] == 8
    finally:
        store.close()


def test_the_restore_estimate_counts_the_move_up_and_dequantizing_ssd_blocks(tmp_path):
    store = KVStore(root=tmp_path / "kv", memory_bytes=MIB, host_bytes=MIB, ssd_bytes=MIB, ssd_kv_bits=8,
                    host_kv_bits=8)
    try:
        store.rates[SSD].value, store.rates[HOST].value, store.rates["dequantize"].value = 1e9, 10e9, 4e9
        assert store.restore_s(SSD, 10**9) == pytest.approx(1.35)  # read, move up, dequantize
        assert store.restore_s(HOST, 10**9) == pytest.approx(0.1)
        store.set_kv_bits(host_kv_bits=16, ssd_kv_bits=16)
        assert store.restore_s(SSD, 10**9) == pytest.approx(1.1)
    finally:
        store.close()


def test_wait_warm_returns_at_once_without_native_kernels(store):
    store.expect_layout(dtype="float32", k_dim=DIM, v_dim=DIM)  # the CPU has none: nothing compiles
    assert store.wait_warm(0.0)


def test_an_ssd_restore_with_no_pinned_slot_free_is_estimated_at_the_generic_rate(store):
    """Right after a start on a GPU no slot is pinned: SSD blocks move up by MLX's own path."""
    store.rates[SSD].value, store.rates[HOST].value, store.rates[GENERIC].value = 2e9, 40e9, 2e9
    assert store.restore_s(SSD, int(4e9)) == pytest.approx(2.1)  # no native kernels: HOST is the only path
    store.use_native(quantize=False, dequantize=True)  # as on CUDA, before idle engines pinned anything
    assert store.restore_s(SSD, int(4e9)) == pytest.approx(4.0)
    assert store.restore_s(HOST, int(4e9)) == pytest.approx(0.1)


def test_a_start_pins_its_first_slots_without_waiting_for_an_idle_engine(tmp_path, monkeypatch):
    """Once the native kernels are on and a model's block sizes are known, slots up to
    START_PINNED_BYTES are pinned on a thread of their own, once, within the host budget:
    the first SSD restore after a restart reads into them. (The CPU has no pinned memory:
    ordinary memory stands in for it, as in tests/kernels/test_pinned.py.)"""
    monkeypatch.setattr(store_module, "START_PINNED_BYTES", 4 * MIB)
    monkeypatch.setattr(store_module, "PinnedPool", functools.partial(PinnedPool, allocate=PlainBuffer))
    for host_mib, pinned_mib in ((16, 4), (3, 3)):
        store = KVStore(root=tmp_path / f"kv{host_mib}", memory_bytes=MIB, host_bytes=host_mib * MIB,
                        ssd_bytes=MIB)
        try:
            store.use_native(quantize=True, dequantize=True)
            assert store._start_pinning is None  # no block size known yet
            store.expect_blocks(MIB // 2)
            started = store._start_pinning
            started.join(10)
            assert store.stats()[HOST]["pinned_free_bytes"] == pinned_mib * MIB
            store.expect_blocks(MIB // 2)
            assert store._start_pinning is started
        finally:
            store.close()


def test_an_ssd_read_lands_in_a_free_slot_the_size_of_its_payload(tmp_path, monkeypatch):
    """The start pins slots the size of a block's payload (expect_blocks), the slots demotes
    take; a read from the SSD must land in one too, though its file holds a head as well:
    else every SSD restore takes MLX's generic path."""
    monkeypatch.setattr(store_module, "PinnedPool", functools.partial(PinnedPool, allocate=PlainBuffer))
    store = KVStore(root=tmp_path / "kv", memory_bytes=8 * MIB, host_bytes=8 * MIB, ssd_bytes=64 * MIB)
    try:
        tokens = tuple(range(B))
        rng = np.random.default_rng(0)
        kv = [mx.array(rng.standard_normal((LAYERS, HEADS, B, 8192), dtype=np.float32)) for _ in range(2)]
        block = KVBlock(SPACE.chain(list(tokens))[0], SPACE.root, DIR, tokens, *kv)  # a 1 MiB payload
        store.save([block])
        only_on_ssd(store)
        store.use_native(quantize=False, dequantize=True)
        assert store._pool.reserve_one(MIB)
        assert store.prefetch([(block.key, tokens)], dir=DIR) == 1
        read = store.host.get(block.key)
        assert read.payload_nbytes == MIB and PinnedPool.owns(read.payload)
        assert store.stats()[HOST]["pinned_free_bytes"] == 0
    finally:
        store.close()


def test_the_ssd_is_probed_once_when_asked_not_when_the_store_opens(tmp_path, caplog):
    """A probe beside a model's load would measure the disk the load is reading: the
    runtime asks for it once the model has loaded."""
    first = open_store(tmp_path / "kv")
    first.save(make_blocks(4))
    assert first.flush(timeout_s=10)
    first.close()
    with caplog.at_level(logging.INFO, logger="omlx.cache"):
        again = open_store(tmp_path / "kv")
        try:
            time.sleep(0.2)
            assert "SSD tier reads" not in caplog.text
            again.probe_ssd()
            again.probe_ssd()
            deadline = time.monotonic() + 10
            while "SSD tier reads" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
            assert caplog.text.count("SSD tier reads") == 1
        finally:
            again.close()


def test_a_native_ssd_restore_is_priced_at_the_native_rate_and_dequantizes_in_it(tmp_path, monkeypatch):
    """With the native kernels on and pinned slots free, an SSD block moves up by the
    kernel, which dequantizes as it moves: no dequantize on top, and until measured the
    native rate, not the generic path's."""
    monkeypatch.setattr(store_module, "PinnedPool", functools.partial(PinnedPool, allocate=PlainBuffer))
    store = KVStore(root=tmp_path / "kv", memory_bytes=MIB, host_bytes=256 * MIB, ssd_bytes=MIB, ssd_kv_bits=4)
    try:
        store.use_native(quantize=False, dequantize=True)
        assert store.rates[HOST].bytes_per_s == store_module.NATIVE_HOST_RATE
        for _ in range(2):
            store._pool.reserve_one(32 * MIB)
        store.rates[SSD].value, store.rates[HOST].value, store.rates["dequantize"].value = 1e9, 10e9, 4e9
        assert store.restore_s(SSD, 10**8) == pytest.approx(0.11)  # read, move up
        store.use_native(quantize=False, dequantize=False)
        assert store.restore_s(SSD, 10**8) == pytest.approx(0.135)  # read, move up, dequantize
    finally:
        store.close()


def test_readiness_can_wait_for_the_start_s_pinning(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "START_PINNED_BYTES", 4 * MIB)
    monkeypatch.setattr(store_module, "PinnedPool", functools.partial(PinnedPool, allocate=PlainBuffer))
    store = KVStore(root=tmp_path / "kv", memory_bytes=MIB, host_bytes=16 * MIB, ssd_bytes=MIB)
    try:
        assert store.wait_start_pinning(0.0)  # none started
        store.use_native(quantize=True, dequantize=True)
        store.expect_blocks(MIB)
        assert store.wait_start_pinning(10)
        assert store.stats()[HOST]["pinned_bytes"] == 4 * MIB
    finally:
        store.close()
