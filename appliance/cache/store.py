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

On CUDA, where device and host memory are separate, the native kernels (`use_native`,
kernels/kv_move.py) keep host blocks in pinned memory and move them over the host link
directly: a demote copies a block there, the SSD tier reads files there, and a restore
reads it from there, each at tens of GB/s instead of MLX's 2-2.5 GB/s host paths.

MLX work (building arrays) happens on the calling engine thread; `prefetch` only reads
files into the host tier, so it is safe on an I/O thread. A restore that wants a block a
prefetch is still reading takes that read over (`_claim`): the blocks read first move
to the device while the rest are read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import orjson

from appliance.cache.block import Block, write_atomic
from appliance.cache.kv import KVBlock, from_bytes, to_bytes
from appliance.cache.lru import LruTier
from appliance.cache.ssd import SsdTier
from appliance.cache.writer import SsdWriter
from appliance.kernels import kv_move
from appliance.kernels.cuda_driver import CudaError
from appliance.kernels.gate import GATE
from appliance.kernels.kv_quant import computed_nbytes, pack, payload_nbytes, stored_fraction
from appliance.kernels.pinned import PinnedPool
from appliance.moving_average import moving_average

log = logging.getLogger("omlx.cache")

MEMORY, HOST, SSD = "memory", "host", "ssd"
DEQUANTIZE = "dequantize"  # not a tier: the rate of turning 8- or 4-bit blocks back into KV
# Not a tier either: with the native kernels on, the rate of moving up a block that lies in
# pageable memory (MLX's own path): SSD reads right after a start, before idle engines
# have pinned slots for them. HOST then measures the native moves only.
GENERIC = "generic"
# Until measured, assume restores run at these speeds (bytes of KV as computed per second):
# conservative for SSDs.
DEFAULT_RATES = {MEMORY: 20e9, HOST: 5e9, SSD: 1e9, DEQUANTIZE: 5e9, GENERIC: 2.5e9}
# A restore from host by the native kernel, until measured: 30-67 GB/s on an H100 at 16-4
# bits (BENCHMARKS.md, "Host paths"). At DEFAULT_RATES' 5 GB/s, with the dequantizing on
# top, a 25K-token SSD restore at 4 bits was priced 1.3 s above its read.
NATIVE_HOST_RATE = 20e9
WRITER_PENDING_BYTES = 1 << 30
RATES_FILE = "rates.json"  # under the SSD root, beside index.sqlite
# On CUDA (the native kernels' backend) the writer's queue holds device memory, not the
# host's: room for a long prompt's blocks, so a 32K-token prompt of an 8B model (4.3 GB)
# reaches the SSD whole.
NATIVE_WRITER_PENDING_BYTES = 8 << 30
PINNED_AHEAD_BYTES = 8 << 30  # pinned slots made ahead of need by idle engines (and kept when freed)
# Pinned as soon as a model's block sizes are known, on a thread of its own, without
# waiting for an idle engine: the first SSD restore after a restart reads into them. (On
# an H100, a request sent at readiness found no slot: its 25K-token prompt's 873 MiB of
# 4-bit blocks would have moved up by the generic path, and the estimate chose recomputing.)
START_PINNED_BYTES = 2 << 30
PREFETCH_READERS = 4
RESTORE_WAVE_BYTES = 1 << 30  # a restore's copies to the device are waited for in waves this large
SSD_PROBE_BYTES = 512 << 20


@dataclass(frozen=True)
class _Lifted:
    """A block taken from the host tier or read from the SSD, on its way to the device."""

    stored: Block
    measured: str  # the tier whose rate its restore time counts to
    served: str  # the tier a hit is reported for
    read_s: float  # spent taking or reading it


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
        # Measured prefill speed per model dir (the engines keep it here): with the tiers'
        # rates, what restore-or-recompute decides by. Both are kept across restarts
        # (RATES_FILE), so the first request after a start decides from measurements too.
        self.prefill_tok_s: dict[str, float] = {}
        self.ssd: SsdTier | None = None
        self.writer: SsdWriter | None = None
        self.ssd_error: str | None = None
        self._native_down = self._native_up = False  # use_native
        self._pool: PinnedPool | None = None
        self._block_nbytes: set[int] = set()  # expect_blocks: the sizes to pin slots for ahead
        self._layouts: set[tuple[str, int, int]] = set()  # expect_layout: (dtype, k_dim, v_dim)
        self._warming: threading.Thread | None = None  # the last `_warm` compile
        self._pinning_failed = False
        self._pin_lock = threading.Lock()  # pin_one: the start's pinning thread and idle engines
        self._start_pinning: threading.Thread | None = None
        self._closed = False
        self._probing = False  # probe_ssd started
        self._lock = threading.Lock()  # guards _reading, and a read block's hand-over to host
        self._reading: dict[bytes, Future] = {}  # prefetch reads under way, by key (`_claim`)
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
        self._load_rates()

    def probe_ssd(self) -> None:
        """Measures the SSD tier's read rate on a thread, once, unless a previous run's is
        kept (RATES_FILE): from the blocks a previous run left, so that the first
        restore-or-recompute decision after a start weighs the disk as it is, not a guess
        (a decision for recompute would otherwise never read the disk to learn it). The
        runtime calls it once a model has loaded: beside a load from the same disk, a probe
        on an H100 machine read 0.71 GB/s of a disk that reads 1.7."""
        with self._lock:
            if self.ssd is None or self._probing or self.rates[SSD].value is not None:
                return
            self._probing = True
        threading.Thread(target=self._probe_ssd, name="kv-ssd-probe", daemon=True).start()

    def _probe_ssd(self) -> None:
        probed = self.ssd.probe_read(SSD_PROBE_BYTES, threads=PREFETCH_READERS)
        if probed is not None and self.rates[SSD].value is None:
            file_bytes, seconds = probed
            # The rate is kept in bytes of KV as computed: a file at 8 bits holds ~twice its size.
            self.rates[SSD].add(int(file_bytes / stored_fraction(self.kv_bits[SSD])), seconds)
            log.info("SSD tier reads %.2f GB/s (%d MiB probed)", file_bytes / seconds / 1e9, file_bytes >> 20)

    def _load_rates(self) -> None:
        try:
            saved = orjson.loads((self.ssd.root / RATES_FILE).read_bytes())
            for tier, value in saved.get("restore_bytes_per_s", {}).items():
                if tier in self.rates and isinstance(value, (int, float)) and value > 0:
                    self.rates[tier].value = float(value)
            self.prefill_tok_s.update({d: float(v) for d, v in saved.get("prefill_tok_s", {}).items()
                                       if isinstance(v, (int, float)) and v > 0})
        except (OSError, ValueError, AttributeError, TypeError):  # none yet, or unreadable: measure anew
            pass

    def _save_rates(self) -> None:
        rates = {tier: r.value for tier, r in self.rates.items() if r.value}
        data = orjson.dumps({"restore_bytes_per_s": rates, "prefill_tok_s": self.prefill_tok_s})
        try:
            write_atomic(self.ssd.root / RATES_FILE, data, b"")
        except OSError as e:
            log.warning("could not keep the measured rates: %s", e)

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
        for tier, name in ((self.host, HOST), (self.memory, MEMORY)):
            for b in tier.values():
                if b.parent == parent and b.dir == dir:
                    found[b.key] = (b.tokens, name)
        if self.ssd is not None:  # a file's header is read only for blocks no faster tier holds
            for key, tokens in self.ssd.children(parent, dir=dir, skip=found.keys()):
                found[key] = (tokens, SSD)
        return found

    def fetch_all(self, wanted: list[tuple[bytes, tuple[int, ...]]], *, dir: str) -> list[Fetched]:
        """Returns the blocks of `wanted` (key, tokens), a prompt's chain in order, promoted
        to memory, each with the tier that served it; up to the first one lost or unreadable.

        Those in memory are marked used first, so promoting the rest never evicts them.
        The rest come up in waves (RESTORE_WAVE_BYTES): one wait for each wave's copies,
        and only after it are the wave's blocks put in memory, so the blocks they push down
        reuse the pinned slots the wave has just freed instead of the generic path.
        """
        for key, _ in wanted:
            self.memory.touch(key)
        fetched: list[Fetched] = []
        wave: list[_Lifted] = []
        for key, tokens in wanted:
            block = self.memory.get(key)
            if block is not None and block.tokens == tokens:
                if wave and not self._promote(wave, fetched):
                    return fetched
                fetched.append(Fetched(block, MEMORY))
                continue
            if not self._lift(key, dir, tokens, wave):
                break
            if sum(computed_nbytes(w.stored.meta) for w in wave) >= RESTORE_WAVE_BYTES:
                if not self._promote(wave, fetched):
                    return fetched
        if wave:
            self._promote(wave, fetched)
        return fetched

    def _lift(self, key: bytes, dir: str, tokens: tuple[int, ...], wave: list[_Lifted]) -> bool:
        """Takes a block out of the host tier, else reads it from the SSD, into `wave`;
        returns False when it is lost. (Only `wave` holds it, so emptying the wave frees
        its pinned slot.)"""
        started = time.perf_counter()
        claimed = self._claim(key)
        if claimed is not None and claimed.tokens == tokens:  # its read counts to the prefetch's SSD rate
            wave.append(_Lifted(claimed, HOST, SSD, 0.0))
            return True
        stored, measured = self.host.pop(key), HOST
        served = SSD if key in self._prefetched else HOST
        self._prefetched.discard(key)
        if stored is not None:
            self.host.hits += 1
        if stored is None or stored.tokens != tokens:
            stored, measured = self._read_ssd(key, dir, tokens), SSD
            served = SSD
        if stored is None:
            return False
        wave.append(_Lifted(stored, measured, served, time.perf_counter() - started))
        return True

    def _promote(self, wave: list[_Lifted], fetched: list[Fetched]) -> bool:
        """Moves `wave`'s blocks to the device (one wait), appends them to `fetched` and puts
        them in memory; empties `wave`. Returns False when a block was unreadable (it and
        the rest of the wave are dropped)."""
        started = time.perf_counter()
        blocks = self._to_device_all(wave)
        mx.eval([(b.keys, b.values) for b in blocks])
        self._count_restore(wave, blocks, time.perf_counter() - started)
        fetched.extend(Fetched(block, lifted.served) for lifted, block in zip(wave, blocks))
        complete = len(blocks) == len(wave)
        wave.clear()  # the payloads' last references: their pinned slots free for what memory pushes down
        self.put_memory(*blocks)
        return complete

    def _to_device_all(self, wave: list[_Lifted]) -> list[KVBlock]:
        """Returns the wave's blocks as MLX arrays, not yet evaluated, up to the first
        unreadable one."""
        blocks: list[KVBlock] = []
        for lifted in wave:
            try:
                blocks.append(self._to_device(lifted.stored))
            except (KeyError, ValueError, AttributeError) as e:
                log.warning("dropping an unreadable cached block %s: %s", lifted.stored.key.hex()[:16], e)
                break
        return blocks

    def _count_restore(self, wave: list[_Lifted], blocks: list[KVBlock], moved_s: float) -> None:
        """Adds a wave's restore to the rates: an SSD block's read counts to the SSD's rate,
        every block's move up (its share of `moved_s`) to the host tier's (GENERIC's for a
        block in pageable memory while the native kernels are on), since an SSD restore
        costs both (`restore_s`); quantized blocks' moves to the dequantize rate."""
        total = sum(b.nbytes for b in blocks) or 1
        by_tier: dict[str, list[float]] = {}
        quantized = [0, 0.0]
        for lifted, block in zip(wave, blocks):
            share = moved_s * block.nbytes / total
            generic = self._native_up and not PinnedPool.owns(lifted.stored.payload)
            moved = by_tier.setdefault(GENERIC if generic else HOST, [0, 0.0])
            moved[0] += block.nbytes
            moved[1] += share + (lifted.read_s if lifted.measured == HOST else 0.0)
            if lifted.measured == SSD:
                read = by_tier.setdefault(SSD, [0, 0.0])
                read[0] += block.nbytes
                read[1] += lifted.read_s
            if lifted.stored.meta.get("bits", 16) != 16:
                quantized[0] += block.nbytes
                quantized[1] += share
        for tier, (nbytes, seconds) in by_tier.items():
            self.rates[tier].add(nbytes, seconds)
        self.rates[DEQUANTIZE].add(*quantized)

    def prefetch(self, keys: list[tuple[bytes, tuple[int, ...]]], *, dir: str,
                 started: Callable[[], None] | None = None) -> int:
        """Reads SSD-only blocks into the host tier (no MLX work), several files at once, in
        order up to the first one missing; returns how many. `started` is called once the
        reads are under way: from then on a restore takes over the reads it needs (`_claim`)."""
        todo = [(key, tokens) for key, tokens in keys if key not in self.memory and key not in self.host]
        if not todo:
            return 0
        began = time.perf_counter()
        with self._lock:
            reads = [(key, self._readers.submit(self._read_ssd, key, dir, tokens))
                     for key, tokens in todo if key not in self._reading]
            self._reading.update(reads)
        if started is not None:
            started()
        count, nbytes, broken = 0, 0, False
        reads.reverse()
        while reads:  # popped as handled: a read a restore has taken over keeps no pinned slot here
            key, read = reads.pop()
            if broken:
                read.cancel()  # the chain is broken: later blocks are useless
            block = self._result(read)
            with self._lock:  # a block is handed to host or to a restore (_claim), never both
                mine = self._reading.pop(key, None) is not None
                if mine and block is not None and not broken:
                    self._put_host(block, prefetched=True)
            broken = broken or block is None
            if not broken:
                count, nbytes = count + 1, nbytes + computed_nbytes(block.meta)
        self.rates[SSD].add(nbytes, time.perf_counter() - began)
        return count

    def _claim(self, key: bytes) -> Block | None:
        """Takes over a prefetch's read of `key`, if one is under way or done and not yet in
        host: waits for it and returns the block (None when it was not read)."""
        with self._lock:
            read = self._reading.pop(key, None)
        return None if read is None else self._result(read)

    @staticmethod
    def _result(read: Future) -> Block | None:
        try:
            return read.result()
        except CancelledError:
            return None
        except Exception as e:  # an unreadable file is a lost block, not a failed restore
            log.warning("reading a cached block failed: %s", e)
            return None

    def _read_ssd(self, key: bytes, dir: str, tokens: tuple[int, ...]) -> Block | None:
        if self.ssd is None:
            return None
        buffer = self._pinned if self._native_up else None  # read where the kernel reads it from
        return self.ssd.get(key, dir=dir, tokens=tokens, buffer=buffer)

    def _pinned(self, nbytes: int) -> memoryview | None:
        """A pinned slot for a block's payload when one is free, else None: the payload is
        read into fresh (aligned) memory, and the generic path restores it."""
        taken = self._pool.take(nbytes, allocate=False)
        return taken[0] if taken is not None else None

    def _to_device(self, stored: Block) -> KVBlock:
        """Returns a bytes block as MLX arrays, not yet evaluated (the payload must live
        until they are): read by the native kernel where it lies in pinned memory, else by
        the generic path."""
        payload = stored.payload
        if not (self._native_up and PinnedPool.owns(payload) and kv_move.unsupported(stored.meta) is None):
            return from_bytes(stored, wait=False)
        if payload.nbytes != payload_nbytes(stored.meta):
            raise ValueError(f"payload holds {payload.nbytes} bytes, its meta says {payload_nbytes(stored.meta)}")
        keys, values = kv_move.to_block(PinnedPool.address_of(payload), stored.meta, wait=False)
        if keys.shape[2] != len(stored.tokens) or values.shape[2] != len(stored.tokens):
            raise ValueError("payload shape does not match the block's tokens")
        return KVBlock(stored.key, stored.parent, stored.dir, stored.tokens, keys, values)

    def _to_host(self, blocks: list[KVBlock], bits: int) -> list[Block]:
        """Returns `blocks` as bytes at `bits` bits in host memory: copied by the native
        kernel into free pinned slots (one wait for all), the rest by the generic path (the
        host reads what MLX made, through numpy)."""
        slots: dict[int, tuple[mx.array, dict, memoryview]] = {}
        if self._native_down:
            for i, block in enumerate(blocks):
                payload, meta = pack(block.keys, block.values, bits)
                taken = self._pool.take(payload.size, allocate=False)
                if taken is None:
                    break
                slots[i] = (payload, meta, taken)
            kv_move.to_host([(payload, taken[1]) for payload, _, taken in slots.values()])
        rest = iter(to_bytes([b for i, b in enumerate(blocks) if i not in slots], bits=bits))
        out = []
        for i, block in enumerate(blocks):
            if i in slots:
                _, meta, taken = slots[i]
                out.append(Block(block.key, block.parent, block.dir, block.tokens, meta, taken[0]))
            else:
                stored = next(rest)
                out.append(replace(stored, payload=memoryview(np.array(stored.payload))))
        return out

    def restore_s(self, tier: str, nbytes: int) -> float:
        """Returns the expected seconds to restore `nbytes` of KV (as computed) from `tier`,
        from the measured rates: an SSD block is read into host memory and then moved up
        from there as a host block is, or, on a GPU without a free pinned slot for it, by
        the generic path (`_pinned_share`: right after a start that path cost an 8B model's
        SSD hits their gain), and one at fewer bits is dequantized on top of that (a host
        block's measured rate includes it already)."""
        seconds = nbytes / self.rates[tier].bytes_per_s
        if tier == SSD:
            native = self._pinned_share(nbytes)
            seconds += nbytes * (native / self.rates[HOST].bytes_per_s + (1 - native) / self.rates[GENERIC].bytes_per_s)
            if self.kv_bits[SSD] != 16:  # the native kernel dequantizes as it moves: HOST's rate counts it
                dequantized = 1 - native if self._native_up else 1.0
                seconds += dequantized * nbytes / self.rates[DEQUANTIZE].bytes_per_s
        return seconds

    def _pinned_share(self, nbytes: int) -> float:
        """Returns the share of `nbytes` of KV (as computed), read from the SSD now, that
        free pinned slots would take, and so the native path move up; the rest moves by
        the generic path (GENERIC). 1 where the native kernels are off: HOST then measures
        the only path there is."""
        if not self._native_up or self._pool is None:
            return 1.0
        stored = nbytes * stored_fraction(self.kv_bits[SSD])
        return min(1.0, self._pool.free_bytes / stored) if stored else 1.0

    # --- store -----------------------------------------------------------------------

    def save(self, blocks: list[KVBlock]) -> None:
        """Puts new blocks in memory and writes them through to the SSD behind the request."""
        # Device copies, one wait for all; the writer thread reads them out. (Pinned slots
        # stay for the host tier: copying there costs this thread the host link's time.)
        # Submitted before they go in: a block that memory evicts on the way to host memory
        # and host memory to the SSD is then pending there, not written a second time.
        for block in to_bytes(self._fitting_writer(blocks), bits=self.kv_bits[SSD]):
            self.writer.submit(block)  # read out by the writer thread, not here
        for block in blocks:
            self.put_memory(block)

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

    def put_memory(self, *blocks: KVBlock) -> None:
        """Puts blocks in memory; those it evicts go down to host memory together."""
        evicted = [old for block in blocks for _, old in self.memory.put(block.key, block, block.nbytes)]
        if evicted:
            self._demote(evicted)

    def _demote(self, blocks: list[KVBlock]) -> None:
        for stored in self._to_host(blocks, self.kv_bits[HOST]):
            self._put_host(stored)

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

    def use_native(self, *, quantize: bool, dequantize: bool) -> None:
        """Selects the native kernels (kernels/registry.py) for blocks going down to host
        memory (`quantize`: demotes, into pinned slots) and coming up from it (`dequantize`:
        restores from pinned slots, into which the SSD tier then reads). Only free slots are
        used (idle engines pin them: `pin_one`); without one a block takes the generic path.
        Blocks already stored keep working either way. The SSD writer's queue may then
        hold a long prompt's blocks whole: on CUDA they wait in device memory, which is
        separate from the host's."""
        if (quantize or dequantize) and self._pool is None:
            self._pool = PinnedPool(keep_free_bytes=PINNED_AHEAD_BYTES, limit_bytes=self.host.budget_bytes)
        self._native_down, self._native_up = quantize, dequantize
        self.rates[HOST].default = NATIVE_HOST_RATE if dequantize else DEFAULT_RATES[HOST]
        if self.writer is not None:
            self.writer.max_pending_bytes = NATIVE_WRITER_PENDING_BYTES if quantize else WRITER_PENDING_BYTES
        self._warm()
        self._pin_start()

    def expect_layout(self, *, dtype: str, k_dim: int, v_dim: int) -> None:
        """Says a model's KV has this dtype and these head dimensions: with the native
        kernels, they are compiled for it ahead of its first restore (`_warm`). A layout
        already expected compiles nothing again (a stand-in says it before its model)."""
        with self._lock:
            if (dtype, k_dim, v_dim) in self._layouts:
                return
            self._layouts.add((dtype, k_dim, v_dim))
        self._warm()

    def _warm(self) -> None:
        """Compiles the native kernels for every expected layout at every precision in use,
        on a thread and stream of their own (MLX compiles a CUDA kernel per template instance
        on its first call: ~2.2 s of a model's first restore on an H200 otherwise)."""
        if not (self._native_down or self._native_up) or not self._layouts:
            return
        # The tiers' precisions only: each costs ~1-2 s of compiling beside the engine's
        # warm-up, which readiness waits for (a block stored at another precision before a
        # change of [cache] compiles on its first restore).
        bits = tuple(sorted(set(self.kv_bits.values()), reverse=True))
        layouts = sorted(self._layouts)

        def run() -> None:
            with mx.stream(mx.new_stream(mx.gpu)):
                for dtype, k_dim, v_dim in layouts:
                    with GATE.alone():  # between the engines' steps (kernels/gate.py; compiling holds no gate)
                        failure = kv_move.warm(dtype=dtype, k_dim=k_dim, v_dim=v_dim, bits=bits)
                    if failure is not None:
                        log.warning("native KV kernels for %s KV (head dims %d, %d) failed: %s",
                                    dtype, k_dim, v_dim, failure)

        self._warming = threading.Thread(target=run, name="kv-kernel-warm", daemon=True)
        self._warming.start()

    def wait_warm(self, timeout_s: float) -> bool:
        """Waits for the native kernels' compile (`_warm`) to end; returns whether it did.
        A first request that arrives while it runs waits for its compiles too (MLX's JIT
        and the GPU are shared): a restore right after a restart on an H200 took 2-3 s
        more than the same restore later."""
        warming = self._warming
        if warming is None:
            return True
        warming.join(timeout_s)
        return not warming.is_alive()

    def expect_blocks(self, *nbytes: int) -> None:
        """Says a model's full blocks take `nbytes` of payload at the tiers' precisions: with
        the native kernels, pinned slots for them are made ahead, the first
        START_PINNED_BYTES at once on a thread (`_pin_start`), the rest by idle engines
        (`pin_one`)."""
        self._block_nbytes.update(nbytes)
        self._pin_start()

    def _pin_start(self) -> None:
        """Pins slots up to START_PINNED_BYTES on a thread of its own, once (when the native
        kernels are on and block sizes known); the runtime's readiness waits for it
        (`wait_start_pinning`)."""
        with self._pin_lock:
            if self._start_pinning is not None or not self.wants_pinned():
                return
            self._start_pinning = threading.Thread(target=self._pin_until_start_bytes, name="kv-pin-start",
                                                   daemon=True)
        self._start_pinning.start()

    def wait_start_pinning(self, timeout_s: float) -> bool:
        """Waits for the start's pinning (`_pin_start`) to end; returns whether it did. Beside
        a first request it slows the request's SSD reads: on an H100 a restore right after
        readiness ran while 2 GiB were pinned, reading 0.69 GB/s of a disk that reads 2.29."""
        pinning = self._start_pinning
        if pinning is None:
            return True
        pinning.join(timeout_s)
        return not pinning.is_alive()

    def _pin_until_start_bytes(self) -> None:
        started = time.perf_counter()
        while not self._closed and self._pool.total_bytes < START_PINNED_BYTES and self.wants_pinned():
            self.pin_one()
        log.info("pinned %.0f MiB of host memory for the KV cache in %.2f s", self._pool.total_bytes / 2**20,
                 time.perf_counter() - started)

    def wants_pinned(self) -> bool:
        """Returns whether more pinned slots should be made ahead of need."""
        return (self._pool is not None and self._native_down and not self._pinning_failed
                and any(self._pool.wants(n) for n in self._block_nbytes))

    def pin_one(self) -> None:
        """Pins one slot ahead of need (~50 ms for a 64 MiB block). Engines call it only when
        idle: pinning holds up the GPU's other work while it runs."""
        if self._pool is None:
            return
        try:  # the size with the fewest free bytes first: with 8- or 4-bit tiers, blocks come in two sizes
            with self._pin_lock:
                for nbytes in sorted(self._block_nbytes, key=self._pool.free_bytes_of):
                    if self._pool.reserve_one(nbytes):
                        return
        except CudaError as e:  # out of pinned memory: the slots made so far serve
            self._pinning_failed = True
            log.warning("pinning host memory for the KV cache stopped: %s", e)

    def set_kv_bits(self, *, host_kv_bits: int, ssd_kv_bits: int) -> None:
        """Sets the precision of blocks that go down a tier from now on (those stored stay
        as they are and still decode: their meta says their precision)."""
        self.kv_bits = {HOST: host_kv_bits, SSD: ssd_kv_bits}
        self._warm()

    @property
    def keeps_blocks(self) -> bool:
        """Returns whether any tier has room for a block (every budget 0: saves are moot)."""
        ssd = self.ssd is not None and self.ssd.budget_bytes > 0  # None: not opened (ssd_error)
        return self.memory.budget_bytes > 0 or self.host.budget_bytes > 0 or ssd

    def resize(self, *, memory_bytes: int, host_bytes: int, ssd_bytes: int) -> None:
        """Applies new budgets; lower ones evict at once (memory demotes to host)."""
        # Host first, so that memory's evictions land under host's new budget.
        for _, evicted in self.host.resize(host_bytes):
            self._spill(evicted)
        evicted = [block for _, block in self.memory.resize(memory_bytes)]
        if evicted:
            self._demote(evicted)
        if self.ssd is not None:
            self.ssd.resize(ssd_bytes)
        if self._pool is not None:
            self._pool.limit_bytes = host_bytes

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
        self._closed = True
        self._readers.shutdown(wait=False, cancel_futures=True)
        if self.writer is not None:
            self.writer.close()
        if self.ssd is not None:
            if not self.ssd.stats().get("disabled"):
                self._save_rates()
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
            HOST: {**self.host.stats(), "restore_gbps": rate(HOST), "kv_bits": self.kv_bits[HOST],
                   "pinned_bytes": self._pool.total_bytes if self._pool else 0,
                   "pinned_free_bytes": self._pool.free_bytes if self._pool else 0},
            SSD: {**ssd, "restore_gbps": rate(SSD), "kv_bits": self.kv_bits[SSD],
                  "dequantize_gbps": rate(DEQUANTIZE), "generic_gbps": rate(GENERIC)},
        }
