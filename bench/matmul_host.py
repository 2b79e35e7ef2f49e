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
one row); `native` is ours (kernels/small_matmul.py), on a GPU only, with the largest
difference between the two results (`max_err`, relative to the largest value);
`native:W:C:B` is ours by other choices: W warps a block, C chunks of K a warp loads at
once, B column tiles a block (each may be left out or empty: the module's own; `kernel`
says the choices taken). A choice the kernel refuses for a row count or weight (its partial
sums past 48 KiB of shared memory, N not in blocks of B tiles) is a row with `refused`.

    python bench/matmul_host.py --out OUT.json                              # GPU
    python bench/matmul_host.py --rows 8,16 --kinds mlx,native,native:8:8,native:8:4:2  # GPU, choices
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

CHOICE = ("warps", "chunks", "cols")  # the fields of a kind `native:W:C:B`


def native_choice(kind: str) -> dict[str, int | None] | None:
    """Returns small_matmul's choices for kind `native[:W[:C[:B]]]` ({warps, chunks, cols}, a
    field left out or empty None: the module's own), None for `mlx`; ValueError where it is
    neither."""
    name, *fields = kind.split(":")
    if name == "mlx" and not fields:
        return None
    if name != "native" or len(fields) > len(CHOICE) or not all(f.isdecimal() and int(f) > 0 for f in fields if f):
        raise ValueError(f"kind {kind!r} is not mlx or native[:WARPS[:CHUNKS[:COLS]]] of positive integers")
    values = [int(f) if f else None for f in fields]
    return dict(zip(CHOICE, values + [None] * (len(CHOICE) - len(values)), strict=True))


def kinds_of(text: str) -> list[str]:
    """Returns the comma-separated kinds of `text`, each checked by `native_choice`."""
    kinds = text.split(",")
    try:
        for kind in kinds:
            native_choice(kind)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return kinds


def timed(x: mx.array, weights: list[mx.array], ops: int, kind: str) -> dict:
    """Seconds per matmul to build, submit and finish `ops` matmuls in one graph."""
    mx.synchronize()
    started = time.perf_counter()
    if (choice := native_choice(kind)) is not None:
        outs = [small_matmul.matmul(x, weights[i % len(weights)], **choice) for i in range(ops)]
    else:
        outs = [x @ weights[i % len(weights)].T for i in range(ops)]
    built = time.perf_counter()
    mx.async_eval(outs)
    submitted = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return {"build": (built - started) / ops, "submit": (submitted - built) / ops, "total": (done - started) / ops}


def kernel_of(rows: int, n: int, choice: dict[str, int | None]) -> str:
    """Returns the choices `W:C:B` small_matmul takes for `rows` rows of an N = `n` weight,
    asked for `choice` (its None fields filled as `small_matmul.matmul` fills them)."""
    count = small_matmul.tiles(rows)
    warps = choice["warps"] or small_matmul.WARPS
    chunks = choice["chunks"] or small_matmul.default_chunks(count)
    return f"{warps}:{chunks}:{choice['cols'] or small_matmul.default_cols(n)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default="4096x4096,6144x4096,28672x4096,4096x14336",
                        help="weights' N x K (an 8B model's o, qkv, gate_up and down projections)")
    parser.add_argument("--ops", type=int, default=64, help="matmuls in one graph")
    parser.add_argument("--weights", type=int, default=8, help="distinct weights the matmuls cycle over")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kinds", type=kinds_of, default="mlx,native",
                        help="mlx, native (its own choices), native:W:C:B (warps, chunks, column tiles; each optional)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gpu = mx.default_device() == mx.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    kinds = args.kinds if gpu else ["mlx"]
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
                row = {"n": n, "k": k, "rows": rows, "kind": kind}
                choice = native_choice(kind)
                if choice is not None:
                    row["kernel"] = kernel_of(rows, n, choice)
                try:
                    timed(x, weights, args.ops, kind)  # compiles what it needs
                except ValueError as e:  # a choice the kernel refuses here
                    results["runs"].append({**row, "refused": str(e)})
                    print(json.dumps(results["runs"][-1]), flush=True)
                    continue
                runs = [timed(x, weights, args.ops, kind) for _ in range(args.repeats)]
                best = {f"{key}_us": round(1e6 * min(r[key] for r in runs), 2) for key in ("build", "submit", "total")}
                row.update(best, weight_gbps=round(n * k * dtype.size / best["total_us"] / 1e3, 1))
                if choice is not None:
                    want = (x @ weights[0].T).astype(mx.float32)
                    got = small_matmul.matmul(x, weights[0], **choice).astype(mx.float32)
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
