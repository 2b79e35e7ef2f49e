"""A Llama block's decode call as two compiled functions, to spare the host.

A decode pass of a few rows on MLX CUDA is bound by the host (BENCHMARKS.md, "a decode
pass is host-bound"): 2-4 ms of an 8-row pass of the 8B shape on an H100 is Python
building its graph, op by op. `compile_blocks` makes each of a model's Llama blocks a `CompiledBlock`
(a class swap in place: the same module and parameters) whose one-token calls over a
batch cache run the parts before and after the attention as `mx.compile`d functions:
the input norm, the projections and RoPE; then the output projection, the residuals, the
second norm and the MLP. The cache update and the attention stay as they are (their
shapes change every step). Each function is traced once per count of rows (and per
state of `small_matmul.in_use()`, which it reads while tracing); every other call is the
block's own.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention

from appliance.kernels import small_matmul
from appliance.platform import wanted_here


class CompiledBlock(llama.TransformerBlock):
    """A Llama block whose one-token calls over a batch cache are compiled (see the module)."""

    def __call__(self, x: mx.array, mask: mx.array | str | None = None, cache=None) -> mx.array:
        offset = getattr(cache, "offset", None)
        if x.shape[1] != 1 or not isinstance(offset, mx.array):
            return super().__call__(x, mask, cache)
        before, after = self._compiled()
        queries, keys, values = before(x, offset)
        keys, values = cache.update_and_fetch(keys, values)
        attn = self.self_attn
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        return after(x, out)

    def _compiled(self):
        """Returns the compiled (before, after) for the kernel's state now. They hold the
        block weakly: a block that holds what holds it would wait for Python's collector,
        and its traced graph (its weights) with it, once its model is dropped."""
        key = small_matmul.in_use()
        compiled = self.__dict__.setdefault("_compiled_parts", {})
        if key not in compiled:
            block = weakref.ref(self)
            compiled[key] = (mx.compile(lambda x, offset: block()._before(x, offset)),
                             mx.compile(lambda x, out: block()._after(x, out)))
        return compiled[key]

    def _before(self, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn = self.self_attn
        rows, length, _ = x.shape
        h = self.input_layernorm(x)
        queries, keys, values = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        queries = queries.reshape(rows, length, attn.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(rows, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(rows, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(queries, offset=offset), attn.rope(keys, offset=offset), values

    def _after(self, x: mx.array, out: mx.array) -> mx.array:
        rows, length, _ = x.shape
        h = x + self.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, length, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def compile_as_asked(model: nn.Module, choice: str) -> int:
    """Compiles `model`'s blocks if `choice` asks for it here ("auto": on CUDA, where a
    decode pass is host-bound; platform.wanted_here); returns how many."""
    return compile_blocks(model) if wanted_here(choice) else 0


def compile_blocks(model: nn.Module) -> int:
    """Makes each plain Llama block of `model` a `CompiledBlock` (in place); returns how many."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is llama.TransformerBlock:
            module.__class__ = CompiledBlock
            changed += 1
    return changed
