"""Fusing the projections of a layer that read the same input into one matmul.

On MLX CUDA a decode pass of a few rows is bound by the host, not the GPU: the host
builds and submits each pass's ops while the GPU waits for them (an 8B model at 8 rows
on an H100: 0.2-0.4 ms of a 10 ms pass waiting on the GPU; BENCHMARKS.md, "a decode
pass is host-bound"), and MLX builds a cuBLASLt matmul for each matmul of more than one
row at every call (11-15 us of host time each there; bench/matmul_host.py). A
Llama-style layer has seven matmuls: q, k and v read the same input, and so do gate and
up. Fused, they are four, with the same arithmetic: the weights are concatenated by
output rows (for a quantized layer its scales and biases too, whose groups run along the
input), the fused output is split back into the parts as views.

The parts keep their names: `q_proj` becomes a `Part` that takes its slice of the fused
output, computed once for the input all of a group's parts read (mlx-lm's models call
`q_proj(x)`, `k_proj(x)`, `v_proj(x)` in turn). The fused layer sits beside them as
`qkv_proj` / `gate_up_proj`, and the parts are plain attributes, not modules, so the
model's parameters hold each weight once.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn

from appliance.platform import wanted_here

# the projections fused into one, by the name of the fused one
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class Fused:
    """One matmul for a group's projections (`linear`, their weights concatenated);
    `take(x, i)` is part i's output for `x`. A plain object, not a Module: what it holds
    between the parts' calls is no parameter."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        self.linear = linear
        self._splits = list(itertools.accumulate(sizes))[:-1]
        self._parts = len(sizes)
        self._input: mx.array | None = None
        self._outputs: list[mx.array] = []
        self._taken = 0

    def take(self, x: mx.array, i: int) -> mx.array:
        if x is not self._input:
            self._outputs = mx.split(self.linear(x), self._splits, axis=-1)
            self._input, self._taken = x, 0
        out = self._outputs[i]
        self._taken += 1
        if self._taken == self._parts:  # every part has its output: hold nothing past the layer
            self._input, self._outputs = None, []
        return out


class Part:
    """Part `index` of a fused group, called as the projection it replaces."""

    def __init__(self, fused: Fused, index: int):
        self.fused = fused
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self.fused.take(x, self.index)


def fuse_as_asked(model: nn.Module, choice: str) -> int:
    """Fuses `model`'s projections if `choice` asks for it here; returns the groups fused.
    The parts' buffers, freed, leave MLX's buffer cache (they match no later allocation)."""
    if not wanted_here(choice):
        return 0
    fused = fuse_projections(model)
    mx.clear_cache()
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuses each group of `GROUPS` found in `model`'s modules whose projections are alike
    (all Linear, or all QuantizedLinear of one bits, group size and mode; the same input
    size, all with a bias or none); returns how many groups it fused. Each group's
    weights are evaluated before the next is fused, so the copies in flight are one
    group's."""
    fused = 0
    for parent in [m for _, m in model.named_modules()]:
        for name, members in GROUPS.items():
            linears = [parent.get(m) for m in members]
            if name in parent or not _alike(linears):
                continue
            linear = _concatenated(linears)
            mx.eval(linear.parameters())
            group = Fused(linear, [lin.weight.shape[0] for lin in linears])
            parent[name] = linear
            for i, member in enumerate(members):
                del parent[member]
                object.__setattr__(parent, member, Part(group, i))
            fused += 1
    return fused


def _alike(linears: list) -> bool:
    first = linears[0]
    if not all(type(lin) is type(first) for lin in linears) or type(first) not in (nn.Linear, nn.QuantizedLinear):
        return False
    same = ("bits", "group_size", "mode") if isinstance(first, nn.QuantizedLinear) else ()
    return (all(getattr(lin, k) == getattr(first, k) for lin in linears for k in same)
            and len({lin.weight.shape[1] for lin in linears}) == 1
            and len({lin.weight.dtype for lin in linears}) == 1
            and len({"bias" in lin for lin in linears}) == 1)


def _concatenated(linears: list) -> nn.Module:
    """A module of `linears`' kind whose output rows are theirs, one after another."""
    first = linears[0]
    out = type(first).__new__(type(first))
    nn.Module.__init__(out)
    for key, value in first.items():
        if isinstance(value, mx.array):
            out[key] = mx.concatenate([lin[key] for lin in linears], axis=0)
    for key in ("bits", "group_size", "mode"):
        if hasattr(first, key):
            setattr(out, key, getattr(first, key))
    if isinstance(first, nn.QuantizedLinear):
        out.freeze()  # as QuantizedLinear freezes its own
    return out
