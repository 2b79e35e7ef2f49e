"""Applying a plan: every action prepares beside what serves; all commit only if all worked.

A failed action undoes the actions before it, in reverse, and the previous config keeps
serving; `config.last_error` says what failed, where in the TOML, and when. What each
action does lives with it, in `actions.py`; this is only the order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from appliance.config import ConfigError, LoadedConfig
from appliance.reconcile.actions import Action, Run, Step, Thunk
from appliance.reconcile.plan import plan
from appliance.runtime import Appliance

log = logging.getLogger("omlx.reconcile")


@dataclass(frozen=True)
class Outcome:
    applied: bool
    hash: str
    actions: tuple[str, ...] = ()
    error: dict | None = None
    seconds: float = 0.0


class StepFailed(Exception):
    def __init__(self, action: Action, path: str, cause: BaseException):
        super().__init__(f"{action.describe()} failed: {cause}")
        self.path = path


class Reconciler:
    """Makes the running appliance what the config says, one apply at a time."""

    def __init__(self, appliance: Appliance, *, rebind: Callable[[str, int], Awaitable[Any]] | None = None):
        self.appliance = appliance
        self._rebind = rebind  # opens a socket beside the current one; returns a closer pair
        self._lock = asyncio.Lock()
        self.applies = 0
        self.failures = 0  # applies undone and files rejected (for /metrics)

    async def apply(self, desired: LoadedConfig) -> Outcome:
        """Applies `desired`; returns what happened (an unchanged spec is a no-op)."""
        async with self._lock:
            started = time.perf_counter()
            app = self.appliance
            actions = plan(app.spec, desired.spec)
            run = Run(app, desired, store=app.store, rebind=self._rebind)
            done: list[Step] = []
            try:
                for action in actions:
                    log.info("applying: %s", action.describe())
                    done.append(await prepare(action, run))
            except StepFailed as e:
                for step in reversed(done):
                    await _call(step.undo)
                app.last_error = error_record(str(e), path=e.path, file=desired.path)
                self.failures += 1
                log.error("config not applied, the previous one keeps serving: %s", e)
                return Outcome(False, app.spec.hash, tuple(a.describe() for a in actions), app.last_error,
                               time.perf_counter() - started)
            app.config = desired
            for step in done:
                await _call(step.commit)
            app.last_error = None
            self.applies += 1
            if actions:
                log.info("config %s applied in %.2f s (%d actions)", desired.spec.hash,
                         time.perf_counter() - started, len(actions))
            return Outcome(True, desired.spec.hash, tuple(a.describe() for a in actions), None,
                           time.perf_counter() - started)

    def reject(self, error: ConfigError) -> None:
        """Records an invalid file: nothing changes, the error shows in the status."""
        first = error.issues[0] if error.issues else None
        self.failures += 1
        self.appliance.last_error = error_record(str(error), path=first.path if first and first.path else None,
                                                 file=error.file)
        log.error("config file invalid, the previous config keeps serving:\n%s", error)


async def prepare(action: Action, run: Run) -> Step:
    """Returns the prepared `action`'s step; raises StepFailed naming its TOML path."""
    try:
        return await action.prepare(run)
    except Exception as e:
        raise StepFailed(action, action.path_in(run.desired.spec), e) from e


def error_record(message: str, *, path: str | None, file: Any) -> dict:
    return {"message": message, "path": path, "file": str(file) if file else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


async def _call(thunk: Thunk | None) -> None:
    if thunk is None:
        return
    result = thunk()
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result
