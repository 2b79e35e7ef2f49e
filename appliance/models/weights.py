"""A model's safetensors weights read onto the device: on CUDA through pinned host memory
and a copy kernel, elsewhere (and whenever that path fails) by MLX's own `mx.load`.

MLX's loader copies each tensor to the device from pageable memory: 1.8 GB/s on an H100,
8.2 s for an 8B model's 13.75 GiB. The pinned path (`PinnedLoader`) reads each tensor from
its file into one of two pinned staging buffers (`PIECE_BYTES` at a time, on a few reader
threads), then copies it into a new device array with kernels/cuda/copy_from_host.cu, which
reads the pinned memory over the host link; one buffer fills while the kernels copy the
other. The same model took 1.12 s, every array bit for bit the same (bench/weight_load.py).

A load never fails because of the fast path: any failure of it (no driver, NVRTC, a dtype
it does not know, a read) is logged, and `mx.load` reads the files instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from appliance.kernels.cubins import compiled, source
from appliance.kernels.gate import GATE
from appliance.kernels.kv_move import THREADS, grid
from appliance.kernels.pinned import PinnedBuffer
from appliance.models.headers import Tensor, tensors
from appliance.models.kinds import SAFETENSORS_KINDS

log = logging.getLogger("omlx.models")

# safetensors dtype -> the MLX dtype mx.load (MLX 0.32) reads it as, its bytes unchanged
DTYPES = {name: mx.bool_ if kind == "bool" else getattr(mx, kind) for name, kind in SAFETENSORS_KINDS.items()}
KERNEL = "omlx_copy_from_host"  # the extern "C" kernel of kernels/cuda/copy_from_host.cu
STAGING_BYTES = 512 << 20  # each of the two staging buffers, raised to the largest tensor
PIECE_BYTES = 64 << 20  # what one reader thread reads at once
NUM_READERS = 4
ALIGN = 256  # each tensor's place in a staging buffer


class Staged(NamedTuple):
    """A tensor's place in a staging buffer's load."""

    file: Path
    tensor: Tensor
    place: int  # of its first byte in the buffer


@dataclass(frozen=True)
class Weights:
    """A model's tensors, evaluated on the device, and how they got there."""

    arrays: dict[str, mx.array]
    loader: str  # "pinned" or "mx.load"
    nbytes: int
    load_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.load_s / 1e9 if self.load_s > 0 else 0.0


def load_weights(files: Sequence[Path], *, pinned: bool | None = None, staging_bytes: int = STAGING_BYTES,
                 num_readers: int = NUM_READERS) -> Weights:
    """Returns every tensor of the safetensors `files`, evaluated on the device: through
    pinned memory where `pinned` (by default on CUDA), else, or when that path fails (one
    log line says why), as `mx.load` reads them."""
    started = time.perf_counter()
    files = [Path(f) for f in files]
    if pinned is None:
        pinned = mx.cuda.is_available()
    if pinned:
        try:
            arrays = _load_pinned(files, staging_bytes, num_readers)
        except Exception as e:  # the fast path never fails a load: mx.load reads the files
            log.warning("weights: the pinned load failed (%s: %s); loading them with mx.load", type(e).__name__, e)
        else:
            return Weights(arrays, "pinned", _nbytes(arrays), time.perf_counter() - started)
    arrays = load_mlx(files)
    return Weights(arrays, "mx.load", _nbytes(arrays), time.perf_counter() - started)


def load_mlx(files: Sequence[Path]) -> dict[str, mx.array]:
    """Returns every tensor of `files` as MLX's own loader reads them, evaluated."""
    arrays: dict[str, mx.array] = {}
    for file in files:
        arrays.update(mx.load(str(file)))
    mx.eval(list(arrays.values()))
    return arrays


def _load_pinned(files: list[Path], staging_bytes: int, num_readers: int) -> dict[str, mx.array]:
    listed = [t for file in files for t in tensors(file)]
    if not listed:
        return {}
    unknown = sorted({t.dtype for t in listed} - DTYPES.keys())
    if unknown:
        raise ValueError(f"no MLX dtype for safetensors dtype {', '.join(unknown)}")
    largest = max((t.nbytes for t in listed), default=0)
    total = sum(t.nbytes for t in listed)
    # Two buffers of half the model at most: pinning is slow (the driver locks every page).
    staging = max(_aligned(largest), min(staging_bytes, _aligned(-(-total // 2))), ALIGN)
    with PinnedLoader(staging, num_readers=num_readers) as loader:
        return loader.load(files)


class PinnedLoader:
    """The pinned path: two pinned staging buffers of `staging_bytes` (a tensor must fit
    one), the copy kernel and a pool of reader threads. `load` may run several times;
    `close` frees the buffers."""

    def __init__(self, staging_bytes: int = STAGING_BYTES, *, num_readers: int = NUM_READERS):
        self.cubin = copy_kernel()
        self.staging_bytes = staging_bytes
        self.pool = ThreadPoolExecutor(num_readers, thread_name_prefix="omlx-weights")
        self.buffers: list[PinnedBuffer] = []
        started = time.perf_counter()
        try:
            for _ in range(2):
                self.buffers.append(PinnedBuffer(staging_bytes))
        except BaseException:
            self.close()
            raise
        self.pin_s = time.perf_counter() - started

    def __enter__(self) -> PinnedLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for buffer in self.buffers:
            buffer.free()
        self.buffers = []

    def load(self, files: Sequence[Path]) -> dict[str, mx.array]:
        """Returns every tensor of `files` as a device array, evaluated."""
        weights: dict[str, mx.array] = {}
        copies: list[list[mx.array]] = []  # per staging load, the arrays its kernels copy
        try:
            for i, batch in enumerate(plan(files, self.staging_bytes)):
                buffer = self.buffers[i % 2]
                if i >= 2:
                    mx.eval(copies[i - 2])  # the kernels reading this buffer are done before it is refilled
                self._read(batch, buffer)
                arrays = [self._copy(buffer.device_address + s.place, s.tensor) for s in batch]
                # Copied while the next batch is read into the other buffer; the first launch
                # loads the kernel's module, between the engines' steps (kernels/gate.py).
                with GATE.alone() if i == 0 else contextlib.nullcontext():
                    mx.async_eval(arrays)
                copies.append(arrays)
                weights.update((s.tensor.name, a) for s, a in zip(batch, arrays))
            mx.eval(list(weights.values()))
        except BaseException:
            with contextlib.suppress(Exception):  # no kernel may still read a buffer once it is freed
                mx.eval([a for arrays in copies for a in arrays])
            raise
        return weights

    def _read(self, batch: list[Staged], buffer: PinnedBuffer) -> None:
        """Reads each tensor of `batch` into its place in `buffer`, in pieces on the pool;
        returns once every read has ended (then raises the first failure, if any)."""
        reads = [self.pool.submit(read_into, s.file, s.tensor.offset + at,
                                  buffer.view[s.place + at:s.place + min(s.tensor.nbytes, at + PIECE_BYTES)])
                 for s in batch for at in range(0, s.tensor.nbytes, PIECE_BYTES)]
        wait(reads)  # none may still write into the buffer when a failure frees it
        for read in reads:
            read.result()

    def _copy(self, address: int, tensor: Tensor) -> mx.array:
        dtype = DTYPES[tensor.dtype]
        if tensor.nbytes == 0:
            return mx.zeros(tensor.shape, dtype)  # nothing to copy
        return mx.fast.precompiled_cuda_kernel(
            name=KERNEL, compiled_source=self.cubin, inputs=[mx.array([address, tensor.nbytes], dtype=mx.uint64)],
            scalars=[], grid=grid(tensor.nbytes // 16), threadgroup=(THREADS, 1, 1),
            output_shapes=[tensor.shape], output_dtypes=[dtype])[0]


@cache
def copy_kernel() -> bytes:
    """Returns the cubin of kernels/cuda/copy_from_host.cu for this GPU, compiled by NVRTC
    once per machine; raises CudaError or CompileError."""
    return compiled(source("copy_from_host"), KERNEL)


def plan(files: Sequence[Path], staging_bytes: int) -> list[list[Staged]]:
    """Returns the tensors of `files` grouped into loads of one staging buffer of
    `staging_bytes`, each tensor with its place there; raises ValueError for a tensor that
    fits no buffer or has a dtype with no MLX dtype."""
    batches: list[list[Staged]] = []
    batch: list[Staged] = []
    used = 0
    for file in files:
        for t in tensors(Path(file)):
            if t.dtype not in DTYPES:
                raise ValueError(f"{t.name}: no MLX dtype for safetensors dtype {t.dtype}")
            size = _aligned(t.nbytes)
            if size > staging_bytes:
                raise ValueError(f"{t.name} ({t.nbytes} bytes) fits no staging buffer of {staging_bytes} bytes")
            if used + size > staging_bytes:
                batches.append(batch)
                batch, used = [], 0
            batch.append(Staged(Path(file), t, used))
            used += size
    if batch:
        batches.append(batch)
    return batches


def read_into(file: Path, offset: int, into: memoryview) -> None:
    """Fills `into` with the bytes of `file` from `offset`; raises OSError when it ends first."""
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read of {file} at byte {offset + done}")
            done += n
    finally:
        os.close(fd)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())
