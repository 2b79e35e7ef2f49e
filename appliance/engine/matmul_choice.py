"""Which matmuls an engine's decode passes of few rows run, chosen from measured passes.

On MLX CUDA a decode pass of 2 to `small_matmul.ROWS` rows can run its Linear layers'
matmuls through our small-matmul kernel (kernels/small_matmul.py) or through MLX's
cuBLASLt. Which is faster depends on the host: on an H100 whose host was slow the pass
was host-bound and ours won by 1.6-2.4 ms a pass; where the host was fast, MLX's won on
the mean pass (7.3-7.7 ms against 7.7-8.1 at 8 rows), since one of our passes in 5-11
took 14-22 ms inside MLX's submit (BENCHMARKS.md, "`batch_generate` in turn with the
servers"). So with `[kernels] small_matmul = "auto"` each engine measures its own passes
(`small_matmul.MEASURED`), per count of rows: it runs WINDOW passes with each, in turn,
until each has WINDOWS windows; then the faster by mean pass for EXPLOIT passes; then
one window of the other, one of the faster again, and chooses anew from the last
WINDOWS windows of each (the other lost by more than CLEAR: FAR times as many passes
first). Passes that waited on a prefill call, or on a pass unlike them (the first SETTLE
after a switch or a change of rows), or that took OUTLIER times their window's fastest
(a compile), measure nothing. Once both are measured, about one pass in seventeen runs
the slower choice (34 of 580; one in sixty where it lost clearly), so a wrong guess costs
little and a host that changes is followed. Where the engine does not choose (other
rows, or `native` asked for), its thread runs ours.
"""

from __future__ import annotations

import logging
from collections import deque
from statistics import fmean

from appliance.kernels import small_matmul

log = logging.getLogger("omlx.engine")

WINDOW = 32  # measured passes a window: 8-row passes take ~8 ms, one in 5-11 twice that
WINDOWS = 4  # windows of each choice a choice weighs
EXPLOIT = 512  # measured passes the faster runs between probes of the other
CLEAR = 1.1  # a choice this much slower than the other is probed FAR times less often
FAR = 4
SETTLE = 2  # passes after a switch that measure nothing: the first was built before it
# A pass this many times its window's fastest measures nothing: a kernel compiled for a
# new shape (~1 s on an H200), not the matmuls (slow passes took 2-3x the median).
OUTLIER = 5


class _Rows:
    """One count of rows' measurements and plan: (native, measured passes) stretches."""

    def __init__(self):
        self.windows: dict[bool, deque[float]] = {True: deque(maxlen=WINDOWS), False: deque(maxlen=WINDOWS)}
        self.plan: deque[tuple[bool, int]] = deque((native, WINDOW) for _ in range(WINDOWS) for native in (True, False))
        self.native, self.left = self.plan.popleft()
        self.window: list[float] = []
        self.chosen: bool | None = None  # the last choice, once one was made

    def record(self, seconds: float) -> None:
        """Counts a measured pass of the current stretch; moves to the next stretch at its end."""
        self.window.append(seconds)
        if len(self.window) == WINDOW:
            floor = OUTLIER * min(self.window)  # the window's own: passes slow as the KV grows
            self.windows[self.native].append(fmean(s for s in self.window if s <= floor))
            self.window = []
        self.left -= 1
        if self.left <= 0:
            self._next()

    def _next(self) -> None:
        if not self.plan:
            self.plan.extend(self._choose())
        native, self.left = self.plan.popleft()
        if native != self.native:
            self.native, self.window = native, []

    def _choose(self) -> list[tuple[bool, int]]:
        """Returns the next stretches: the faster for EXPLOIT passes, then a probe of each."""
        means = {native: fmean(w) for native, w in self.windows.items()}
        faster = means[True] <= means[False]
        if faster != self.chosen:
            log.info("small_matmul: passes of these rows now run %s (mean pass %.2f ms ours, %.2f ms MLX's)",
                     "our kernel" if faster else "MLX's matmuls", 1000 * means[True], 1000 * means[False])
        self.chosen = faster
        clear = means[not faster] > CLEAR * means[faster]  # on a slow host ours won by 15-25%
        return [(faster, EXPLOIT * (FAR if clear else 1)), (not faster, WINDOW), (faster, WINDOW)]


class MatmulChoice:
    """An engine's choice per count of rows (see the module); engine thread only."""

    def __init__(self):
        self._rows: dict[int, _Rows] = {}
        self._pass: tuple[int, bool | None] | None = None  # the last pass's rows and matmuls
        self._alike = 0  # passes in a row of those rows and matmuls

    @staticmethod
    def measuring(rows: int) -> bool:
        """Returns whether passes of `rows` rows are chosen for here."""
        return small_matmul.MEASURED and 2 <= rows <= small_matmul.ROWS

    def before(self, rows: int) -> None:
        """Sets this thread's matmuls for a pass of `rows` rows about to be built."""
        native = None
        if self.measuring(rows):
            if rows not in self._rows:  # made once: this runs before every pass
                self._rows[rows] = _Rows()
            native = self._rows[rows].native
        small_matmul.use_here(native is not False)  # ours, unless MLX's were chosen here
        self._alike = self._alike + 1 if self._pass == (rows, native) else 1
        self._pass = rows, native

    def after(self, rows: int, seconds: float, *, measured: bool) -> None:
        """Takes the pass of `rows` rows `before` was told of: `seconds`, counted when
        `measured` (nothing else queued on the GPU fed it) and the passes before it were
        alike (SETTLE)."""
        if measured and self._alike > SETTLE and self.measuring(rows) and rows in self._rows:
            self._rows[rows].record(seconds)

    @property
    def last(self) -> str | None:
        """Returns what the last pass's few-row matmuls ran, native or generic, when chosen here."""
        native = self._pass[1] if self._pass else None
        return None if native is None else "native" if native else "generic"

    def choices(self) -> dict[int, str]:
        """Returns, per count of rows measured, what its passes run now: native or generic."""
        states = sorted(self._rows.items())  # one C call under the GIL: safe from the status's thread
        return {rows: "native" if state.native else "generic" for rows, state in states}
