"""SSD restore throughput: omlx's SSD tier reading real KV blocks cold, against `dd` on the same disk.

In one run, on the filesystem of `--dir` (default: the temp dir):

1. the disk, with dd: write a file (`oflag=direct`), drop the page cache, read it back with
   `iflag=direct`, drop again, read it through the page cache (readahead), all bs=16M;
2. omlx's SSD tier: one real KV block of the test model (256 tokens of real source code run
   through SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x 2 x 4 bytes = 45 KiB/token,
   11.8 MB a block) is stored under as many chained keys as fill the same number of bytes
   (`SsdTier.put`, fsync per block, as the writer does); then, after dropping the page cache
   each time, every block is read back with `SsdTier.get` (one read of the whole file, with
   O_DIRECT on Linux, then the header check and a crc32 over tokens and payload): on 1 thread, on 2 threads
   (reads and crc32 release the GIL), and on 1 thread followed by `kv.from_bytes` (the MLX
   arrays a restore builds). Finally the same 1-thread read right after a read (no drop: with
   O_DIRECT this is the disk again, or the host's cache on a VM; with buffered reads, the
   page cache).

The page cache is dropped with `/proc/sys/vm/drop_caches` when permitted, else with
POSIX_FADV_DONTNEED per file; residency is checked with fincore before each cold read.
Each measurement is repeated (3 times; once with --quick) and the median reported.

    .venv/bin/python bench/ssd_throughput.py [--quick] [--repeats N] [--dir /path/on/the/ssd]

Writes bench/out/ssd_throughput.json (ssd_throughput-quick.json with --quick) and prints a
markdown table. The big files are removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OUT_DIR,
    ForeignLoad,
    converted_model_dir,
    drop_page_cache,
    fmt,
    log,
    ratio,
    resident_bytes,
    run_header,
    site_packages,
    write_json,
)

from appliance.platform import ensure_process_env  # noqa: E402

BLOCK_TOKENS = 256
DD_BS = 16 * 2**20
TARGET = 0.70  # omlx SSD read throughput >= 70% of the disk's sequential read bandwidth
GROUP_TENANT = "default"


@dataclass(frozen=True)
class Plan:
    nbytes: int  # for the dd file and for the blocks each
    repeats: int


FULL = Plan(nbytes=2 * 2**30, repeats=3)
QUICK = Plan(nbytes=512 * 2**20, repeats=1)


@dataclass
class Measure:
    """One throughput, repeated: bytes per run and each run's seconds."""

    name: str
    nbytes: int
    kind: str  # "read" or "write"
    seconds: list[float] = field(default_factory=list)
    foreign_cpu: list[float] = field(default_factory=list)  # share of the CPU others used meanwhile
    resident_before: list[int | None] = field(default_factory=list)  # page-cached bytes before each cold run
    notes: str = ""

    @property
    def gbps(self) -> float | None:
        return self.nbytes / statistics.median(self.seconds) / 1e9 if self.seconds else None

    @property
    def gbps_runs(self) -> list[float]:
        return [self.nbytes / s / 1e9 for s in self.seconds]


# --- the disk, with dd ---------------------------------------------------------------------------

_DD_RE = re.compile(r"(\d+) bytes .* copied, ([\d.]+) s")


def dd(*args: str) -> tuple[int, float]:
    """Runs dd; returns (bytes copied, seconds) as dd reports them."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = _DD_RE.search(done.stderr)
    if m is None:
        raise RuntimeError(f"cannot parse dd output: {done.stderr!r}")
    return int(m[1]), float(m[2])


class Meter:
    """Others' share of the CPU over a span, not counting this process nor the children it waited for (dd)."""

    def __init__(self):
        self._load = ForeignLoad({os.getpgrp()}).start()
        self._started = time.monotonic()
        self._children = _children_cpu_s()

    def share(self) -> float:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        children = _children_cpu_s() - self._children
        return max(self._load.share() - children / (elapsed * (os.cpu_count() or 1)), 0.0)


def _children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def dd_measures(nbytes: int) -> list[Measure]:
    n = nbytes // DD_BS * DD_BS
    return [Measure("dd write, oflag=direct", n, "write"), Measure("dd read cold, iflag=direct", n, "read"),
            Measure("dd read cold, page cache + readahead", n, "read")]


def measure_dd_once(path: Path, measures: list[Measure]) -> str:
    """Writes `path` with dd, then reads it cold twice (direct, buffered); returns the page-cache drop method."""
    write, direct, buffered = measures
    path.unlink(missing_ok=True)
    meter = Meter()
    _, s = dd("if=/dev/zero", f"of={path}", f"bs={DD_BS}", f"count={write.nbytes // DD_BS}", "oflag=direct",
              "conv=fsync")
    write.seconds.append(s)
    write.foreign_cpu.append(meter.share())
    method = ""
    for m, flags in ((direct, ["iflag=direct"]), (buffered, [])):
        method = drop_page_cache([path])
        m.resident_before.append(resident_bytes([path]))
        meter = Meter()
        _, s = dd(f"if={path}", "of=/dev/null", f"bs={DD_BS}", *flags)
        m.seconds.append(s)
        m.foreign_cpu.append(meter.share())
    path.unlink(missing_ok=True)
    log(f"   dd: write {write.gbps_runs[-1]:.2f} GB/s, read direct {direct.gbps_runs[-1]:.2f} GB/s, "
        f"buffered {buffered.gbps_runs[-1]:.2f} GB/s")
    return method


# --- omlx's SSD tier -----------------------------------------------------------------------------


def real_block(model_dir: Path):
    """Returns (KVBlock of 256 real tokens, its KVLayout, the key space) computed by the test model."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from appliance.cache.keys import key_space
    from appliance.cache.kv import cut_blocks, probe_layout

    model, tokenizer = load(str(model_dir))  # the converted float32 checkpoint: float32 KV, as omlx on CPU
    layout = probe_layout(model)
    text = (site_packages() / "mlx_lm/models/cache.py").read_text()
    tokens = tokenizer.encode(text)[:BLOCK_TOKENS]
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    weights = hashlib.sha256(b"bench/ssd_throughput").hexdigest()
    space = key_space(weights=weights, compute_dtype="float32", layout=layout, block_tokens=BLOCK_TOKENS)
    (block,) = cut_blocks(cache, tokens, space, skip_tokens=0, is_known=lambda _: False)
    return block, layout, space


@dataclass(frozen=True)
class Stored:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


def fill_tier(tier, block, space, num_blocks: int) -> tuple[list[Stored], Measure]:
    """Stores the block's payload under `num_blocks` chained keys; returns them and the write throughput."""
    from appliance.cache.kv import to_bytes

    as_bytes = to_bytes([block])[0]
    stored, parent = [], space.root
    started = time.perf_counter()
    for i in range(num_blocks):
        key = space.block_key(parent, block.tokens + (i,))  # distinct chained keys, as a long prompt has
        if not tier.put(replace(as_bytes, key=key, parent=parent)):
            raise RuntimeError(f"SsdTier.put refused block {i}: {tier.stats()}")
        stored.append(Stored(key, parent, block.tokens))
        parent = key
    elapsed = time.perf_counter() - started
    write = Measure("SsdTier.put (fsync per block), 1 thread", 0, "write", [elapsed])
    return stored, write


def read_all(tier, stored: list[Stored], dir: str, *, threads: int, to_mlx: bool) -> int:
    """Reads (and verifies) every block, optionally building its MLX arrays; returns the bytes read."""
    from appliance.cache.kv import from_bytes

    def one(s: Stored) -> int:
        block = tier.get(s.key, dir=dir, tokens=s.tokens)
        if block is None:
            raise RuntimeError(f"block {s.key.hex()[:16]} missing or unverifiable: {tier.stats()['misses']}")
        if to_mlx:
            from_bytes(block)
        return block.payload_nbytes

    if threads == 1:
        return sum(one(s) for s in stored)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, stored))


VARIANTS = (  # name, threads, build MLX arrays, cold
    ("SsdTier.get cold, 1 thread", 1, False, True),
    ("SsdTier.get cold, 2 threads", 2, False, True),
    ("SsdTier.get + kv.from_bytes (MLX arrays) cold, 1 thread", 1, True, True),
    ("SsdTier.get again, no drop (O_DIRECT: disk again; buffered: page cache), 1 thread", 1, False, False),
)


def measure_tier_once(tier, stored: list[Stored], dir: str, files: list[Path], measures: dict[str, Measure],
                      read_gbps: dict[str, list[float]], payload_bytes: int) -> str:
    """Reads every block once per variant; returns the page-cache drop method."""
    method = ""
    for name, threads, to_mlx, cold in VARIANTS:
        m = measures[name]
        if cold:
            method = drop_page_cache(files)
        else:
            read_all(tier, stored, dir, threads=1, to_mlx=False)  # fills the page cache, if used
        m.resident_before.append(resident_bytes(files))
        before = tier.stats()
        meter = Meter()
        started = time.perf_counter()
        payload = read_all(tier, stored, dir, threads=threads, to_mlx=to_mlx)
        m.seconds.append(time.perf_counter() - started)
        m.foreign_cpu.append(meter.share())
        after = tier.stats()
        read_s = after["read_s"] - before["read_s"]  # summed over threads
        read_gbps[name].append((after["read_bytes"] - before["read_bytes"]) / read_s / 1e9 if read_s else 0.0)
        if payload != payload_bytes:
            raise RuntimeError(f"{name}: read {payload} payload bytes, expected {payload_bytes}")
        log(f"   {name}: {m.gbps_runs[-1]:.2f} GB/s (resident before: {m.resident_before[-1]} bytes)")
    return method


def measure(work: Path, model_dir: Path, plan: Plan) -> tuple[list[Measure], list[Measure], dict, list[str]]:
    """Returns dd's measures, the tier's, block facts and the drop methods; dd and the tier alternate per repeat."""
    from appliance.cache.ssd import SsdTier

    log("computing one real KV block with the test model")
    block, layout, space = real_block(model_dir)
    num_blocks = max(1, plan.nbytes // block.nbytes)
    info = {"layout": layout.__dict__, "bytes_per_token": layout.bytes_per_token, "block_tokens": BLOCK_TOKENS,
            "block_payload_bytes": block.nbytes, "num_blocks": num_blocks}
    disk = dd_measures(plan.nbytes)
    measures = {name: Measure(name, 0, "read") for name, *_ in VARIANTS}
    read_gbps: dict[str, list[float]] = {name: [] for name, *_ in VARIANTS}
    methods = set()
    root = work / "kv"
    with SsdTier(root, budget_bytes=4 * plan.nbytes + 2**30) as tier:
        log(f"storing {num_blocks} blocks of {block.nbytes / 1e6:.1f} MB under {root}")
        stored, write = fill_tier(tier, block, space, num_blocks)
        files = sorted(root.rglob("*.kv"))
        info["file_bytes"] = write.nbytes = sum(f.stat().st_size for f in files)
        for m in measures.values():
            m.nbytes = info["file_bytes"]
        for i in range(plan.repeats):
            log(f"repeat {i + 1} of {plan.repeats}")
            methods.add(measure_dd_once(work / "dd.bin", disk))
            methods.add(measure_tier_once(tier, stored, space.dir, files, measures, read_gbps,
                                          num_blocks * block.nbytes))
    for name, values in read_gbps.items():
        measures[name].notes = f"tier read_gbps (file reads only, per thread): {statistics.median(values):.2f}"
    info["tier_read_gbps"] = read_gbps
    return disk, [write, *measures.values()], info, sorted(methods)


# --- report --------------------------------------------------------------------------------------


def table(dd_measures: list[Measure], tier_measures: list[Measure], disk_gbps: float | None,
          dd_write_gbps: float | None) -> str:
    rows = ["| what | GB/s (median) | runs (GB/s) | bytes | vs the disk (dd: faster cold read / direct write) "
            "| others' CPU | notes |",
            "|---|---:|---|---:|---:|---:|---|"]
    for m in [*dd_measures, *tier_measures]:
        share = ratio(m.gbps, disk_gbps if m.kind == "read" else dd_write_gbps)
        others = ", ".join(f"{100 * v:.0f}%" for v in m.foreign_cpu)
        runs = ", ".join(f"{v:.2f}" for v in m.gbps_runs)
        rows.append(f"| {m.name} | {fmt(m.gbps)} | {runs} | {m.nbytes / 2**20:.0f} MiB | {fmt(_pct(share), '.0f')}% "
                    f"| {others} | {m.notes} |")
    return "\n".join(rows)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 MiB instead of 2 GiB, one repeat")
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: temp)")
    parser.add_argument("--repeats", type=int, default=None, help="override the number of repeats (3; 1 with --quick)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    # MLX must find OpenBLAS at load time (the model runs 256 tokens once); glibc's malloc
    # is left as it is, as this benchmark always measured.
    ensure_process_env(malloc=False)
    plan = QUICK if args.quick else FULL
    if args.repeats:
        plan = Plan(nbytes=plan.nbytes, repeats=args.repeats)
    out = args.out or OUT_DIR / ("ssd_throughput-quick.json" if args.quick else "ssd_throughput.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: remove the big files
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="omlx-ssd-throughput-", dir=args.dir))
    try:
        device = subprocess.run(["df", "--output=source,fstype,target", str(work)], capture_output=True,
                                text=True).stdout.strip().splitlines()[-1]
        log(f"measuring {work} ({device}); {plan.nbytes / 2**20:.0f} MiB, {plan.repeats} repeat(s)")
        disk_measures, tier_measures, info, methods = measure(work, converted_model_dir(), plan)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {m.name: m for m in [*disk_measures, *tier_measures]}
    dd_direct, dd_buffered = by["dd read cold, iflag=direct"].gbps, by["dd read cold, page cache + readahead"].gbps
    disk = max(v for v in (dd_direct, dd_buffered) if v is not None)
    one, two = by["SsdTier.get cold, 1 thread"].gbps, by["SsdTier.get cold, 2 threads"].gbps
    best = max(v for v in (one, two) if v is not None)
    summary = {
        "disk_seq_read_gbps": disk, "dd_direct_gbps": dd_direct, "dd_buffered_gbps": dd_buffered,
        "omlx_1_thread_gbps": one, "omlx_2_threads_gbps": two,
        "omlx_best_over_disk": ratio(best, disk), "omlx_1_thread_over_disk": ratio(one, disk),
        "omlx_2_threads_over_disk": ratio(two, disk),
        "omlx_best_over_dd_direct": ratio(best, dd_direct),
        "meets_target": ratio(best, disk) is not None and ratio(best, disk) >= TARGET,
        "page_cache_drop": methods,
    }
    record = {
        **run_header(__file__, argv, started=started),
        "device": device,
        "plan": plan,
        "summary": summary,
        "blocks": info,
        "measures": [{**m.__dict__, "gbps": m.gbps, "gbps_runs": m.gbps_runs} for m in [*disk_measures, *tier_measures]],
    }
    path = write_json(out, record)
    print(f"## SSD restore throughput vs the disk ({device}), {plan.nbytes / 2**30:.2f} GiB, "
          f"median of {plan.repeats}\n")
    print(table(disk_measures, tier_measures, disk, by["dd write, oflag=direct"].gbps))
    print(f"\nomlx SSD tier, best of 1 and 2 threads: {fmt(best)} GB/s = {fmt(100 * summary['omlx_best_over_disk'], '.0f')}% "
          f"of the disk's sequential read ({fmt(disk)} GB/s, the faster dd read); target ≥ {TARGET:.0%}: "
          f"{'met' if summary['meets_target'] else 'missed'}. Blocks: {info['num_blocks']} x "
          f"{info['block_payload_bytes'] / 1e6:.1f} MB ({BLOCK_TOKENS} tokens x {info['bytes_per_token'] / 1024:.0f} KiB). "
          f"Page cache dropped with {', '.join(summary['page_cache_drop'])} before every cold read.\nResults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
