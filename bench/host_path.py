"""The paths KV takes between host memory and the running batch, each in GB/s of KV as
computed, for one prompt's worth of blocks (`--tokens` tokens of `--shape`, random values):

- device copy: one device-to-device copy of the same bytes (the floor any restore is
  measured against);
- generic demote: a memory-tier block to host bytes (kv.to_bytes, then numpy), what the
  host tier does without native kernels;
- generic restore: host bytes to the batch cache (kv.from_bytes, kv.build_batch_cache);
- native demote / restore (CUDA only): kernels/kv_move.py through pinned host memory,
  at 16, 8 and 4 bits, each checked against the KV as computed;
- block files read from the disk (page cache dropped: POSIX_FADV_DONTNEED) with O_DIRECT
  into pinned and fresh memory on 1, 4 and 16 threads, and from the page cache.

Each path runs `--repeats` times; the first run compiles kernels; the table gives the best.

    python bench/host_path.py --shape 8b --tokens 25417 [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_model import SHAPES, random_blocks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=25417)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np

    from appliance.cache.kv import KVBlock, build_batch_cache, from_bytes, to_bytes
    from appliance.kernels.registry import backend

    layers = SHAPES[args.shape][0]
    b = args.block_tokens
    blocks = random_blocks(args.shape, args.tokens, b)
    kv_bytes = sum(blk.nbytes for blk in blocks)
    results: dict = {"shape": args.shape, "tokens": args.tokens, "block_tokens": b, "kv_gb": round(kv_bytes / 1e9, 3),
                     "backend": backend(), "paths": {}}
    print(f"{len(blocks)} blocks, {kv_bytes / 1e9:.2f} GB of KV, backend {backend()}", flush=True)

    def timed(name: str, fn, nbytes: int = kv_bytes) -> None:
        runs = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - started)
        best = min(runs)
        results["paths"][name] = {"s": [round(r, 4) for r in runs], "gbps": round(nbytes / best / 1e9, 2)}
        print(f"{name:40s} best {best * 1000:9.1f} ms  {nbytes / best / 1e9:7.2f} GB/s  "
              f"(runs {', '.join(f'{r * 1000:.0f}' for r in runs)} ms)", flush=True)

    flat = {"all": mx.concatenate([blk.keys.reshape(-1) for blk in blocks] + [blk.values.reshape(-1) for blk in blocks])}
    mx.eval(flat["all"])
    timed("device copy", lambda: mx.eval(flat["all"] + 0))
    flat.clear()

    host = {}

    def generic_demote():
        stored = to_bytes(blocks)
        host["blocks"] = [np.array(s.payload) for s in stored]
        host["stored"] = stored

    timed("generic demote (to_bytes + numpy)", generic_demote)

    def generic_restore():
        from dataclasses import replace
        restored = [from_bytes(replace(s, payload=memoryview(p))) for s, p in zip(host["stored"], host["blocks"])]
        host["cache"] = build_batch_cache(restored, args.tokens)

    timed("generic restore (from_bytes + build)", generic_restore)
    reference = [(c.keys, c.values) for c in host.pop("cache")]
    host.clear()

    if backend() == "cuda":
        from appliance.kernels import kv_move
        from appliance.kernels.pinned import PinnedPool

        pool = PinnedPool(keep_free_bytes=64 << 30)
        for bits in (16, 8, 4):
            # What the store does: the memory tier's blocks to pinned memory (quantized on
            # the device first), then each back to device arrays, then the batch cache.
            moved: dict = {}

            def demote(bits=bits, moved=moved):
                moved["views"] = kv_move.pack_to_host([(blk.keys, blk.values) for blk in blocks], bits, pool.take)

            timed(f"native demote {bits}-bit (pack + to_host)", demote)

            def restore(moved=moved):
                back = [kv_move.to_block(PinnedPool.address_of(view), meta) for view, meta in moved["views"]]
                rebuilt = [KVBlock(blk.key, blk.parent, blk.dir, blk.tokens, k, v) for blk, (k, v) in zip(blocks, back)]
                moved["cache"] = build_batch_cache(rebuilt, args.tokens)

            timed(f"native restore {bits}-bit (to_block + build)", restore)
            name = f"native restore {bits}-bit (to_block + build)"
            errors = []
            for layer in (0, layers - 1):
                c = moved["cache"][layer]
                ref_k, ref_v = reference[layer]
                err = max(mx.max(mx.abs(c.keys[..., :args.tokens, :].astype(mx.float32)
                                        - ref_k[..., :args.tokens, :].astype(mx.float32))).item(),
                          mx.max(mx.abs(c.values[..., :args.tokens, :].astype(mx.float32)
                                        - ref_v[..., :args.tokens, :].astype(mx.float32))).item())
                errors.append(err)
            results["paths"][name]["max_abs_error_vs_computed"] = max(errors)
            print(f"  {bits}-bit: max abs error against the KV as computed {max(errors)}", flush=True)
            moved.clear()

    from concurrent.futures import ThreadPoolExecutor

    from appliance.cache.block import read_file
    from appliance.kernels.pinned import PinnedPool

    # Files: page cache and disk into fresh and pinned memory, as the SSD tier reads them.
    payload = np.random.default_rng(0).integers(0, 255, size=blocks[0].nbytes, dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=os.environ.get("OMLX_BENCH_DIR")) as tmp:
        files = []
        for i in range(len(blocks)):
            path = Path(tmp) / f"{i}.kv"
            with open(path, "wb") as f:
                f.write(payload.tobytes())
                f.flush()
                os.fsync(f.fileno())
            files.append(path)
        nbytes = len(files) * payload.nbytes
        pool = PinnedPool(keep_free_bytes=64 << 30) if backend() == "cuda" else None
        pinned = (lambda n: pool.take(n)[0]) if pool else None  # noqa: E731
        where = "pinned" if pool else "fresh memory"

        def drop() -> None:
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        def read_all(threads: int, buffer, *, cold: bool):
            def run():
                if cold:
                    drop()
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(lambda p: read_file(p, buffer), files))
            return run

        for threads in (1, 4, 16):
            timed(f"disk -> {where}, O_DIRECT ({threads} threads)", read_all(threads, pinned, cold=True), nbytes)
        if pool:
            timed("disk -> fresh memory, O_DIRECT (4 threads)", read_all(4, None, cold=True), nbytes)
        for path in files:  # into the page cache (O_DIRECT reads still bypass it)
            path.read_bytes()
        timed(f"page cache -> {where}, buffered (4 threads)",
              lambda: list(ThreadPoolExecutor(4).map(lambda p: open(p, "rb", buffering=0).readinto(
                  pinned(payload.nbytes) if pinned else bytearray(payload.nbytes)), files)), nbytes)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
