"""A record of every engine step, one JSON line each, for finding where a load's time goes.

Set `OMLX_STEP_TRACE` to a file path and every engine of the process appends to it one
line a step: when it ran, the requests running and waiting, what started and what came
out, the prefill calls and the prompt tokens advanced, the seconds of each phase
(engine.PHASES), the engine thread's CPU time over the step (`cpu_ms`: near the step's
time, the host sets the pace), each model call the step made (`Scheduler.last_calls`), and
what its last pass's few-row matmuls ran (`small_matmul`: native, generic, or null where
the engine does not choose; engine/matmul_choice.py). The
benchmarks set it to split a load measured over HTTP into its steps
(bench/throughput.py); unset, an engine writes nothing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import BinaryIO

import orjson

ENV = "OMLX_STEP_TRACE"


class StepTrace:
    """Appends one JSON object a line to a file, from any engine thread."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._file: BinaryIO = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the process

    @classmethod
    def from_env(cls) -> StepTrace | None:
        """Returns the trace `OMLX_STEP_TRACE` names, shared by the process; None when unset."""
        path = os.environ.get(ENV)
        if not path:
            return None
        with _shared_lock:
            if path not in _shared:
                _shared[path] = cls(Path(path))
            return _shared[path]

    def write(self, model: str, record: dict) -> None:
        line = orjson.dumps({"t": round(time.time(), 4), "model": model, **record}) + b"\n"
        with self._lock:
            self._file.write(line)


_shared: dict[str, StepTrace] = {}
_shared_lock = threading.Lock()
