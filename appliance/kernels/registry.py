"""Which implementation of each kernel runs: `[kernels]` asks per kernel for `auto`,
`generic` or `native`; this module knows what the running backend has and answers.

`auto` takes the native kernel where the backend has one and its self-test passed, else
the generic one; `native` where the backend has none is refused when the spec is
validated. CUDA has native versions of all three kernels (the KV moves in
kernels/kv_move.py, the few-row matmul in kernels/small_matmul.py, sources in
kernels/cuda/); Metal and CPUs run the generic paths (a Metal version comes with a Mac to
test it on). The self-test checks the native kernels against the generic paths once per
process, on a thread and stream of its own (`SELF_TEST.start`), so it never delays
readiness; until it passes, the generic paths run. A kernel that fails it runs
generically, the others natively. `auto` for `small_matmul` goes one step further: each
engine runs it or MLX's matmuls per count of rows, whichever its measured decode passes
find faster (engine/matmul_choice.py), since which wins depends on the host. The kernels
are compiled by NVRTC once per machine (kernels/cubins.py), not by MLX in each process:
MLX holds the lock every kernel lookup takes while it compiles, which stalled the warm-up
and the load.
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
    "small_matmul": "Linear layers' matmuls of 2-16 rows (a decode pass's), sparing the host cuBLASLt's cost a call",
}
# kernel -> the backends that have a native version of it
NATIVE: dict[str, frozenset[str]] = {name: frozenset({"cuda"}) for name in KERNELS}
# kernel -> the self-test that checks it (the two KV kernels are checked together)
CHECKED_BY = {"kv_quantize": "kv", "kv_dequantize": "kv", "small_matmul": "small_matmul"}
# the kernels whose `auto` engines choose from measured passes, once native runs
MEASURED = frozenset({"small_matmul"})


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
    """The native kernels' one self-test per process: not started, running, or done with
    what failed per kernel (`failures`: kernel -> what went wrong, or None where it passed)."""

    def __init__(self):
        self.done = threading.Event()
        self.failures: dict[str, str | None] = {}
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

        from appliance.kernels import kv_move, small_matmul
        from appliance.kernels.gate import GATE
        from appliance.kernels.pinned import available

        tests = {"kv": lambda: available() or kv_move.self_test(), "small_matmul": small_matmul.self_test}
        failures = {}
        for name, test in tests.items():
            try:
                # Beside the engines' work, not in it; between their steps: loading a kernel
                # module may synchronize the device (kernels/gate.py; compiling holds no gate).
                with GATE.alone(), mx.stream(mx.new_stream(mx.gpu)):
                    failures[name] = test()
            except Exception as e:
                failures[name] = f"{type(e).__name__}: {e}"
        self.failures = {kernel: failures[CHECKED_BY[kernel]] for kernel in KERNELS}
        for name, failure in failures.items():
            if failure is None:
                log.info("native %s %s kernels passed their self-test", backend(), name)
            else:
                log.warning("native %s %s kernels failed their self-test (the generic paths run): %s",
                            backend(), name, failure)
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
    if (failure := SELF_TEST.failures.get(kernel)) is not None:
        return Selection(kernel, asked, "generic", f"the {backend()} kernel failed its self-test: {failure}")
    why = f"the {backend()} kernel passed its self-test"
    if asked == "auto" and kernel in MEASURED:
        why += "; each engine runs it or MLX's matmuls per count of rows, whichever its decode passes measure faster"
    return Selection(kernel, asked, "native", why)


_applies = itertools.count()
_latest = [0]


def apply(asked: dict[str, str], use) -> None:
    """Calls `use(chosen)` (kernel -> its `Selection`) with what runs now,
    and again once the self-test has finished where a native kernel waits on it (unless
    another `apply` came in between). `switch` is the appliance's `use`."""
    this = _latest[0] = next(_applies)

    def now() -> None:
        if _latest[0] != this:
            return
        use({name: select(name, choice) for name, choice in asked.items()})

    now()
    if any(c != "generic" and backend() in NATIVE[name] for name, c in asked.items()):
        SELF_TEST.start(on_done=now)


def report(asked: dict[str, str]) -> dict[str, dict[str, str]]:
    """Returns the status's `kernels`: per kernel, what was asked, what runs and why."""
    return {name: {k: v for k, v in vars(select(name, choice)).items() if k != "kernel"}
            for name, choice in asked.items()}


def switch(store, chosen: dict[str, Selection]) -> None:
    """Runs what `chosen` says: the models' few-row matmuls (kernels/small_matmul.py), and
    the KV store's moves to and from host memory (`store`, where there is one)."""
    from appliance.kernels import small_matmul

    def native(kernel: str) -> bool:
        return kernel in chosen and chosen[kernel].chosen == "native"

    small_matmul.ENABLED = native("small_matmul")
    small_matmul.MEASURED = small_matmul.ENABLED and chosen["small_matmul"].asked == "auto"
    if store is not None:
        store.use_native(quantize=native("kv_quantize"), dequantize=native("kv_dequantize"))
