"""A model's Linear layers, run by our small-matmul kernel where a call has few rows.

A decode pass of a few sequences on MLX CUDA is bound by the host, and MLX runs each
matmul of more than one row through cuBLASLt at ~13 µs of the host's time a call
(kernels/small_matmul.py). `use_native_linear` makes each Linear layer a `NativeLinear`:
the same layer, with the same parameters, whose calls of 2 to `small_matmul.ROWS` rows
(a decode pass's) in the weight's dtype run our kernel while `small_matmul.in_use()` says
so (the `[kernels]` key `small_matmul`, once the native kernels' self-test has passed, and
with `auto` the engine's measured choice, engine/matmul_choice.py); every other call,
and every call while it is off, is the plain Linear's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from appliance.kernels import small_matmul


class NativeLinear(nn.Linear):
    """A Linear whose few-row calls run kernels/small_matmul.py (see the module)."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        k = x.shape[-1]
        if small_matmul.in_use() and 2 * k <= x.size <= small_matmul.ROWS * k and x.dtype == w.dtype:
            y = small_matmul.matmul(x, w)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)  # MLX's matmul, which also promotes unlike dtypes


def native_linear_here(model: nn.Module) -> int:
    """`use_native_linear` where the backend has the kernel (CUDA); elsewhere changes
    nothing and returns 0."""
    from appliance.kernels.registry import NATIVE, backend

    return use_native_linear(model) if backend() in NATIVE["small_matmul"] else 0


def use_native_linear(model: nn.Module) -> int:
    """Makes each Linear layer of `model` the kernel can compute a `NativeLinear` (in
    place: its parameters stay as they are); returns how many. Quantized layers and
    others stay as they are."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear and small_matmul.unsupported_weight(module["weight"]) is None:
            module.__class__ = NativeLinear
            changed += 1
    return changed
