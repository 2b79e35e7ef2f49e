"""Will a model fit? A check before loading, so a swap fails cleanly instead of thrashing."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.models.source import describe_source
from appliance.platform import device_kind, device_memory_bytes
from appliance.spec import ModelSpec

# Weights grow when cast up (a bfloat16 or 4-bit checkpoint run in float32 on a CPU).
HEADROOM = 1.2


def available_bytes() -> int | None:
    """Returns the memory the OS can give without swapping (Linux: MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def free_bytes() -> int | None:
    """Returns what MLX may still allocate: on a GPU, its memory limit (set from the
    device's memory, which on CUDA is not the host's) less what it holds, and on CUDA no
    more than the device has free (`cuda_free_bytes`: other processes count); else the
    memory the OS has available."""
    if device_kind() == "gpu":
        import mlx.core as mx

        device = device_memory_bytes()
        limit = min(mx.get_memory_limit() or device or 0, device or mx.get_memory_limit())
        if not limit:
            return None
        free = max(limit - mx.get_active_memory(), 0)
        cuda = cuda_free_bytes()
        return free if cuda is None else min(free, cuda)
    return available_bytes()


def cuda_free_bytes() -> int | None:
    """Returns what MLX could still get on a CUDA device: the device's free memory as the
    driver sees it (another process's share taken: on an H200 a leftover server holding
    37 GB made omlx's prefills run out of memory) plus MLX's own cache; None elsewhere."""
    import mlx.core as mx

    from appliance.kernels.cuda_driver import CudaError, device_memory

    if not mx.cuda.is_available():
        return None
    try:
        free, _ = device_memory()
    except CudaError:
        return None
    return free + mx.get_cache_memory()


def weights_bytes(path: Path) -> int:
    """Returns the size of a model's weights: the file itself, or a directory's safetensors."""
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def room_beside(model_dir: Path, resident: int = 0) -> int | None:
    """Returns what MLX may still allocate once the model in `model_dir` is loaded (its
    weights with the load's HEADROOM), negative when it does not fit; None when unknown.
    `resident`: bytes of those weights on the device already (a preload's, counted in
    what MLX holds), so not counted twice."""
    free = free_bytes()
    return None if free is None else free - max(int(weights_bytes(model_dir) * HEADROOM) - resident, 0)


def check_memory(spec: ModelSpec, *, base_dir: Path, cache_dir: Path) -> None:
    """Raises MemoryError when a local model's weights clearly cannot fit in free memory."""
    if describe_source(spec.source, base_dir) == "hf-repo":
        return  # size unknown until downloaded
    path = Path(spec.source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    needed = weights_bytes(path)
    if path.suffix == ".gguf":
        needed *= 8  # quantized GGUF weights expand to float32 (4-bit -> 32-bit)
    free = free_bytes()
    if free is not None and needed * HEADROOM > free:
        raise MemoryError(f"not enough memory for model {spec.name}: needs about "
                          f"{needed * HEADROOM / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available")
