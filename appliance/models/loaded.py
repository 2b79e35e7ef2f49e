"""A model loaded into MLX: weights, tokenizer, limits, ready for an engine."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from appliance.cache.keys import DEFAULT_TENANT
from appliance.models import kinds, preload
from appliance.models.compiled_blocks import compile_as_asked
from appliance.models.fuse import fuse_as_asked
from appliance.models.headers import weight_files
from appliance.models.native_linear import native_linear_here
from appliance.models.pieces import PieceEncoder
from appliance.models.weights import load_weights
from appliance.platform import resolve_dtype
from appliance.spec import ModelSpec

log = logging.getLogger("omlx.models")

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    path: Path  # the local MLX model directory
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    context_tokens: int
    dtype: str
    load_s: float
    loaded_at: float = field(default_factory=time.time)  # epoch seconds

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)

    def encode(self, text: str, *, tenant: str = DEFAULT_TENANT) -> list[int]:
        """Returns the token ids of raw text, with no special tokens added; a long text
        reuses the pieces of `tenant`'s recent texts it starts with (models/pieces.py)."""
        return self._pieces.encode(text, tenant)

    @cached_property
    def _pieces(self) -> PieceEncoder:
        return PieceEncoder.of(self.tokenizer)  # long prompts in pieces, a resent one reusing them (models/pieces.py)

    def encode_chat(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """Returns the prompt token ids of a chat, rendered by the model's chat template."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return self.encode(text)


def load_model(spec: ModelSpec, *, base_dir: Path, cache_dir: Path,
               beside: Callable[[Path, str | None], None] | None = None) -> LoadedModel:
    """Returns `spec`'s model loaded and evaluated; raises ModelSourceError or ValueError.
    `beside(path, dtype)` is called once the model's directory is known, before its
    weights load: work to start beside the load."""
    from mlx_lm.utils import load

    from appliance.models.fingerprint import start_fingerprint
    from appliance.models.source import materialize

    started = time.perf_counter()
    dtype = resolve_dtype(spec.dtype)
    path = materialize(spec.source, base_dir=base_dir, cache_dir=cache_dir, dtype=dtype or kinds.GGUF_KIND)
    with contextlib.suppress(OSError):  # the KV cache's key, hashed while the weights load
        start_fingerprint(path, memo_dir=cache_dir)
    pending = preload.claim(spec.name)  # the weights `omlx serve` began to read at its start
    if beside is not None and not preload.done(pending, spec.name, path):  # a load to work beside
        beside(path, dtype)
    weights_s = 0.0  # reading and evaluating the weights, not building the model or its tokenizer
    if mx.cuda.is_available():  # the weights read through pinned memory (models/weights.py)
        weights = preload.weights_of(pending, spec.name, path) or load_weights(weight_files(path))
        loader, weights_s = weights.loader, weights.load_s
        model, tokenizer, config = load_with_weights(path, weights.arrays)
    else:  # mlx-lm's own lazy load, read by mx.load in the eval below
        loader = "mx.load"
        model, tokenizer, config = load(str(path), lazy=True, return_config=True)
    if dtype is not None:
        cast(model, DTYPES[dtype])
    evaluated = time.perf_counter()
    mx.eval(model.parameters())
    weights_s += time.perf_counter() - evaluated
    fused = fuse_as_asked(model, spec.fuse_projections)
    native = native_linear_here(model)
    compiled = compile_as_asked(model, spec.compile_blocks)
    weights_gb = sum(f.stat().st_size for f in weight_files(path)) / 1e9
    context = context_tokens(spec, config)
    actual = dtype or str(next(iter_float_dtypes(model), "unknown")).removeprefix("mlx.core.")
    loaded = LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer,
                         context_tokens=context, dtype=actual, load_s=time.perf_counter() - started)
    log.info("model %s loaded from %s (%s, %d-token context) in %.1f s; weights by %s, %.2f GB in %.2f s (%.1f GB/s)%s",
             spec.name, path, actual, context, loaded.load_s, loader, weights_gb, weights_s,
             weights_gb / weights_s if weights_s > 0 else 0.0,
             (f"; {fused} projection groups fused" if fused else "")
             + (f"; {native} Linear layers can run natively" if native else "")
             + (f"; {compiled} blocks decode compiled" if compiled else ""))
    return loaded


def load_with_weights(path: Path, arrays: dict[str, mx.array]) -> tuple[nn.Module, Any, dict]:
    """Returns (model, tokenizer, config) as mlx-lm's `load(path, lazy=True,
    return_config=True)` does, its weights taken from `arrays` (every tensor of the model's
    files by name, on the device already) instead of the lazy arrays mlx-lm reads from the
    files, which are never evaluated. `arrays` is emptied as they are taken, so a weight
    that sanitize or the cast replaces is freed once its replacement is evaluated.

    Relies on mlx-lm's `load_model` passing every tensor of the files to the model class's
    `sanitize` (when it has one) before anything else reads them, and on its private
    `_get_classes` (engine/mlxlm_seam.py `model_classes`, with both in its `UPSTREAM`)."""
    from mlx_lm import utils as mlx_lm_utils

    from appliance.engine.mlxlm_seam import model_classes

    made: list[type] = []

    def classes(config: dict) -> tuple[type, type]:
        model_class, args_class = model_classes(config)
        made.append(_taking(model_class, arrays))
        return made[-1], args_class

    model, config = mlx_lm_utils.load_model(path, lazy=True, get_model_classes=classes)
    if made and type(model) is made[-1]:
        model.__class__ = made[-1].__base__  # the model's own class again, the weights taken
    tokenizer = mlx_lm_utils.load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer, config


def _taking(model_class: type, arrays: dict[str, mx.array]) -> type:
    """Returns a subclass of `model_class` whose `sanitize` first swaps each lazy array it
    is given for the one of that name in `arrays`, then runs the class's own (if any)."""
    has_sanitize = hasattr(model_class, "sanitize")

    class Taking(model_class):
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            weights = {name: arrays.pop(name, lazy) for name, lazy in weights.items()}
            return super().sanitize(weights) if has_sanitize else weights

    Taking.__name__, Taking.__qualname__ = model_class.__name__, model_class.__qualname__
    Taking.__module__ = model_class.__module__
    return Taking


def context_tokens(spec: ModelSpec, config: dict) -> int:
    """Returns the model's context limit: the trained length, or less, or more when the
    spec explicitly allows running beyond it."""
    trained = int(config.get("max_position_embeddings") or spec.max_context_tokens or 4096)
    wanted = spec.max_context_tokens
    if wanted is None:
        return trained
    if wanted > trained and spec.allow_beyond_trained_context:
        log.warning("model %s runs a %d-token context beyond its trained %d tokens "
                    "(allow_beyond_trained_context): quality may drop past %d",
                    spec.name, wanted, trained, trained)
        return wanted
    return min(trained, wanted)


def cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Casts the floating-point weights of `model` to `dtype`; quantized ints stay as they are."""
    model.update(tree_map(
        lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
        model.parameters(),
    ))


def iter_float_dtypes(model: nn.Module):
    from mlx.utils import tree_flatten

    for _, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            yield a.dtype
