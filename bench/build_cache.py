"""What building a restored prefix's batch cache costs (cache/kv.build_batch_cache), by how
it gathers the blocks' layers: each layer one concatenation of every block's slice (what
runs off CUDA), or runs of layers gathered from every block at once, then copied out (what
runs on CUDA, default 1 GiB a run), for one prompt's worth of memory-tier blocks
(`--tokens` tokens of `--shape`, random values). A device copy of the same bytes is the floor.

The ways run in turn, `--repeats` times (the first compiles kernels); each built cache is
checked against the per-layer one.

    python bench/build_cache.py --shape 8b --tokens 31232 [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_model import SHAPES, random_blocks  # noqa: E402

WAYS = {"per layer": 0, "runs of 256 MiB": 256 << 20, "runs of 1 GiB": 1 << 30, "one run": 1 << 50}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=31232)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import mlx.core as mx

    from appliance.cache.kv import build_batch_cache
    from appliance.kernels.registry import backend

    blocks = random_blocks(args.shape, args.tokens, args.block_tokens)
    layers = SHAPES[args.shape][0]
    kv_bytes = sum(blk.nbytes for blk in blocks)
    print(f"{len(blocks)} blocks of {layers} layers, {kv_bytes / 1e9:.2f} GB of KV, backend {backend()}", flush=True)

    runs: dict[str, list[float]] = {"device copy": [], **{way: [] for way in WAYS}}
    reference = None
    mismatched: set[str] = set(WAYS) - {"per layer"}  # until checked
    for _ in range(args.repeats):
        started = time.perf_counter()
        mx.eval([blk.keys + 0 for blk in blocks] + [blk.values + 0 for blk in blocks])  # one array > 2**31 fails
        runs["device copy"].append(time.perf_counter() - started)
        for way, gather_bytes in WAYS.items():
            started = time.perf_counter()
            built = build_batch_cache(blocks, args.tokens, gather_bytes=gather_bytes)
            runs[way].append(time.perf_counter() - started)
            if reference is None:  # the per-layer cache, kept to check the others against
                reference = built
            elif len(runs[way]) == 1:  # checked once, off the clock
                same = all(mx.array_equal(c.keys, r.keys).item() and mx.array_equal(c.values, r.values).item()
                           for c, r in zip(built, reference, strict=True))
                if same:
                    mismatched.discard(way)
            del built
            mx.clear_cache()

    results = {"shape": args.shape, "tokens": args.tokens, "blocks": len(blocks), "kv_gb": round(kv_bytes / 1e9, 3),
               "backend": backend(), "ways": {}}
    for way, times in runs.items():
        median = statistics.median(times[1:] or times)
        results["ways"][way] = {"s": [round(t, 4) for t in times], "median_later_s": round(median, 4),
                                "same_cache": way not in mismatched}
        print(f"{way:18s} median of later runs {median * 1000:8.1f} ms  {'' if way not in mismatched else 'OTHER CACHE '}"
              f"(runs {', '.join(f'{t * 1000:.1f}' for t in times)} ms)", flush=True)
    base = results["ways"]["per layer"]["median_later_s"]
    for way in WAYS:
        results["ways"][way]["per_layer_over_this"] = round(base / results["ways"][way]["median_later_s"], 2)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
