"""Follows omlx.toml and the profiles it layers; every burst of changes is one reconcile.

Level-triggered: an event only says "look again". The whole spec is re-read and compared
with what is applied, so editor saves (temp file + rename), half-written files and
repeated events all end in the same place: the last valid file, applied once.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from watchfiles import awatch

from appliance.config import ConfigError, load_spec, profile_dirs
from appliance.reconcile.apply import Outcome, Reconciler

log = logging.getLogger("omlx.reconcile")
logging.getLogger("watchfiles").setLevel(logging.WARNING)  # one line per event is noise

RECHECK_MS = 1000
DEBOUNCE_MS = 50  # editors write in bursts; one look after the burst is enough


async def reconcile_now(reconciler: Reconciler) -> Outcome | None:
    """Re-reads the config file and applies it; returns None when the file is invalid."""
    path = reconciler.appliance.config.path
    try:
        desired = await asyncio.to_thread(load_spec, path)
    except ConfigError as e:
        reconciler.reject(e)
        return None
    return await reconciler.apply(desired)


async def watch(reconciler: Reconciler, stop: asyncio.Event) -> None:
    """Reconciles on every change to the config or its profiles until `stop` is set."""
    # Polled, not awaited in a thread: a stop while models load (the port taken at start,
    # SIGTERM) must not wait for the load, and asyncio.run joins its executor's threads.
    while not reconciler.appliance.loaded.is_set():
        if stop.is_set():
            return
        await asyncio.sleep(0.1)
    first = True
    while not stop.is_set():
        files = watched_files(reconciler)
        dirs = {f.parent for f in files} | {d for d in profile_dirs(reconciler.appliance.config.path) if d.is_dir()}
        # The state is taken before reconciling, and compared again on every event and at
        # least once a second: an edit saved between the two, or before the watch began,
        # raises no event of its own.
        seen = toml_state(dirs)
        if first:
            await reconcile_now(reconciler)  # edits saved while the models were loading
            first = False
        async for _ in awatch(*dirs, stop_event=stop, debounce=DEBOUNCE_MS, step=DEBOUNCE_MS,
                              recursive=False, ignore_permission_denied=True,
                              rust_timeout=RECHECK_MS, yield_on_timeout=True):
            # Event paths vary with how editors save (renames, swap files); what counts is
            # whether any TOML file here (a layer, or one that may become one) changed.
            now = toml_state(dirs)
            if now == seen:
                continue
            seen = now
            try:
                await reconcile_now(reconciler)
            except Exception:  # a bug in one apply must not stop the watcher
                log.exception("reconcile failed")
            if watched_files(reconciler) != files:
                break  # the profile changed: follow the new set of files


def toml_state(dirs: set[Path]) -> frozenset:
    """Returns (path, mtime, size, inode) of every TOML file in `dirs`."""
    state = set()
    for d in dirs:
        for f in d.glob("*.toml"):
            try:
                st = f.stat()
            except OSError:
                continue
            state.add((str(f), st.st_mtime_ns, st.st_size, st.st_ino))
    return frozenset(state)


def watched_files(reconciler: Reconciler) -> set[Path]:
    """Returns the config file and the profile files it layers (as last read)."""
    config = reconciler.appliance.config
    files = {config.path}
    try:
        files |= set(load_spec(config.path).files)
    except ConfigError:
        files |= set(config.files)
    return {f.resolve() for f in files}
