"""A model's weights from its safetensors files onto the device, two ways, in GB/s:

- `mlx`: MLX's own loader (`mx.load` of each file, then one `mx.eval`), what mlx-lm's
  `load_model` runs and so what a start of `omlx serve` waits for;
- `pinned` (CUDA only): each tensor read from the file (the page cache, as a later start
  finds it) into pinned host memory on `--threads` threads, then copied into a new device
  array by a kernel that reads pinned memory over the host link (compiled by NVRTC,
  kernels/cubins.py). Two staging buffers alternate: one fills while the kernels copy
  the other. Pinning them is timed apart (a server would keep them).

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
import os
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from appliance.kernels.kv_move import SOURCES, THREADS, compiled, grid  # noqa: E402
from appliance.kernels.pinned import PinnedBuffer  # noqa: E402
from appliance.platform import limit_device_memory  # noqa: E402

DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32, "I32": mx.int32,
          "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "I64": mx.int64, "U64": mx.uint64}
ALIGN = 256  # each tensor's place in a staging buffer
PIECE = 64 << 20  # bytes one thread reads at once
COPY_KERNEL = """
// src: [device address of pinned host memory (16-byte aligned), bytes]; out: any array
extern "C" __global__ void omlx_copy_from_host(const u64* src, u8* out) {
  const u8* base = reinterpret_cast<const u8*>(src[0]);
  const i64 n = static_cast<i64>(src[1]);
  const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  for (i64 i = first; i < n / 16; i += (i64)gridDim.x * blockDim.x) {
    reinterpret_cast<Vec16*>(out)[i] = reinterpret_cast<const Vec16*>(base)[i];
  }
  if (first == 0) {
    for (i64 i = n / 16 * 16; i < n; ++i) out[i] = base[i];
  }
}
"""


def tensors(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """Returns (name, dtype, shape, file offset, bytes) of each tensor in a safetensors file."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    start = 8 + header_len
    return [(name, t["dtype"], t["shape"], start + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0])
            for name, t in header.items() if name != "__metadata__"]


def load_mlx(files: list[Path]) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    mx.eval(list(weights.values()))
    return weights


class PinnedLoader:
    """Two pinned staging buffers and a thread pool; `load(files)` returns the weights."""

    def __init__(self, staging_bytes: int, threads: int):
        self.cubin = compiled((SOURCES / "prelude.cuh").read_text() + COPY_KERNEL, "omlx_copy_from_host")
        started = time.perf_counter()
        self.buffers = [PinnedBuffer(staging_bytes) for _ in range(2)]
        self.pin_s = time.perf_counter() - started
        self.staging_bytes = staging_bytes
        self.pool = ThreadPoolExecutor(threads)

    def _copy(self, address: int, nbytes: int, shape: list[int], dtype: mx.Dtype) -> mx.array:
        return mx.fast.precompiled_cuda_kernel(
            name="omlx_copy_from_host", compiled_source=self.cubin,
            inputs=[mx.array([address, nbytes], dtype=mx.uint64)], scalars=[],
            grid=grid(nbytes // 16), threadgroup=(THREADS, 1, 1),
            output_shapes=[tuple(shape)], output_dtypes=[dtype])[0]

    def load(self, files: list[Path]) -> dict[str, mx.array]:
        weights: dict[str, mx.array] = {}
        copies: list[list[mx.array]] = []  # per batch, its device arrays
        for i, batch in enumerate(self._batches(files)):
            buffer = self.buffers[i % 2]
            if i >= 2:
                mx.eval(copies[i - 2])  # that buffer's last copies must be done before it is refilled
            reads = [self.pool.submit(_read, file, offset + at, buffer.view[place + at:place + min(nbytes, at + PIECE)])
                     for file, (_, _, _, offset, nbytes), place in batch for at in range(0, nbytes, PIECE)]
            for read in reads:
                read.result()
            arrays = [self._copy(buffer.device_address + place, nbytes, shape, DTYPES[dtype])
                      for _, (_, dtype, shape, _, nbytes), place in batch]
            mx.async_eval(arrays)  # copied while the next batch is read into the other buffer
            copies.append(arrays)
            weights.update((name, a) for (_, (name, *_), _), a in zip(batch, arrays))
        mx.eval(list(weights.values()))
        return weights

    def _batches(self, files: list[Path]):
        """Tensors grouped into staging-buffer loads, each with its place in the buffer."""
        batches, batch, used = [], [], 0
        for file in files:
            for t in tensors(file):
                size = -(-t[4] // ALIGN) * ALIGN
                if size > self.staging_bytes:
                    raise SystemExit(f"{t[0]} ({t[4]} bytes) does not fit a staging buffer: raise --staging-mib")
                if used + size > self.staging_bytes:
                    batches.append(batch)
                    batch, used = [], 0
                batch.append((file, t, used))
                used += size
        if batch:
            batches.append(batch)
        return batches


def _read(file: Path, offset: int, into: memoryview) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read of {file} at {offset + done}")
            done += n
    finally:
        os.close(fd)


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
    files = sorted(args.model.glob("model*.safetensors"))
    listed = [t for f in files for t in tensors(f)]
    total = sum(t[4] for t in listed)
    largest = max(t[4] for t in listed)
    for file in files:  # into the page cache, as a later start finds the files
        with file.open("rb") as f:
            while f.read(64 << 20):
                pass
    print(f"{len(files)} files, {len(listed)} tensors, {total / 2**30:.2f} GiB (largest {largest / 2**20:.0f} MiB)")

    cuda = mx.cuda.is_available()
    loader = None
    if cuda:
        staging = max(args.staging_mib << 20, -(-largest // ALIGN) * ALIGN)
        loader = PinnedLoader(staging, args.threads)
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
    if args.beside_imports:
        loader = reference = None  # the pinned buffers freed, the device's memory for the children
        mx.clear_cache()
        overlap = beside_imports(files)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "bytes": total, "tensors": len(listed),
                                        "threads": args.threads, "pin_s": pin_s,
                                        "runs": runs, "best_s": best, "beside_imports": overlap}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
