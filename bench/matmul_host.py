"""What one matmul costs the host on MLX, by the number of rows: a minimal reproduction,
and ours beside it.

A decode pass of a few rows on MLX CUDA is bound by the host (bench/decode_host.py):
fusing 96 of an 8B model's 224 matmuls a pass took 2 ms off MLX's submission of an 8-row
pass, ~21 µs a matmul, while one-row matmuls (MLX's own matrix-vector kernel) cost less.
This builds `--ops` matmuls `x @ w.T` (x of `rows` rows, w of N x K, as mlx.nn.Linear
computes it; bfloat16 on a GPU) into one graph, cycling over `--weights` weights so that
none stays in the GPU's L2, and times, per matmul, the Python calls that build it
(`build`), MLX's `async_eval` that encodes and launches it (`submit`) and the whole until
the results are in (`total`: the GPU's time where it is longer than the host's); the best
of `--repeats`, after a first round that compiles. `mlx` is MLX's matmul (cuBLASLt beyond
one row); `native` is ours (kernels/small_matmul.py; `native4`, `native8`: with 4 or 8
warps a block), on a GPU only, with the largest
difference between the two results (`max_err`, relative to the largest value).

    python bench/matmul_host.py --out OUT.json                              # GPU
    .venv/bin/python bench/matmul_host.py --shapes 256x256 --ops 16 --repeats 3  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance.kernels import small_matmul  # noqa: E402


def timed(x: mx.array, weights: list[mx.array], ops: int, kind: str) -> dict:
    """Seconds per matmul to build, submit and finish `ops` matmuls in one graph."""
    mx.synchronize()
    started = time.perf_counter()
    if kind.startswith("native"):
        warps = int(kind.removeprefix("native") or small_matmul.WARPS)
        outs = [small_matmul.matmul(x, weights[i % len(weights)], warps=warps) for i in range(ops)]
    else:
        outs = [x @ weights[i % len(weights)].T for i in range(ops)]
    built = time.perf_counter()
    mx.async_eval(outs)
    submitted = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return {"build": (built - started) / ops, "submit": (submitted - built) / ops, "total": (done - started) / ops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default="4096x4096,6144x4096,28672x4096,4096x14336",
                        help="weights' N x K (an 8B model's o, qkv, gate_up and down projections)")
    parser.add_argument("--ops", type=int, default=64, help="matmuls in one graph")
    parser.add_argument("--weights", type=int, default=8, help="distinct weights the matmuls cycle over")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kinds", default="mlx,native", help="mlx, native (its own warps), native4, native8")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gpu = mx.default_device() == mx.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    kinds = args.kinds.split(",") if gpu else ["mlx"]
    results: dict = {"device": str(mx.default_device()), "mlx": mx.__version__, "ops": args.ops,
                     "dtype": str(dtype), "runs": []}
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weights = [(mx.random.normal((n, k)) / k**0.5).astype(dtype) for _ in range(args.weights)]
        mx.eval(weights)
        for rows in map(int, args.rows.split(",")):
            x = mx.random.normal((rows, k)).astype(dtype)
            mx.eval(x)
            for kind in kinds:
                timed(x, weights, args.ops, kind)  # compiles what it needs
                runs = [timed(x, weights, args.ops, kind) for _ in range(args.repeats)]
                best = {f"{key}_us": round(1e6 * min(r[key] for r in runs), 2) for key in ("build", "submit", "total")}
                row = {"n": n, "k": k, "rows": rows, "kind": kind, **best,
                       "weight_gbps": round(n * k * dtype.size / best["total_us"] / 1e3, 1)}
                if kind.startswith("native"):
                    want = (x @ weights[0].T).astype(mx.float32)
                    got = small_matmul.matmul(x, weights[0]).astype(mx.float32)
                    row["max_err"] = (mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))).item()
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
        del weights
        mx.clear_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
