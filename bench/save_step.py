"""What saving a finished prompt's KV blocks costs the engine thread, and why.

Builds a batch-of-one KV cache of `--tokens` tokens in the shape of `--shape` (random
values; no model needed), then times, in milliseconds, the two device copies the store
makes when a prompt's blocks are saved (`cut_blocks`: every block's keys and values;
`to_payload`: the SSD writer's bytes, first `--payload-gib`), each:

- fresh: after `mx.clear_cache()`, so every buffer is newly allocated;
- recycled: right after the previous copies were freed (MLX's buffer cache hands their
  buffers out again);
- as the allocation alone (`mx.zeros` of the same block shapes), fresh and recycled;
- async: the graph handed to `mx.async_eval` (what the calling thread waits), and then
  how long a small kernel queued behind it waits;
- a prompt's KV buffers (what `engine/prefill.py` reserves) of a length seen before
  (MLX's buffer cache reuses a buffer only of nearly the same size) and of a new one;
- decode-like steps (matrix-vector products on the engine thread) alone and while another
  thread reads payloads through the buffer protocol, as the SSD writer does (MLX moves a
  device buffer to managed memory when the host reads it).

    python bench/save_step.py --shape 8b --tokens 25417 [--block-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_model import SHAPES  # noqa: E402


def ms(fn) -> float:
    started = time.perf_counter()
    fn()
    return round((time.perf_counter() - started) * 1000, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=25417)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--payload-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache


    def cut_blocks(cache, full: int) -> list:
        """The store's block copies (appliance/cache/kv.py `cut_blocks`, written out so the
        bench outlives that module's refactors): each block's keys and values, all layers."""
        blocks = [(mx.stack([c.keys[0, :, s:s + args.block_tokens, :] for c in cache]),
                   mx.stack([c.values[0, :, s:s + args.block_tokens, :] for c in cache]))
                  for s in range(0, full, args.block_tokens)]
        mx.eval(blocks)
        return blocks

    def to_payload(block) -> mx.array:
        """The SSD writer's bytes of one block: keys then values, one uint8 array."""
        keys, values = block
        return mx.concatenate([keys.view(mx.uint8).reshape(-1), values.view(mx.uint8).reshape(-1)])

    if mx.default_device() == mx.gpu:  # managed memory: never ask for more than the card has
        mx.set_memory_limit(100 << 30)
    layers, hidden, heads, kv_heads, _ = SHAPES[args.shape]
    dim = hidden // heads
    room = -(-args.tokens // 256) * 256
    cache = []
    for _ in range(layers):
        c = KVCache()
        c.keys = mx.random.normal((1, kv_heads, room, dim)).astype(mx.bfloat16)
        c.values = mx.random.normal((1, kv_heads, room, dim)).astype(mx.bfloat16)
        c.offset = args.tokens
        cache.append(c)
    mx.eval([(c.keys, c.values) for c in cache])
    full = args.tokens // args.block_tokens * args.block_tokens
    block_bytes = 2 * layers * kv_heads * args.block_tokens * dim * 2
    num_payloads = max(1, int(args.payload_gib * 2**30 // block_bytes))
    results: dict = {"shape": args.shape, "tokens": args.tokens, "blocks": full // args.block_tokens,
                     "block_mb": round(block_bytes / 1e6, 1), "payloads": num_payloads,
                     "device": str(mx.default_device())}
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for _ in range(args.repeats):
        shape = (layers, kv_heads, args.block_tokens, dim)
        n = full // args.block_tokens

        def zeros(count: int):
            arrays = [mx.zeros(shape, dtype=mx.bfloat16) + 1 for _ in range(2 * count)]
            mx.eval(arrays)
            return arrays

        mx.clear_cache()
        add("alloc_fresh_ms", ms(lambda: zeros(n)))  # freed at once: back to the buffer cache
        add("alloc_recycled_ms", ms(lambda: zeros(n)))
        mx.clear_cache()
        held: dict = {}
        add("cut_fresh_ms", ms(lambda: held.update(blocks=cut_blocks(cache, full))))
        add("payload_fresh_ms", ms(lambda: held.update(
            payloads=mx.eval([to_payload(b) for b in held["blocks"][:num_payloads]]))))
        held.clear()
        add("cut_recycled_ms", ms(lambda: held.update(blocks=cut_blocks(cache, full))))
        add("payload_recycled_ms", ms(lambda: mx.eval([to_payload(b) for b in held["blocks"][:num_payloads]])))
        held.clear()
        for label, clear in (("fresh", True), ("recycled", False)):
            if clear:
                mx.clear_cache()
            lazy = [mx.stack([c.keys[0, :, s:s + args.block_tokens, :] for c in cache])
                    for s in range(0, full, args.block_tokens)]
            lazy += [mx.stack([c.values[0, :, s:s + args.block_tokens, :] for c in cache])
                     for s in range(0, full, args.block_tokens)]
            started = time.perf_counter()
            mx.async_eval(lazy)
            add(f"async_call_{label}_ms", round((time.perf_counter() - started) * 1000, 2))
            probe = mx.ones((8,)) * 2
            mx.eval(probe)
            add(f"async_until_free_{label}_ms", round((time.perf_counter() - started) * 1000, 2))
            del lazy
    kv_tokens = (room // 256 + 1) * 256

    def kv_buffers(num_tokens: int):
        arrays = [mx.zeros((1, kv_heads, num_tokens, dim), dtype=mx.bfloat16) for _ in range(2 * layers)]
        mx.eval(arrays)
        return arrays

    for _ in range(args.repeats):
        mx.clear_cache()
        add("kv_new_length_fresh_ms", ms(lambda: kv_buffers(kv_tokens)))
        add("kv_same_length_ms", ms(lambda: kv_buffers(kv_tokens)))
        add("kv_other_length_ms", ms(lambda: kv_buffers(kv_tokens * 4 // 5 // 256 * 256)))

    import numpy as np

    w = mx.random.normal((hidden, 4 * hidden)).astype(mx.bfloat16)
    x = mx.random.normal((1, hidden)).astype(mx.bfloat16)

    def steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            y = x
            for _ in range(layers):
                y = (y @ w)[:, :hidden] * 0.01
            mx.eval(y)
            times.append((time.perf_counter() - started) * 1000)
        return times

    steps(20)
    alone = steps(100)
    blocks = cut_blocks(cache, full)
    payloads = [to_payload(b) for b in blocks[:num_payloads]]
    mx.eval(payloads)
    read = {}

    def reader():
        started = time.perf_counter()
        read["sum"] = sum(int(np.frombuffer(memoryview(p), dtype=np.uint8)[::4096].sum()) for p in payloads)
        read["s"] = time.perf_counter() - started

    thread = threading.Thread(target=reader)
    thread.start()
    during = steps(100)
    thread.join()
    results["decode_like_step_ms"] = {
        "alone": {"median": round(statistics.median(alone), 3), "max": round(max(alone), 3)},
        "with_reader": {"median": round(statistics.median(during), 3), "max": round(max(during), 3)},
        "reader_gb_s": round(num_payloads * block_bytes / read["s"] / 1e9, 2)}
    results["ms"] = {name: {"median": statistics.median(v), "all": v} for name, v in rows.items()}
    print(json.dumps(results, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
