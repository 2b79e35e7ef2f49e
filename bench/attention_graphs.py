"""What MLX's fused attention costs the first time it meets a shape, per shape it keys on.

MLX CUDA runs prefill attention (and decode attention over a cache buffer of a multiple
of 256 tokens) through cuDNN graphs that it builds once per key: the shapes *and
strides* of queries, keys and values, and the mask's (MLX 0.32's
`backend/cuda/scaled_dot_product_attention.cpp`). Keys and values are slices of a KV
buffer, so the buffer's allocated length is part of the key too, not only the
context's. This times, in milliseconds, one attention call in the shape of `--shape`
(one layer; random values; no model needed):

- prefill, one 2,048-token chunk: a new key; the same call again; keys of a new
  context in the same buffer; the same context in a buffer of a new length;
- a chat's prefill (30 tokens in a 256-token buffer);
- a batched prefill of short prompts (an array mask, as mlx-lm's batch path passes):
  a new (rows x length), the same again;
- decode (one query per row) over a buffer of a new length, then of the same length
  at another context.

With `--threads N` the same calls run on N threads, one after the other, each new,
after a first matmul and a first attention of 16 tokens that count too: which of the
first calls' costs a process pays once (its libraries, cuDNN's compiled kernels) and
which each thread pays (MLX keeps cuDNN and cuBLAS handles and graphs per thread). A
thread that warms up before the model's code is imported helps the engine's thread only
as far as the second thread's costs are smaller than the first's.

On a CPU every call is plain MLX attention (no graphs); `--dry-run` divides every length
by 32 so that it finishes, and shows only that it runs.

    python bench/attention_graphs.py --shape 8b [--threads 2] [--out OUT.json]
    .venv/bin/python bench/attention_graphs.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.gpu_model import SHAPES  # noqa: E402

CHUNK = 2048


def attend(rows: int, queries: int, context: int, buffer: int, *, heads: int, kv_heads: int, dim: int,
           mask: str | None = "causal") -> float:
    """Returns the milliseconds of one attention call whose keys and values are the first
    `context` tokens of buffers `buffer` tokens long."""
    q = mx.random.normal((rows, heads, queries, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, buffer, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows, kv_heads, buffer, dim)).astype(mx.bfloat16)
    m = mask
    if mask == "array":  # left-padded rows, as a batched prefill's mask
        m = mx.tril(mx.ones((queries, context), dtype=mx.bool_), k=context - queries)[None, None]
        m = mx.broadcast_to(m, (rows, 1, queries, context))
    mx.eval(q, k, v, *([m] if mask == "array" else []))
    mx.synchronize()
    started = time.perf_counter()
    out = mx.fast.scaled_dot_product_attention(q, k[:, :, :context], v[:, :, :context], scale=dim ** -0.5, mask=m)
    mx.eval(out)
    mx.synchronize()
    return round(1000 * (time.perf_counter() - started), 2)


def multiply(rows: int, hidden: int) -> float:
    """Returns the milliseconds of one (rows x hidden) @ (hidden x hidden) matmul in bfloat16."""
    x = mx.zeros((rows, hidden), dtype=mx.bfloat16)
    w = mx.zeros((hidden, hidden), dtype=mx.bfloat16)
    mx.eval(x, w)
    mx.synchronize()
    started = time.perf_counter()
    mx.eval(x @ w.T)
    mx.synchronize()
    return round(1000 * (time.perf_counter() - started), 2)


CASES = [  # (label, rows, queries, context, buffer, mask)
    ("prefill chunk: new key", 1, CHUNK, 4 * CHUNK, 25_600, "causal"),
    ("prefill chunk: same key again", 1, CHUNK, 4 * CHUNK, 25_600, "causal"),
    ("prefill chunk: new context, same buffer", 1, CHUNK, 5 * CHUNK, 25_600, "causal"),
    ("prefill chunk: same context, new buffer", 1, CHUNK, 4 * CHUNK, 26_624, "causal"),
    ("prefill chunk: same context, new buffer again", 1, CHUNK, 4 * CHUNK, 26_624, "causal"),
    ("prefill 30 tokens, buffer 256 (a chat)", 1, 30, 30, 256, "causal"),
    ("batched prefill 8 x 128: new key", 8, 128, 128, 256, "array"),
    ("batched prefill 8 x 128: again", 8, 128, 128, 256, "array"),
    ("batched prefill 4 x 128: new rows", 4, 128, 128, 256, "array"),
    ("batched prefill 8 x 96: new length", 8, 96, 96, 256, "array"),
    ("decode 1 row: new buffer", 1, 1, 25_000, 25_600, None),
    ("decode 1 row: same buffer, next context", 1, 1, 25_001, 25_600, None),
    ("decode 1 row: new buffer", 1, 1, 25_000, 26_624, None),
    ("decode 8 rows: new rows", 8, 1, 1000, 1024, None),
    ("decode 8 rows: again", 8, 1, 1001, 1024, None),
]


def run_cases(div: int, dims: dict, *, label: str = "") -> list[dict]:
    """Runs CASES in order (every length divided by `div`); returns each one's record."""
    results = []
    for case, rows, queries, context, buffer, mask in CASES:
        queries, context, buffer = max(1, queries // div), max(1, context // div), max(1, buffer // div)
        took = attend(rows, queries, context, buffer, mask=mask, **dims)
        results.append({"case": case, "rows": rows, "queries": queries, "context": context, "buffer": buffer,
                        "mask": mask, "ms": took})
        print(f"{label}{case:48s} {took:9.2f} ms", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=0, help="the calls on this many new threads in turn")
    parser.add_argument("--dry-run", action="store_true", help="every length / 32 (a CPU check)")
    args = parser.parse_args()
    div = 32 if args.dry_run else 1
    _, hidden, heads, kv_heads, _ = SHAPES[args.shape]
    dims = {"heads": heads, "kv_heads": kv_heads, "dim": hidden // heads}
    if not args.threads:
        attend(1, 16, 16, 16, **dims)  # the process's first kernels, whatever their shapes
        results = run_cases(div, dims)
    else:
        results = []

        def on_thread(n: int) -> None:  # the thread's first matmul and attention, then CASES
            results.append({"thread": n, "case": "first matmul 2048 x hidden", "ms": multiply(2048 // div, hidden)})
            results.append({"thread": n, "case": "first attention 16 tokens", "ms": attend(1, 16, 16, 16, **dims)})
            results.extend({"thread": n, **r} for r in run_cases(div, dims, label=f"thread {n}: "))

        for n in range(args.threads):  # each on a new thread, one after the other
            thread = threading.Thread(target=on_thread, args=(n,))
            thread.start()
            thread.join()
        for r in (r for r in results if r["case"].startswith("first")):
            print(f"thread {r['thread']}: {r['case']:40s} {r['ms']:9.2f} ms", flush=True)
    kernel_dir = os.environ.get("MLX_PTX_CACHE_DIR")  # what MLX compiled in the process, where it was empty
    record = {"shape": args.shape, "device": str(mx.default_device()), "mlx": mx.__version__, "results": results,
              "compiled": sorted(os.listdir(kernel_dir)) if kernel_dir and os.path.isdir(kernel_dir) else None}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
