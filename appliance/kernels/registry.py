"""Which implementation of each kernel runs: `[kernels]` asks per kernel for `auto`,
`generic` or `native`; this module knows what the running backend has and answers.

`auto` takes the native kernel where the backend has one and its self-test passed at load,
else the generic one; `native` where the backend has none is refused when the spec is
validated. No native kernel exists yet on any backend (CUDA and Metal versions come with a
GPU machine to test them on), so every kernel runs its generic path, and the status says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

# kernel -> what it does (the [kernels] key is the kernel's name)
KERNELS = {
    "kv_quantize": "gather-and-quantize of a finished request's KV blocks on their way down a tier",
    "kv_dequantize": "dequantize-and-scatter of restored KV blocks into the running batch's cache",
}
# kernel -> the backends that have a native version of it
NATIVE: dict[str, frozenset[str]] = {name: frozenset() for name in KERNELS}


@dataclass(frozen=True)
class Selection:
    kernel: str
    asked: str  # auto | generic | native
    chosen: str  # generic | native
    why: str


@cache
def backend() -> str:
    """Returns the backend MLX runs on here: cuda, metal or cpu."""
    import mlx.core as mx

    if mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "cpu"


def refusal(kernel: str, asked: str) -> str | None:
    """Returns why `asked` cannot run `kernel` on this backend, or None when it can."""
    if asked == "native" and backend() not in NATIVE[kernel]:
        return f"no native {kernel} kernel for the {backend()} backend; use auto or generic"
    return None


def select(kernel: str, asked: str) -> Selection:
    """Returns what runs `kernel` when `asked` (validated: never a refusal here)."""
    if asked == "generic":
        return Selection(kernel, asked, "generic", "asked for")
    if backend() in NATIVE[kernel]:
        return Selection(kernel, asked, "native", f"the {backend()} kernel passed its self-test")
    return Selection(kernel, asked, "generic", f"no native {kernel} kernel for the {backend()} backend yet")


def report(asked: dict[str, str]) -> dict[str, dict[str, str]]:
    """Returns the status's `kernels`: per kernel, what was asked, what runs and why."""
    return {name: {k: v for k, v in vars(select(name, choice)).items() if k != "kernel"}
            for name, choice in asked.items()}
