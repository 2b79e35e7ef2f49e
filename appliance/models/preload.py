"""The default model's weights, read onto the device while `omlx serve` imports the rest of
itself (CUDA only).

A later start on an H100 spent 4.3-4.8 s importing (mlx-lm, and through it transformers:
3.3 s) before its model's load could begin, then 2.2-4.0 s reading an 8B model's weights
through pinned memory (models/weights.py): ready at the load + 5.4 s. `start` begins that
read on a thread once the config is parsed, before those imports; `load_model` takes the
weights (`claim`, `weights_of`) instead of reading them again.

Only a local MLX directory is preloaded (a GGUF file converts and a repo downloads first:
they load as before), only after the model's memory check passes, and only where the
pinned path runs (CUDA). The default model's load claims the preload; another model's
load, before it in the config, neither waits for it nor drops it. The runtime's own memory
check of the default model defers to the preload's (`memory_checked`): by then the
weights it counts as needed may be on the device already.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from appliance.config import LoadedConfig

log = logging.getLogger("omlx.models")


class Preloaded(NamedTuple):
    model: str  # the spec's name
    path: Path  # its local MLX directory
    weights: object  # models.weights.Weights


_lock = threading.Lock()
_pending: tuple[str, Future] | None = None  # the model's name; a future of Preloaded, or of None
_checked: tuple[str, Future] | None = None  # the model's name; a future of whether its memory check passed
_reading: tuple[str, int] | None = None  # the model whose weights are being read; MLX's active memory before


def start(config: LoadedConfig) -> None:
    """Starts reading the default model's weights onto the device on a thread of its own."""
    global _pending, _checked
    future: Future = Future()
    checked: Future = Future()
    with _lock:
        _pending = (config.spec.default_model.name, future)
        _checked = (config.spec.default_model.name, checked)

    def run() -> None:
        global _reading
        try:
            future.set_result(_preload(config, checked))
        except BaseException as e:  # the model's own load reports what is wrong with it
            log.info("weights: no preload (%s: %s)", type(e).__name__, e)
            future.set_result(None)
        finally:
            _reading = None  # only now: until the future is done, a load may still start a stand-in
            if not checked.done():
                checked.set_result(False)

    threading.Thread(target=run, name="weights-preload", daemon=True).start()


def _preload(config: LoadedConfig, checked: Future) -> Preloaded | None:
    import mlx.core as mx

    from appliance import platform

    if not mx.cuda.is_available():
        return None
    from appliance.models.headers import weight_files
    from appliance.models.memory import check_memory
    from appliance.models.source import describe_source, materialize
    from appliance.models.weights import load_weights

    spec, base_dir = config.spec, config.base_dir
    model, cache_dir = spec.default_model, spec.cache.path(base_dir)
    if describe_source(model.source, base_dir) != "mlx-dir":
        return None
    path = materialize(model.source, base_dir=base_dir, cache_dir=cache_dir, dtype="float32")  # as is
    # What `serve` sets first, before anything touches the device: MLX reads both once.
    platform.keep_compiled_kernels(cache_dir)
    platform.limit_device_memory(spec.server.mlx_memory_limit_gb)
    check_memory(model, base_dir=base_dir, cache_dir=cache_dir)
    checked.set_result(True)
    global _reading
    _reading = (model.name, mx.get_active_memory())  # until `run` has set the future
    weights = load_weights(weight_files(path))
    log.info("weights: %s preloaded by %s, %.2f GB in %.2f s", model.name, weights.loader, weights.nbytes / 1e9,
             weights.load_s)
    return Preloaded(model.name, path, weights)


def resident_bytes(model: str) -> int:
    """Returns how much of `model`'s weights a preload still reading them has put on the
    device (MLX's active memory grown since it began: nothing else allocates on the device
    then); 0 when none is reading them. A stand-in deciding whether it fits beside the model
    (models/memory.room_beside) counts those bytes as the model's, not as taken."""
    import mlx.core as mx

    reading = _reading
    if reading is None or reading[0] != model:
        return 0
    return max(mx.get_active_memory() - reading[1], 0)


def memory_checked(model: str) -> bool:
    """Returns whether a preload of `model`'s weights passed its memory check, waiting for
    that check (it comes first, moments after `start`); once. Such weights are on their way to
    the device, where a second check would count them against the model itself: on an
    H100 a 70B model's restart failed that way, with 30 of its 36 GiB preloaded."""
    global _checked
    with _lock:
        if _checked is None or _checked[0] != model:
            return False
        (_, checked), _checked = _checked, None  # once: a later load of the model checks again
    return checked.result()


def claim(model: str) -> Future | None:
    """Returns the preload of `model`'s weights, under way or done (a future of Preloaded
    or None), once; None when there is none for it."""
    global _pending
    with _lock:
        if _pending is None or _pending[0] != model:
            return None
        (_, pending), _pending = _pending, None
    return pending


def weights_of(pending: Future | None, model: str, path: Path):
    """Returns the weights `pending` preloaded for `model` at `path` (waiting for them),
    else None."""
    if pending is None:
        return None
    preloaded = pending.result()
    if preloaded is None or preloaded.model != model or preloaded.path != path:
        return None
    return preloaded.weights


def done(pending: Future | None, model: str, path: Path) -> bool:
    """Returns whether `pending` holds `model`'s weights already: no load to work beside."""
    return pending is not None and pending.done() and weights_of(pending, model, path) is not None
