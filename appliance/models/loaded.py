"""A model loaded into MLX: weights, tokenizer, limits, ready for an engine."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

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

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of raw text, with no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

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
    path = materialize(spec.source, base_dir=base_dir, cache_dir=cache_dir, dtype=dtype or "float32")
    with contextlib.suppress(OSError):  # the KV cache's key, hashed while the weights load
        start_fingerprint(path, memo_dir=cache_dir)
    if beside is not None:
        beside(path, dtype)
    model, tokenizer, config = load(str(path), lazy=True, return_config=True)
    if dtype is not None:
        cast(model, DTYPES[dtype])
    mx.eval(model.parameters())
    context = context_tokens(spec, config)
    actual = dtype or str(next(iter_float_dtypes(model), "unknown")).removeprefix("mlx.core.")
    loaded = LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer,
                         context_tokens=context, dtype=actual, load_s=time.perf_counter() - started)
    log.info("model %s loaded from %s (%s, %d-token context) in %.1f s",
             spec.name, path, actual, context, loaded.load_s)
    return loaded


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
