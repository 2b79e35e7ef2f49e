"""A model's weights from its safetensors files onto the device, two ways, in GB/s:

- `mlx`: MLX's own loader (`mx.load` of each file, then one `mx.eval`), what mlx-lm's
  `load_model` runs and so what a start of `omlx serve` waits for;
- `pinned` (CUDA only): each tensor read from the file (the page cache, as a later start
  finds it) into pinned host memory on `--threads` threads, then copied into a new device
  array by a kernel that reads pinned memory over the host link (compiled by NVRTC,
  kernels/cubins.py). Two staging buffers alternate: one fills while the kernels copy
  the other. Pinning them is timed apart. This is appliance/models/weights.py's
  `PinnedLoader`, what `omlx serve` loads models through on CUDA.

`--beside-imports` adds two fresh processes that import mlx-lm (and through it
transformers, 1.5-3 s on those machines) and run MLX's load, one after the other and side
by side (the load on a thread started before the import): whether a load started before
mlx-lm's import would overlap it, or wait on the GIL.

Each path runs twice, alternating, after one read of every file into the page cache; a
sample of the tensors is checked equal between the paths. On an H100 MLX's load of an 8B
model's 13.75 GiB took 5.6-14.7 s (2026-12-06): most of the loader thread's samples were
in `cuMemcpyAsync` from pageable memory.

    python3 bench/weight_load.py /tmp/llama-8b [--threads 4] [--staging-mib 512] [--beside-imports] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from appliance.models.headers import tensors, weight_files  # noqa: E402
from appliance.models.weights import ALIGN, PinnedLoader, load_mlx  # noqa: E402
from appliance.platform import limit_device_memory  # noqa: E402

# A fresh process: omlx's first imports, then mlx-lm's import and MLX's load of the files,
# in turn (argv[1] "apart") or the load on a thread started before the import ("beside").
CHILD = r"""
import sys, threading, time
started = time.perf_counter()
sys.path.insert(0, sys.argv[2])
import appliance  # as `omlx serve` starts: it keeps transformers from importing PyTorch
import mlx.core as mx
from appliance.platform import limit_device_memory
limit_device_memory()
times = {"mlx_import_s": time.perf_counter() - started}
def load():
    t = time.perf_counter()
    weights = {}
    for f in sys.argv[3:]:
        weights.update(mx.load(f))
    mx.eval(list(weights.values()))
    times["load_s"] = time.perf_counter() - t
def imports():
    t = time.perf_counter()
    import mlx_lm.utils  # noqa: F401
    times["mlx_lm_import_s"] = time.perf_counter() - t
if sys.argv[1] == "apart":
    imports()
    load()
else:
    loader = threading.Thread(target=load)
    loader.start()
    imports()
    loader.join()
times["wall_s"] = time.perf_counter() - started
print(repr(times))
"""


def beside_imports(files: list[Path]) -> dict[str, dict]:
    """Runs CHILD apart and beside; returns each one's times."""
    import ast

    repo = str(Path(__file__).resolve().parents[1])
    out = {}
    for mode in ("apart", "beside"):
        done = subprocess.run([sys.executable, "-c", CHILD, mode, repo, *map(str, files)], capture_output=True,
                              text=True, check=True)
        out[mode] = ast.literal_eval(done.stdout.strip().splitlines()[-1])
        t = out[mode]
        print(f"{mode:6s}: mlx-lm import {t['mlx_lm_import_s']:5.2f} s, load {t['load_s']:5.2f} s, "
              f"process {t['wall_s']:5.2f} s")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a directory of model*.safetensors")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--staging-mib", type=int, default=512, help="each of two buffers (raised to the largest tensor)")
    parser.add_argument("--beside-imports", action="store_true",
                        help="also time mlx-lm's import and MLX's load in fresh processes, apart and side by side")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    limit_device_memory()
    files = weight_files(args.model)
    listed = [t for f in files for t in tensors(f)]
    total = sum(t.nbytes for t in listed)
    largest = max(t.nbytes for t in listed)
    for file in files:  # into the page cache, as a later start finds the files
        with file.open("rb") as f:
            while f.read(64 << 20):
                pass
    print(f"{len(files)} files, {len(listed)} tensors, {total / 2**30:.2f} GiB (largest {largest / 2**20:.0f} MiB)")

    cuda = mx.cuda.is_available()
    loader = None
    if cuda:
        staging = max(args.staging_mib << 20, -(-largest // ALIGN) * ALIGN)
        loader = PinnedLoader(staging, num_readers=args.threads)
        print(f"pinned 2 x {staging / 2**20:.0f} MiB in {loader.pin_s:.2f} s")
    runs: list[dict] = []
    reference = None
    for repeat in range(2):
        for path in ("mlx", "pinned") if cuda else ("mlx",):
            started = time.perf_counter()
            weights = load_mlx(files) if path == "mlx" else loader.load(files)
            seconds = time.perf_counter() - started
            if path == "mlx" and repeat == 0:
                reference = {name: weights[name] for name in list(weights)[::10]}  # every tenth tensor
            elif path == "pinned" and reference is not None:
                unequal = [name for name, a in reference.items() if not mx.array_equal(weights[name], a).item()]
                if unequal:
                    raise SystemExit(f"pinned path differs from mx.load in {unequal[:5]}")
                print(f"pinned path equals mx.load in {len(reference)} tensors checked")
                reference = None
            runs.append({"path": path, "repeat": repeat, "seconds": round(seconds, 3),
                         "gbps": round(total / seconds / 1e9, 2)})
            print(f"{path:7s} repeat {repeat}: {seconds:6.2f} s  {total / seconds / 1e9:6.2f} GB/s")
            del weights
            mx.clear_cache()
    best = {p: min(r["seconds"] for r in runs if r["path"] == p) for p in {r["path"] for r in runs}}
    if "pinned" in best:
        print(f"best: mlx {best['mlx']:.2f} s, pinned {best['pinned']:.2f} s (+ {loader.pin_s:.2f} s pinning): "
              f"{best['mlx'] / best['pinned']:.1f}x")
    overlap, pin_s = None, loader.pin_s if loader else None
    if loader is not None:
        loader.close()  # the pinned buffers freed
    if args.beside_imports:
        reference = None  # the device's memory for the children
        mx.clear_cache()
        overlap = beside_imports(files)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "bytes": total, "tensors": len(listed),
                                        "threads": args.threads, "pin_s": pin_s,
                                        "runs": runs, "best_s": best, "beside_imports": overlap}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
