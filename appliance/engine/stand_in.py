"""The warm-up beside the load: a one-layer stand-in of the model, warmed up on the
engine's thread while the model's weights load.

On a GPU the first start of a machine compiles kernels as the warm-up first meets them
(MLX's JIT, the CUDA driver's, cuDNN's first attention graph of each kind: 0.6-0.9 s
each on an H200), after the load: an 8B model on an H200 was ready 13.97 s after its
start, of which 5.5 s were the load. A stand-in with the model's config but one layer
meets the same kernels and the same attention shapes (heads, head dims, dtype, the
buffers' strides), with the model's own embeddings, head and first layer read lazily
from the same files, so the compiling happens while the weights stream in and the
model's own warm-up finds it done.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from appliance.cache.kv import KVLayout, probe_layout
from appliance.engine.scheduler import Scheduler
from appliance.engine.warm_up import Laps, described, warm_up
from appliance.kernels import ahead
from appliance.models import kinds, preload
from appliance.models.compiled_blocks import compile_as_asked
from appliance.models.fuse import fuse_as_asked
from appliance.models.loaded import DTYPES, LoadedModel, cast, context_tokens
from appliance.models.memory import room_beside
from appliance.models.native_linear import native_linear_here
from appliance.spec import BatchingSpec, ModelSpec

log = logging.getLogger("omlx.engine")

LAYERS = 1


def load_stand_in(spec: ModelSpec, path: Path, dtype: str | None, *,
                  room_bytes: int | None = None) -> LoadedModel | None:
    """Returns the model at `path` cut to its first LAYERS layers, loaded (read from the
    model's own files) and cast to `dtype` as the model will be, with its tokenizer; None
    when its config does not cut that way (no `num_hidden_layers`) or it would take more
    than `room_bytes`."""
    from mlx_lm.utils import load_model, load_tokenizer

    started = time.perf_counter()
    model, config = load_model(path, lazy=True, strict=False, model_config={"num_hidden_layers": LAYERS})
    if len(getattr(model, "layers", ())) != LAYERS:
        return None
    if dtype is not None:
        cast(model, DTYPES[dtype])
    nbytes = sum(a.nbytes for _, a in tree_flatten(model.parameters()))  # lazy: nothing read yet
    if room_bytes is not None and nbytes > room_bytes:
        log.info("model %s: no room for its stand-in (%.1f GiB, %.1f GiB left beside the model)",
                 spec.name, nbytes / 2**30, max(room_bytes, 0) / 2**30)
        return None
    with mx.stream(generation_stream):  # the loader's evaluations use the default stream
        mx.eval(model.parameters())
        fuse_as_asked(model, spec.fuse_projections)  # the model's own shapes
        native_linear_here(model)  # and its own matmuls
        compile_as_asked(model, spec.compile_blocks)  # and its own compiled decode calls
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer,
                       context_tokens=context_tokens(spec, config), dtype=dtype or "checkpoint",
                       load_s=time.perf_counter() - started)


def model_layers(path: Path) -> int:
    """Returns the number of layers of the model at `path` (its config's, which a stand-in
    overrides)."""
    return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])


def warm_up_stand_in(spec: ModelSpec, path: Path, dtype: str | None, limits: BatchingSpec, *,
                     on_layout: Callable[[KVLayout], None] | None = None) -> bool:
    """Runs the warm-up (warm_up.py) on a stand-in of the model at `path`, on the calling
    thread, which must be the engine's; hands the stand-in's KV layout (the model's) to
    `on_layout` first (with the model's number of layers), so that the cache's kernels
    compile beside it. Returns whether it
    ran: a failure is logged, never raised, since the model's own warm-up follows.

    The stand-in must fit beside the whole model (its weights with the load's headroom)
    in what MLX may still allocate: a model that only just fits loads as it did without.
    Weights a preload has read onto the device already count as the model's."""
    started = time.perf_counter()
    laps = Laps()
    try:
        stand_in = load_stand_in(spec, path, dtype, room_bytes=room_beside(path, preload.resident_bytes(spec.name)))
        if stand_in is None:
            log.info("model %s: no stand-in; its shapes warm up after the load", spec.name)
            return False
        laps.lap("stand-in load")
        ahead.wait(kinds.of_model(stand_in.model))  # its first forward pass: MLX's kernels compiled ahead are there
        with mx.stream(generation_stream):
            layout = probe_layout(stand_in.model)
        if layout is not None and on_layout is not None:
            on_layout(replace(layout, num_layers=model_layers(path)))
        laps.lap("layout")
        laps.seconds.update(warm_up(stand_in, Scheduler.for_device(stand_in.model, limits), limits))
    except Exception:
        log.warning("model %s: the warm-up beside its load failed; its shapes warm up after the load",
                    spec.name, exc_info=True)
        return False
    finally:
        stand_in = None
        gc.collect()
        mx.clear_cache()  # the stand-in's buffers go back to the device for the model's
    log.info("model %s: warmed up beside its load, on a %d-layer stand-in, in %.2f s (%s)",
             spec.name, LAYERS, time.perf_counter() - started, described(laps.seconds))
    return True
