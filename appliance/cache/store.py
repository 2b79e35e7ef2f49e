"""The tiered KV store: memory (MLX arrays) -> host (bytes in RAM) -> SSD (files), one per process.

Blocks enter the memory tier and are written through to the SSD behind the request.
Under pressure memory demotes to host and host drops what the SSD already holds (or
hands it to the SSD writer). A hit promotes its block back to memory. On unified-memory
machines (Apple Silicon, CPUs) "memory" and "host" are the same RAM: host blocks are
serialized copies, and a block lives in one of the two, never both, so the budgets add up.

The host and SSD tiers may keep KV at fewer bits than computed (`host_kv_bits`,
`ssd_kv_bits`: 16, 8 or 4). A block is quantized once, on its way down: when memory demotes
it (to host precision) or when it is written through (to SSD precision); a block spilled
from host to the SSD keeps the host's precision. A restore dequantizes it back.

MLX work (building arrays) happens on the calling engine thread; `prefetch` only reads
files into the host tier, so it is safe on an I/O thread.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from appliance.cache.block import Block
from appliance.cache.kv import KVBlock, from_bytes, to_bytes
from appliance.cache.lru import LruTier
from appliance.cache.ssd import SsdTier
from appliance.cache.writer import SsdWriter
from appliance.kernels.kv_quant import computed_nbytes
from appliance.moving_average import moving_average

log = logging.getLogger("omlx.cache")

MEMORY, HOST, SSD = "memory", "host", "ssd"
DEQUANTIZE = "dequantize"  # not a tier: the rate of turning 8- or 4-bit blocks back into KV
# Until measured, assume restores run at these speeds (bytes of KV as computed per second):
# conservative for SSDs.
DEFAULT_RATES = {MEMORY: 20e9, HOST: 5e9, SSD: 1e9, DEQUANTIZE: 5e9}
WRITER_PENDING_BYTES = 1 << 30
PREFETCH_READERS = 4


@dataclass(frozen=True)
class Fetched:
    """A block fetched for a restore, and the tier that served it (SSD for a block a
    prefetch read into host RAM: hits are reported by where the bytes came from)."""

    block: KVBlock
    tier: str


class Rate:
    """Measured restore throughput of a tier (bytes/s), an exponential moving average."""

    def __init__(self, default: float):
        self.default = default
        self.value: float | None = None

    def add(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes < (1 << 20):  # tiny reads measure overheads, not bandwidth
            return
        sample = nbytes / seconds
        self.value = moving_average(self.value, sample)

    @property
    def bytes_per_s(self) -> float:
        return self.value or self.default


class KVStore:
    def __init__(self, *, root: Path, memory_bytes: int, host_bytes: int, ssd_bytes: int,
                 host_kv_bits: int = 16, ssd_kv_bits: int = 16):
        self.kv_bits = {HOST: host_kv_bits, SSD: ssd_kv_bits}
        self.memory: LruTier[KVBlock] = LruTier(MEMORY, memory_bytes)
        self.host: LruTier[Block] = LruTier(HOST, host_bytes)
        # Keys of host blocks a prefetch read from the SSD. Every put into host sets or
        # clears its key, so a key left behind by an eviction is harmless.
        self._prefetched: set[bytes] = set()
        self.rates = {tier: Rate(r) for tier, r in DEFAULT_RATES.items()}
        self.ssd: SsdTier | None = None
        self.writer: SsdWriter | None = None
        self.ssd_error: str | None = None
        self._lock = threading.Lock()
        # Block files are read in parallel: a read's cost here is as much fresh memory
        # (page faults) as the disk, and both spread over cores and the device queue.
        self._readers = ThreadPoolExecutor(max_workers=PREFETCH_READERS, thread_name_prefix="kv-read")
        self._open_ssd(root, ssd_bytes)

    def _open_ssd(self, root: Path, ssd_bytes: int) -> None:
        try:
            tier = SsdTier(root, budget_bytes=ssd_bytes)
            reason = tier.stats().get("disabled_reason") if tier.stats().get("disabled") else None
        except Exception as e:  # the dir is unusable
            tier, reason = None, str(e)
        if reason is not None:  # e.g. another process holds the dir: don't share its files
            if tier is not None:
                tier.close()
            self.ssd_error = f"SSD tier disabled: {reason}"
            log.warning("%s (root %s); serving continues with memory and host tiers", self.ssd_error, root)
            return
        self.ssd = tier
        self.writer = SsdWriter(tier, max_pending_bytes=WRITER_PENDING_BYTES)

    # --- lookup ----------------------------------------------------------------------

    def tier_of(self, key: bytes, dir: str) -> str | None:
        """Returns the fastest tier holding the block, without touching recency."""
        if key in self.memory:
            return MEMORY
        if key in self.host:
            return HOST
        if self.ssd is not None and self.ssd.contains(key, dir=dir):
            return SSD
        return None

    def children(self, parent: bytes, dir: str) -> dict[bytes, tuple[tuple[int, ...], str]]:
        """Returns the stored blocks that follow `parent`: key -> (tokens, fastest tier)."""
        found: dict[bytes, tuple[tuple[int, ...], str]] = {}
        if self.ssd is not None:
            for key, tokens in self.ssd.children(parent, dir=dir):
                found[key] = (tokens, SSD)
        for tier, name in ((self.host, HOST), (self.memory, MEMORY)):
            for b in tier.values():
                if b.parent == parent and b.dir == dir:
                    found[b.key] = (b.tokens, name)
        return found

    def fetch(self, key: bytes, *, dir: str, tokens: tuple[int, ...]) -> Fetched | None:
        """Returns the block, promoted to memory, and the tier that served it; None when lost."""
        block = self.memory.get(key)
        if block is not None and block.tokens == tokens:
            return Fetched(block, MEMORY)
        started = time.perf_counter()
        stored, measured = self.host.pop(key), HOST
        served = SSD if key in self._prefetched else HOST
        self._prefetched.discard(key)
        if stored is not None:
            self.host.hits += 1
        if stored is None or stored.tokens != tokens:
            stored, measured = self._read_ssd(key, dir, tokens), SSD
            served = SSD
        if stored is None:
            return None
        decoding = time.perf_counter()
        try:
            block = from_bytes(stored)
        except (KeyError, ValueError, AttributeError) as e:
            log.warning("dropping an unreadable cached block %s: %s", key.hex()[:16], e)
            return None
        done = time.perf_counter()
        if stored.meta.get("bits", 16) != 16:
            self.rates[DEQUANTIZE].add(block.nbytes, done - decoding)
        self.rates[measured].add(block.nbytes, done - started)
        self.put_memory(block)
        return Fetched(block, served)

    def prefetch(self, keys: list[tuple[bytes, tuple[int, ...]]], *, dir: str) -> int:
        """Reads SSD-only blocks into the host tier (no MLX work), several files at once;
        returns how many."""
        todo = [(key, tokens) for key, tokens in keys if key not in self.memory and key not in self.host]
        if not todo:
            return 0
        started = time.perf_counter()
        read = self._readers.map(lambda kt: self._read_ssd(kt[0], dir, kt[1]), todo)
        count, nbytes = 0, 0
        for block in read:
            if block is None:
                break  # the chain is broken here: later blocks are useless
            self._put_host(block, prefetched=True)
            count, nbytes = count + 1, nbytes + computed_nbytes(block.meta)
        self.rates[SSD].add(nbytes, time.perf_counter() - started)
        return count

    def _read_ssd(self, key: bytes, dir: str, tokens: tuple[int, ...]) -> Block | None:
        return None if self.ssd is None else self.ssd.get(key, dir=dir, tokens=tokens)

    def restore_s(self, tier: str, nbytes: int) -> float:
        """Returns the expected seconds to restore `nbytes` of KV (as computed) from `tier`,
        from its measured rate; an SSD block at fewer bits is dequantized on top of that
        (a host block's measured rate includes it already)."""
        seconds = nbytes / self.rates[tier].bytes_per_s
        if tier == SSD and self.kv_bits[SSD] != 16:
            seconds += nbytes / self.rates[DEQUANTIZE].bytes_per_s
        return seconds

    # --- store -----------------------------------------------------------------------

    def save(self, blocks: list[KVBlock]) -> None:
        """Puts new blocks in memory and writes them through to the SSD behind the request."""
        written = to_bytes(self._fitting_writer(blocks), bits=self.kv_bits[SSD])  # one wait for all the copies
        for block in blocks:
            self.put_memory(block)
        for block in written:  # read out by the writer thread, not here
            self.writer.submit(block)

    def _fitting_writer(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """Returns the first of `blocks` that the SSD writer's queue has room for; the rest
        are counted as dropped without copying them (a copy costs the engine thread time:
        64 ms for a 25K-token 8B prompt on an H200). They reach the SSD if evicted later."""
        if self.writer is None:
            return []
        room, fitting = self.writer.room_bytes(), []
        for block in blocks:
            if block.nbytes > room:
                break
            fitting.append(block)
            room -= block.nbytes
        self.writer.count_dropped(len(blocks) - len(fitting))
        return fitting

    def put_memory(self, block: KVBlock) -> None:
        for _, evicted in self.memory.put(block.key, block, block.nbytes):
            self._demote(evicted)

    def _demote(self, block: KVBlock) -> None:
        stored = to_bytes([block], bits=self.kv_bits[HOST])[0]
        self._put_host(replace(stored, payload=memoryview(np.array(stored.payload))))  # copied to host RAM

    def _put_host(self, block: Block, *, prefetched: bool = False) -> None:
        if prefetched:
            self._prefetched.add(block.key)
        else:
            self._prefetched.discard(block.key)
        for _, evicted in self.host.put(block.key, block, block.payload_nbytes):
            self._spill(evicted)

    def _spill(self, block: Block) -> None:
        """Hands a block leaving RAM to the SSD unless it is there or on its way."""
        self._prefetched.discard(block.key)
        if self.ssd is None or self.writer is None:
            return
        # Pending first: the writer indexes a block before it stops counting it as pending,
        # so asked in this order, a block written in between is never missed.
        if self.writer.is_pending(block.key, dir=block.dir) or self.ssd.contains(block.key, dir=block.dir):
            return
        self.writer.submit(block)

    # --- management ------------------------------------------------------------------

    def set_kv_bits(self, *, host_kv_bits: int, ssd_kv_bits: int) -> None:
        """Sets the precision of blocks that go down a tier from now on (those stored stay
        as they are and still decode: their meta says their precision)."""
        self.kv_bits = {HOST: host_kv_bits, SSD: ssd_kv_bits}

    def resize(self, *, memory_bytes: int, host_bytes: int, ssd_bytes: int) -> None:
        """Applies new budgets; lower ones evict at once (memory demotes to host)."""
        # Host first, so that memory's evictions land under host's new budget.
        for _, evicted in self.host.resize(host_bytes):
            self._spill(evicted)
        for _, evicted in self.memory.resize(memory_bytes):
            self._demote(evicted)
        if self.ssd is not None:
            self.ssd.resize(ssd_bytes)

    def clear(self, dir: str | None = None) -> int:
        """Removes the blocks under `dir` (its subdirs too; all when None); returns how many."""
        def doomed(block: KVBlock | Block) -> bool:
            return dir is None or block.dir == dir or block.dir.startswith(dir + "/")

        if self.writer is not None:
            self.writer.flush(timeout_s=30)
        count = self.memory.remove_if(doomed)
        count += self.host.remove_if(doomed)
        if self.ssd is not None:
            count += self.ssd.clear(dir)
        return count

    def flush(self, timeout_s: float = 30) -> bool:
        """Waits until every queued SSD write is done; returns whether it finished in time."""
        return self.writer.flush(timeout_s) if self.writer is not None else True

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)
        if self.writer is not None:
            self.writer.close()
        if self.ssd is not None:
            self.ssd.close()

    def stats(self) -> dict:
        def rate(tier: str) -> float | None:
            value = self.rates[tier].value
            return None if value is None else round(value / 1e9, 3)

        ssd = self.ssd.stats() if self.ssd is not None else {"disabled": True, "disabled_reason": self.ssd_error}
        if self.writer is not None:
            ssd["writer"] = self.writer.stats()
        return {
            MEMORY: {**self.memory.stats(), "restore_gbps": rate(MEMORY)},
            HOST: {**self.host.stats(), "restore_gbps": rate(HOST), "kv_bits": self.kv_bits[HOST]},
            SSD: {**ssd, "restore_gbps": rate(SSD), "kv_bits": self.kv_bits[SSD],
                  "dequantize_gbps": rate(DEQUANTIZE)},
        }
