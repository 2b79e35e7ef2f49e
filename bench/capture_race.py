"""Which work on a second thread breaks MLX CUDA's graph capture on the first.

MLX CUDA records its cuBLAS matmuls into CUDA graphs by stream capture (thread-local
mode). An H100 server once died at start, right after the native kernels' self-test had
finished beside the engine's warm-up: `terminate called ... cudaStreamEndCapture ...
operation failed due to a previous error during capture`. A synchronizing CUDA call
invalidates a capture in progress (from another thread of the same device too, by one
test: docs/GPU.md); MLX then throws from a destructor and the process aborts. This runs
an engine-like thread (8-row bf16 matmuls of the 8B shape, MLX's own, each pass
evaluated) for `--seconds`, beside one `--beside` job on another thread, each job in a
process of its own so that an abort ends only it:

  none      nothing beside (the control)
  pin       page-locked host slots made (64 MiB each, kept): what `kv-pin-start` does
  pinfree   a slot made and freed, over and over
  kvwarm    the native KV kernels' check on a stream of their own: what `kv-kernel-warm` does
  selftest  the kernels' self-test on a stream of its own: what `kernel-self-test` does
  readback  an array evaluated on a stream of its own and read by numpy
  h2d       a 64 MiB numpy array made an `mx.array` and evaluated on a stream of its own
  meminfo   the device's free memory asked of the driver (the memory check's question)

A job named with `+gate` (`pin+gate`) runs each engine pass holding
appliance/kernels/gate.py's gate shared and each side round holding it alone, as the
server does.

Prints one JSON line per job: its exit code, the engine thread's passes, the side job's
rounds, and the last line of its stderr. On an H100 (2026-12-07) no job aborted, and
pinning left the engine thread 5 passes in 6.6 s against 3,890 (docs/GPU.md).

    python bench/capture_race.py --beside none,pin,pinfree,kvwarm,selftest,readback   # GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

JOBS = ("none", "pin", "pinfree", "kvwarm", "selftest", "readback", "h2d", "meminfo")


def side_job(name: str):
    """Returns one round of `name`'s work (a callable) for the side thread, None for `none`."""
    import mlx.core as mx

    from appliance.kernels import kv_move, pinned, small_matmul

    kept = []
    if name == "pin":
        return lambda: kept.append(pinned.PinnedBuffer(64 << 20))
    if name == "pinfree":
        return lambda: pinned.PinnedBuffer(64 << 20).free()
    if name == "kvwarm":
        return lambda: kv_move.self_test(dtype="bfloat16", k_dim=128, v_dim=128, bits=(16, 8, 4))
    if name == "selftest":
        return small_matmul.self_test
    if name == "readback":
        a = mx.random.normal((1024, 1024))
        return lambda: (a * 2).__array__()
    if name == "h2d":
        import numpy as np

        host = np.ones(16 << 20, dtype=np.float32)
        return lambda: mx.eval(mx.array(host) + 1)
    if name == "meminfo":
        from appliance.kernels.cuda_driver import device_memory

        return device_memory
    return None  # none: the side thread only sleeps, holding nothing


def job(name: str, seconds: float) -> None:
    """Runs the engine-like thread beside `name` for `seconds` (in this process)."""
    from contextlib import nullcontext

    import mlx.core as mx

    from appliance.kernels.gate import GATE

    name, gated = name.removesuffix("+gate"), name.endswith("+gate")
    shared, alone = (GATE.shared, GATE.alone) if gated else (nullcontext, nullcontext)

    mx.set_memory_limit(20 << 30)
    w = [mx.random.normal((n, 4096)).astype(mx.bfloat16) for n in (6144, 14336 * 2, 4096)]
    x = mx.random.normal((8, 4096)).astype(mx.bfloat16)
    mx.eval(w, x)
    passes, rounds, stop = [0], [0], threading.Event()

    def engine() -> None:
        while not stop.is_set():
            with shared():
                y = x
                for _ in range(8):
                    y = (y @ w[0].T)[:, :4096] + (y @ w[1].T)[:, :4096] + y @ w[2].T
                mx.eval(y)
            passes[0] += 1

    def beside() -> None:
        with mx.stream(mx.new_stream(mx.gpu)):
            run = side_job(name)
            while not stop.is_set():
                if run is None:
                    time.sleep(0.01)
                else:
                    with alone():
                        run()
                rounds[0] += 1

    threads = [threading.Thread(target=engine), threading.Thread(target=beside)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    print(json.dumps({"passes": passes[0], "rounds": rounds[0]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beside", default=",".join(JOBS))
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job, args.seconds)
        return
    for _ in range(args.repeats):
        for name in args.beside.split(","):
            started = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, __file__, "--job", name, "--seconds", str(args.seconds)],
                                      capture_output=True, text=True, timeout=args.seconds + 90)
            except subprocess.TimeoutExpired as e:  # a job that hangs: reported as rc None
                text = [t.decode() if isinstance(t, bytes) else t or "" for t in (e.stdout, e.stderr)]
                done = subprocess.CompletedProcess(e.cmd, None, *text)
            counts = next((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")), {})
            err = [line for line in done.stderr.splitlines() if line.strip()]
            took_s = round(time.perf_counter() - started, 1)
            print(json.dumps({"beside": name, "rc": done.returncode, **counts, "s": took_s,
                              "stderr": err[-1][:200] if err else ""}), flush=True)


if __name__ == "__main__":
    main()
