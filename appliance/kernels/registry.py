"""Which implementation of each kernel runs: `[kernels]` asks per kernel for `auto`,
`generic` or `native`; this module knows what the running backend has and answers.

`auto` takes the native kernel where the backend has one and its self-test passed, else
the generic one; `native` where the backend has none is refused when the spec is
validated. CUDA has native versions of both kernels (kernels/kv_move.py, sources in
kernels/cuda/); Metal and CPUs run the generic paths (a Metal version comes with a Mac to
test it on). The self-test checks the native kernels against the generic path once per
process, on a thread and stream of its own (`SELF_TEST.start`), so it never delays
readiness; until it passes, the generic paths run. The kernels are compiled by NVRTC once
per machine (kernels/cubins.py), not by MLX in each process: MLX holds the lock every
kernel lookup takes while it compiles, which stalled the warm-up and the load.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from functools import cache

log = logging.getLogger("omlx.kernels")

# kernel -> what it does (the [kernels] key is the kernel's name)
KERNELS = {
    "kv_quantize": "gather-and-quantize of KV blocks on their way down to host memory (pinned, on CUDA)",
    "kv_dequantize": "dequantize of KV blocks from host memory (pinned, on CUDA) on their way back to the batch",
}
# kernel -> the backends that have a native version of it
NATIVE: dict[str, frozenset[str]] = {name: frozenset({"cuda"}) for name in KERNELS}


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


class _SelfTest:
    """The native kernels' one self-test per process: not started, running, passed or failed."""

    def __init__(self):
        self.done = threading.Event()
        self.failure: str | None = None
        self._started = False
        self._lock = threading.Lock()
        self._listeners: list = []

    def start(self, on_done=None) -> None:
        """Starts the test on its own thread once; `on_done()` runs when it has finished
        (at once if it already has)."""
        with self._lock:
            if on_done is not None:
                if self.done.is_set():
                    on_done()
                else:
                    self._listeners.append(on_done)
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name="kernel-self-test", daemon=True).start()

    def _run(self) -> None:
        import mlx.core as mx

        from appliance.kernels import kv_move
        from appliance.kernels.pinned import available

        try:
            with mx.stream(mx.new_stream(mx.gpu)):  # beside the engines' work, not in it
                self.failure = available() or kv_move.self_test()
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"
        if self.failure is None:
            log.info("native %s kernels passed their self-test", backend())
        else:
            log.warning("native %s kernels failed their self-test (the generic paths run): %s",
                        backend(), self.failure)
        with self._lock:
            self.done.set()
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()


SELF_TEST = _SelfTest()


def refusal(kernel: str, asked: str) -> str | None:
    """Returns why `asked` cannot run `kernel` on this backend, or None when it can."""
    if asked == "native" and backend() not in NATIVE[kernel]:
        return f"no native {kernel} kernel for the {backend()} backend; use auto or generic"
    return None


def select(kernel: str, asked: str) -> Selection:
    """Returns what runs `kernel` when `asked` (validated: never a refusal here)."""
    if asked == "generic":
        return Selection(kernel, asked, "generic", "asked for")
    if backend() not in NATIVE[kernel]:
        return Selection(kernel, asked, "generic", f"no native {kernel} kernel for the {backend()} backend yet")
    if not SELF_TEST.done.is_set():
        return Selection(kernel, asked, "generic", f"the {backend()} kernel's self-test has not finished")
    if SELF_TEST.failure is not None:
        return Selection(kernel, asked, "generic", f"the {backend()} kernel failed its self-test: {SELF_TEST.failure}")
    return Selection(kernel, asked, "native", f"the {backend()} kernel passed its self-test")


_applies = itertools.count()
_latest = [0]


def apply(asked: dict[str, str], use) -> None:
    """Calls `use(quantize=..., dequantize=...)` with what runs now, and again once the
    self-test has finished where a native kernel waits on it (unless another `apply` came
    in between)."""
    this = _latest[0] = next(_applies)

    def now() -> None:
        if _latest[0] != this:
            return
        chosen = {name: select(name, choice).chosen == "native" for name, choice in asked.items()}
        use(quantize=chosen.get("kv_quantize", False), dequantize=chosen.get("kv_dequantize", False))

    now()
    if any(c != "generic" and backend() in NATIVE[name] for name, c in asked.items()):
        SELF_TEST.start(on_done=now)


def report(asked: dict[str, str]) -> dict[str, dict[str, str]]:
    """Returns the status's `kernels`: per kernel, what was asked, what runs and why."""
    return {name: {k: v for k, v in vars(select(name, choice)).items() if k != "kernel"}
            for name, choice in asked.items()}
