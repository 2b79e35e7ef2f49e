"""What one matmul costs the host on MLX, by the number of rows: a minimal reproduction.

A decode pass of a few rows on MLX CUDA is bound by the host (bench/decode_host.py):
fusing 96 of an 8B model's 224 matmuls a pass took 2 ms off MLX's submission of an 8-row
pass, ~21 µs a matmul, while one-row matmuls (MLX's own matrix-vector kernel) cost less.
This chains `--chain` matmuls of `rows` x `dim` by `dim` x `dim` (bfloat16 on a GPU) into
one graph and times, per matmul, the Python calls that build it (`build`), MLX's
`async_eval` that encodes and launches it (`submit`) and the whole until the result is
in (`total`), for each row count; the best of `--repeats`, after a first round that
compiles. `plain` is `x @ w`; `linear` is `x @ w.T` as mlx.nn.Linear computes it.

    python bench/matmul_host.py --out OUT.json                          # GPU
    .venv/bin/python bench/matmul_host.py --dim 256 --chain 16 --repeats 3  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx


def timed(x: mx.array, w: mx.array, chain: int, *, transposed: bool) -> dict:
    """Seconds per matmul to build, submit and finish `chain` matmuls in one graph."""
    mx.synchronize()
    started = time.perf_counter()
    y = x
    for _ in range(chain):
        y = y @ w.T if transposed else y @ w
    built = time.perf_counter()
    mx.async_eval(y)
    submitted = time.perf_counter()
    mx.eval(y)
    done = time.perf_counter()
    return {"build": (built - started) / chain, "submit": (submitted - built) / chain, "total": (done - started) / chain}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,8,32,64")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--chain", type=int, default=64, help="matmuls in one graph")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    w = (mx.random.normal((args.dim, args.dim)) / args.dim**0.5).astype(dtype)
    results: dict = {"device": str(mx.default_device()), "mlx": mx.__version__, "dim": args.dim,
                     "chain": args.chain, "dtype": str(dtype), "runs": []}
    for rows in map(int, args.rows.split(",")):
        x = mx.random.normal((rows, args.dim)).astype(dtype)
        mx.eval(x, w)
        for kind in ("plain", "linear"):
            timed(x, w, args.chain, transposed=kind == "linear")  # compiles what it needs
            runs = [timed(x, w, args.chain, transposed=kind == "linear") for _ in range(args.repeats)]
            best = {k: round(1e6 * min(r[k] for r in runs), 2) for k in ("build", "submit", "total")}
            results["runs"].append({"rows": rows, "kind": kind, **{f"{k}_us": v for k, v in best.items()}})
            print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
